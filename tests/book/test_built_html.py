"""The built book, as a reader gets it: `make test` runs these after `jupyter-book build`.

Every page the table of contents lists: no error output from a cell, no words the reader
cannot resolve (the notes the course grew from are not public), no unresolved reference,
no raw NumPy repr in the text, and every image a chapter shows is there.
"""

import html
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HTML = REPO / "_build" / "html"
# the chapters are the numbered parts of the table of contents, in its order
TOC = (REPO / "_toc.yml").read_text()
NOT_CHAPTERS = ("intro", "notation", "which_parallelism", "sizing", "your_trace", "status",
                "bibliography")
CHAPTERS = [name for name in re.findall(r"file: book/(\w+)", TOC) if name not in NOT_CHAPTERS]
PAGES = ["intro", *CHAPTERS, "notation", "which_parallelism", "sizing", "your_trace", "status",
         "bibliography"]
assert "traces" in CHAPTERS and len(CHAPTERS) >= 14   # the parser reads the real toc

if not (HTML / "book" / "intro.html").is_file():
    pytest.skip("the book is not built: run `make book` first (make test does)",
                allow_module_level=True)


def page(name):
    return (HTML / "book" / f"{name}.html").read_text(encoding="utf-8")


def text_of(markup):
    """The text a reader sees: no scripts, styles or tags."""
    markup = re.sub(r"<(script|style)\b.*?</\1>", " ", markup, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", markup))


def test_every_page_of_the_table_of_contents_is_built():
    toc = (REPO / "_toc.yml").read_text()
    for name in PAGES:
        assert f"book/{name}" in toc, name
        assert (HTML / "book" / f"{name}.html").is_file(), name


@pytest.mark.parametrize("name", PAGES)
def test_no_cell_printed_an_error(name):
    markup = page(name)
    assert 'class="output stderr"' not in markup
    for words in ("Traceback (most recent call last)", "LabError", "Exception:"):
        assert words not in text_of(markup), words


@pytest.mark.parametrize("name", PAGES)
def test_no_word_the_reader_cannot_resolve(name):
    text = text_of(page(name)).lower()
    for words in ("the seeds", "seeds'", "notes this course grew from"):
        assert words not in text, words


@pytest.mark.parametrize("name", PAGES)
def test_every_reference_is_resolved(name):
    markup = page(name)
    # Sphinx leaves an unresolved cross-reference as a bare "xref" span, and an
    # unresolved glue or citation as its source text
    assert 'class="xref' not in markup
    for source in ("{glue:text}", "{glue:}", "{cite}", "{numref}", "{ref}", "{eq}"):
        assert source not in text_of(markup), source


@pytest.mark.parametrize("name", PAGES)
def test_no_raw_numpy_repr(name):
    text = text_of(page(name))
    assert not re.search(r"\bnp\.(float|int)\d*\(|\barray\(\[", text)


@pytest.mark.parametrize("name", CHAPTERS)
def test_every_image_of_a_chapter_is_there(name):
    sources = re.findall(r'<img [^>]*src="([^"]+)"', page(name))
    figures = [s for s in sources if "_images/" in s]
    assert figures, f"{name} shows no figure"
    for source in figures:
        assert (HTML / "book" / source).resolve().is_file(), source


@pytest.mark.parametrize("name", PAGES)
def test_each_inline_script_once(name):
    # a second `const` declaration of the same name is a SyntaxError in the console
    declarations = re.findall(r"<script>\s*const (\w+)", page(name))
    assert len(declarations) == len(set(declarations)), declarations


def test_the_status_page_gives_the_budget_in_units():
    # every chapter's time in seconds and in units of a bare 2-rank launch measured in
    # the same build, the unit itself, and no chapter failed
    text = " ".join(text_of(page("status")).split())
    assert "One unit here:" in text and "bare 2-rank torchrun launch" in text
    rows = re.findall(r" (\d+\.\d) (\d+\.\d) (ok|failed)", text)   # seconds, units, status
    # the reference pages compute their numbers with the cost models: executed too
    assert len(rows) == len(CHAPTERS) + len(("notation", "which_parallelism")), rows
    assert all(status == "ok" for *_, status in rows)


def test_the_gpu_references_are_listed_or_said_to_be_none():
    # the status page lists each results/<gpu>-x<N>/ box; each chapter's section on a GPU
    # box shows its labs' references, or says none is recorded for a lab
    import sys
    sys.path.insert(0, str(REPO / "labs"))
    from labkit.runtime import references
    boxes = references.boxes()
    status = " ".join(text_of(page("status")).split())
    if boxes:
        assert all(f"results/{folder}" in status for folder, _ in boxes), status
    else:
        assert "No GPU reference is recorded yet" in status
    fsdp = " ".join(text_of(page("fsdp")).split())
    if not references.references("fsdp"):
        assert "No GPU reference is recorded for labs/fsdp.py yet" in fsdp


# What a sentence ending in ":" may introduce: anything a reader can see. An executed cell
# whose input is hidden and whose value was never displayed (a table built, then an
# assert after it) leaves an empty box or nothing: the sentence then points at nothing.
SHOWN = ("table", "img", "svg", "pre", "ul", "ol", "dl", "figure", "iframe", "blockquote")


def shows_something(element):
    if element.name in SHOWN or element.find(SHOWN):
        return True
    classes = element.get("class") or []
    if "math" in classes or element.find(class_="math"):
        return True
    return element.name not in ("p", "section") and not re.match(r"h\d$", element.name) \
        and bool(element.get_text(strip=True))


def colons_followed_by_nothing(markup):
    """The paragraphs of a page that end in ":" with nothing shown after them."""
    from bs4 import BeautifulSoup
    article = BeautifulSoup(markup, "html.parser").find("article")
    found = []
    for p in article.find_all("p"):
        text = " ".join(p.get_text().split())
        # a list item's, a table cell's or a definition's own colon introduces its text
        if not text.endswith(":") or p.find_parent(["li", "td", "th", "dd", "dt"]) \
                or "admonition-title" in (p.get("class") or []):
            continue
        following = p.find_next_sibling()
        if following is not None and following.name in ("p", "ul", "ol", "dl"):
            continue   # prose introducing prose: the paragraphs or the list right after it
        # empty boxes (a cell that printed nothing) are not something shown
        while following is not None and following.name == "div" \
                and not shows_something(following):
            following = following.find_next_sibling()
        if following is None or not shows_something(following):
            found.append(text[-80:])
    return found


@pytest.mark.parametrize("name", PAGES)
def test_no_sentence_ending_in_a_colon_introduces_nothing(name):
    assert colons_followed_by_nothing(page(name)) == []


@pytest.mark.parametrize("name", CHAPTERS)
def test_each_chapter_says_where_its_numbers_come_from(name):
    # book/_ext/where_numbers.py: a banner right under the title, naming the build's CPU
    # and gloo, and the GPU boxes of results/ that ran the chapter's labs, if any
    markup = page(name)
    # right after the chapter's title
    banner = re.search(r'</h1>\s*<div class="where-numbers admonition">(.*?)</div>', markup,
                       re.S)
    assert banner, "no banner under the title"
    text = " ".join(text_of(banner.group(1)).split())
    assert "Where the numbers come from" in text and "CPU" in text and "gloo" in text
    assert "status page" in text


def test_the_intro_says_where_the_numbers_come_from_and_links_the_reference_pages():
    text = " ".join(text_of(page("intro")).split())
    assert "Where the numbers come from" in text and "gloo" in text
    for name in ("notation", "which_parallelism", "sizing", "your_trace", "precision",
                 "status"):
        assert f'href="{name}.html' in page("intro"), name


@pytest.mark.parametrize("name", PAGES)
def test_each_file_a_page_names_links_to_its_source(name):
    # book/_ext/source_links.py: `labs/hybrid.py` in the prose opens the file in the
    # repository; a name that is no file (a command line) stays plain
    from bs4 import BeautifulSoup
    article = BeautifulSoup(page(name), "html.parser").find("article")
    for code in article.find_all("code", class_="literal"):
        text = code.get_text().strip()
        if not re.fullmatch(r"(labs|labkit|benchmarks)/[\w./-]+\.py", text):
            continue
        if not any((REPO / path).is_file() for path in (text, f"labs/{text}")):
            continue
        link = code.find_parent("a")
        assert link is not None and link["href"].endswith(
            text if text.startswith(("labs/", "benchmarks/")) else f"labs/{text}"), text

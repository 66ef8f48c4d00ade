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
NOT_CHAPTERS = ("intro", "sizing", "your_trace", "status", "bibliography")
CHAPTERS = [name for name in re.findall(r"file: book/(\w+)", TOC) if name not in NOT_CHAPTERS]
PAGES = ["intro", *CHAPTERS, "sizing", "your_trace", "status", "bibliography"]
assert "traces" in CHAPTERS and len(CHAPTERS) == 14   # the parser reads the real toc

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
    assert len(rows) == len(CHAPTERS), rows
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

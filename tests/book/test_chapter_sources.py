"""The chapters' sources, read as a reader meets the executed page, without building the book.

A visible code cell must run for a reader who ran the cells shown before it: it may use a
name that a cell on the page defines (shown, or collapsed behind "show code"), never one
that only a removed cell defines (`remove-cell`, `remove-input`: the plumbing and the
build's own checks). Gluing is the build's work: no visible cell calls glue(). And every
figure a chapter draws is numbered, captioned and described for a reader who cannot see it.
"""

import ast
import builtins
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(path.stem for path in (REPO / "book").glob("*.md"))
REMOVED = {"remove-cell", "remove-input"}          # the code is not on the page
COLLAPSED = {"hide-input", "hide-cell"}            # on the page, behind "show code"
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
# Pages whose visible cells still use names that only a removed cell defines (each listed
# with them). strict: once a page is put right, its entry here fails until it is removed.
PENDING = {}


def code_cells(text):
    """[(line, metadata, source)] of a MyST notebook's code cells, as jupytext reads them:
    options as a YAML block between --- lines, or as :key: value lines."""
    cells = []
    for match in CELL.finditer(text):
        body, metadata = match.group(1), {}
        if body.startswith("---\n"):
            end = body.index("\n---\n", 3)
            metadata = yaml.safe_load(body[4:end]) or {}
            body = body[end + 5:]
        else:
            lines = body.split("\n")
            while lines and lines[0].startswith(":"):
                key, _, value = lines.pop(0)[1:].partition(":")
                metadata[key.strip()] = yaml.safe_load(value.strip())
            body = "\n".join(lines)
        cells.append((text.count("\n", 0, match.start()) + 1, metadata, body))
    return cells


def bound_and_used(source):
    """The names a cell binds anywhere (assigned, imported, defined, a parameter) and the
    names it reads; IPython's magics and shell lines are no Python."""
    python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                       for line in source.split("\n"))
    bound, used = set(), set()
    for node in ast.walk(ast.parse(python)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used


def names_from_removed_cells(text):
    """[(line, [names])]: each visible cell's names that no cell on the page defined before
    it, but a removed one did."""
    on_page, removed, found = set(dir(builtins)), set(), []
    for line, metadata, source in code_cells(text):
        tags = set(metadata.get("tags") or [])
        bound, used = bound_and_used(source)
        if tags & REMOVED:
            removed |= bound
            continue
        if not tags & COLLAPSED:   # a visible cell: what it reads, the page must show
            hidden = sorted(name for name in used - bound - on_page if name in removed)
            if hidden:
                found.append((line, hidden))
        on_page |= bound
    return found


def test_the_parser_reads_cells_as_jupytext_does():
    text = ("# T\n\n```{code-cell} ipython3\n:tags: [remove-cell]\n\nGB = 1e9\n```\n\n"
            "```{code-cell} ipython3\n---\ntags: [hide-input]\nmystnb:\n  figure:\n"
            "    name: fig-a\n---\nx = GB\n```\n\n```{code-cell} ipython3\nprint(x, GB)\n```\n")
    cells = code_cells(text)
    assert [(m.get("tags"), s.strip()) for _, m, s in cells] == [
        (["remove-cell"], "GB = 1e9"), (["hide-input"], "x = GB"), (None, "print(x, GB)")]
    assert cells[1][1]["mystnb"] == {"figure": {"name": "fig-a"}}
    # x is on the page (collapsed), GB only in a removed cell
    assert names_from_removed_cells(text) == [(19, ["GB"])]
    # a name the visible cell binds itself, a parameter, a loop variable: its own
    assert names_from_removed_cells(text.replace("print(x, GB)", "GB = 2\nprint(x, GB)")) == []
    assert names_from_removed_cells(text.replace(
        "print(x, GB)", "def f(GB):\n    return [GB for GB in range(GB)]")) == []


@pytest.mark.parametrize("name", [
    pytest.param(page, marks=pytest.mark.xfail(
        strict=True, reason=f"visible cells use names from removed cells: {PENDING[page]}"))
    if page in PENDING else page for page in PAGES])
def test_visible_cells_use_no_name_only_a_removed_cell_defines(name):
    found = names_from_removed_cells((REPO / "book" / f"{name}.md").read_text())
    assert found == [], "\n".join(f"book/{name}.md:{line}: {', '.join(names)}"
                                  for line, names in found)


@pytest.mark.parametrize("name", PAGES)
def test_no_visible_cell_glues(name):
    for line, metadata, source in code_cells((REPO / "book" / f"{name}.md").read_text()):
        if not set(metadata.get("tags") or []) & (REMOVED | COLLAPSED):
            assert not re.search(r"\bglue\(", source), f"book/{name}.md:{line}"


@pytest.mark.parametrize("name", PAGES)
def test_every_figure_is_numbered_captioned_and_described(name):
    # a figure's caption and name belong under mystnb.figure (there it is numbered and
    # captioned), its alt text under mystnb.image; a cell that draws on the page has them
    for line, metadata, source in code_cells((REPO / "book" / f"{name}.md").read_text()):
        figure = (metadata.get("mystnb") or {}).get("figure") or {}
        image = (metadata.get("mystnb") or {}).get("image") or {}
        where = f"book/{name}.md:{line}"
        if "remove-cell" in (metadata.get("tags") or []):
            continue
        if re.search(r"\bplt\.show\(\)", source) or figure or image:
            assert figure.get("name") and figure.get("caption"), f"{where}: no name or caption"
            assert image.get("alt"), f"{where}: no alt text"
            assert "caption" not in image, f"{where}: the caption is the figure's, not the image's"


GLUED = re.compile(r"""\bglue\(\s*["']([A-Za-z0-9_]+)["']""")   # a literal name (not an f-string)
# where a page reads a glued name: a role {glue:text}`name:format`, a directive
# {glue:md} name, or another page's name as `page.md::name`
READ = re.compile(r"\{glue(?::\w+)?\}`(?:[^`]*::)?([A-Za-z0-9_]+)[^`]*`"
                  r"|\{glue(?::\w+)?\}[ \t]+(?:\S*::)?([A-Za-z0-9_]+)")


@pytest.mark.parametrize("name", PAGES)
def test_every_glued_name_is_read_by_the_page(name):
    # a value glued and never shown is a computation the reader cannot check, kept alive
    # by nothing: a leftover of text that changed
    text = (REPO / "book" / f"{name}.md").read_text()
    glued = {glued for _, _, source in code_cells(text) for glued in GLUED.findall(source)}
    read = {a or b for a, b in READ.findall(text)}
    assert not glued - read, f"book/{name}.md glues names no text reads: {sorted(glued - read)}"

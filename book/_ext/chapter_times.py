"""The status page's table: every executed chapter in reading order, with its number,
title, execution time in seconds and in units of the machine, and status, then the unit
itself and the total. (myst-nb's own nb-exec-table lists documents by file name, in
alphabetical order.) The unit, one bare 2-rank torchrun launch measured when the chapters
were executed, comes from the execution cache's folder (scripts/book_cache.py).

    ```{chapter-times}
    ```
"""

import importlib.util
import json
import os
from pathlib import Path

from docutils import nodes
from myst_nb.ext.execution_tables import METADATA_KEY
from myst_nb.sphinx_ import NbMetadataCollector
from sphinx.addnodes import pending_xref
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util.docutils import SphinxDirective


BUDGET_UNITS = 8   # per chapter (COURSE.md): one torchrun launch per world size
UNIT_STATE = Path("_build") / ".jupyter_cache" / "book_inputs.json"


def read_unit(srcdir):
    """The unit's record (unit_s, unit_samples_s, hardware, measured), or None."""
    path = Path(srcdir) / UNIT_STATE
    return json.loads(path.read_text()) if path.is_file() else None


class ChapterTimesNode(nodes.General, nodes.Element):
    """Where the table goes, once every chapter has been executed."""


class ChapterTimes(SphinxDirective):
    def run(self):
        # Marked like myst-nb's own table, so that myst-nb rewrites this page whenever a
        # chapter was executed again.
        NbMetadataCollector.set_doc_data(self.env, self.env.docname, METADATA_KEY, True)
        return [ChapterTimesNode()]


def reading_order(env):
    """Every document reachable from the root's table of contents, depth first."""
    order = []

    def visit(docname):
        if docname not in order:
            order.append(docname)
            for child in env.toctree_includes.get(docname, []):
                visit(child)

    visit(env.config.root_doc)
    return order


def make_table(header, rows, widths):
    table = nodes.table(classes=["colwidths-auto"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head, body = nodes.thead(), nodes.tbody()
    group += head
    group += body
    for target, cells in ((head, [header]), (body, rows)):
        for cells_of_row in cells:
            row = nodes.row()
            for cell in cells_of_row:
                entry = nodes.entry()
                entry += cell if isinstance(cell, nodes.Node) else nodes.paragraph(text=str(cell))
                row += entry
            target += row
    return table


class ChapterTimesTransform(SphinxPostTransform):
    default_priority = 8   # before references are resolved: the titles are links

    def run(self, **kwargs):
        data = NbMetadataCollector.get_doc_data(self.env)
        unit = read_unit(self.env.srcdir)
        unit_s = unit["unit_s"] if unit else None
        for node in list(self.document.findall(ChapterTimesNode)):
            rows, total = [], 0.0
            for docname in reading_order(self.env):
                executed = data.get(docname, {}).get("exec_data")
                if not executed:
                    continue
                number = self.env.toc_secnumbers.get(docname, {}).get("")
                title = self.env.titles[docname].astext()
                link = pending_xref(refdoc=self.env.docname, reftarget="/" + docname,
                                    reftype="doc", refdomain="std", refexplicit=True)
                link += nodes.inline(text=title)
                cell = nodes.paragraph()
                cell += link
                runtime = executed.get("runtime")
                total += runtime or 0.0
                units = None if runtime is None or unit_s is None else runtime / unit_s
                status = "ok" if executed.get("succeeded") else "failed"
                if units is not None and units > BUDGET_UNITS:
                    status += ", over budget"
                rows.append([".".join(map(str, number)) if number else "", cell,
                             "-" if runtime is None else f"{runtime:.1f}",
                             "-" if units is None else f"{units:.1f}", status])
            rows.append(["", "all chapters", f"{total:.1f}",
                         "-" if unit_s is None else f"{total / unit_s:.1f}", ""])
            table = make_table(["", "chapter", "seconds", "units", "status"], rows,
                               [5, 55, 15, 10, 15])
            if unit is None:
                text = ("The unit was not measured in this build (built without "
                        "`make book`), so the times are in seconds only.")
            else:
                samples = ", ".join(f"{t:.2f}" for t in unit["unit_samples_s"])
                after = ", ".join(f"{t:.2f}" for t in unit.get("unit_samples_after_s", []))
                text = (f"One unit here: {unit_s:.2f} s, the median of {samples} s "
                        + (f"before these chapters were executed and {after} s after, "
                           if after else "")
                        + f"for a bare 2-rank torchrun launch of labs/ranks.py, measured on "
                        f"{unit['hardware']} from {unit['measured']}, when these chapters "
                        f"were executed. The budget is {BUDGET_UNITS} units a chapter.")
            node.replace_self([table, nodes.paragraph(text=text)])


def measure_unit_after_chapters(app, env):
    """The chapters have executed (myst-nb runs them as it reads): where the unit was
    measured for them (a fresh cache), measure it again (scripts/book_cache.py). Then, if
    BOOK_CHAPTERS_EXECUTED names a file, write it: `make test` starts the labs' tests then,
    while the pages are written, with nothing left to time."""
    if (Path(app.srcdir) / UNIT_STATE).is_file():
        spec = importlib.util.spec_from_file_location(
            "book_cache", Path(app.srcdir) / "scripts" / "book_cache.py")
        book_cache = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(book_cache)
        book_cache.add_samples_after(Path(app.srcdir) / UNIT_STATE.parent)
    if os.environ.get("BOOK_CHAPTERS_EXECUTED"):
        Path(os.environ["BOOK_CHAPTERS_EXECUTED"]).write_text("")


def setup(app):
    app.connect("env-updated", measure_unit_after_chapters)
    app.add_node(ChapterTimesNode)
    app.add_directive("chapter-times", ChapterTimes)
    app.add_post_transform(ChapterTimesTransform)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

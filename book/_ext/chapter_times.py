"""The status page's table: every executed chapter in reading order, with its number,
title, execution time and status. (myst-nb's own nb-exec-table lists
documents by file name, in alphabetical order.)

    ```{chapter-times}
    ```
"""

from docutils import nodes
from myst_nb.ext.execution_tables import METADATA_KEY
from myst_nb.sphinx_ import NbMetadataCollector
from sphinx.addnodes import pending_xref
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util.docutils import SphinxDirective


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
        for node in list(self.document.findall(ChapterTimesNode)):
            rows = []
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
                rows.append([".".join(map(str, number)) if number else "", cell,
                             "-" if runtime is None else f"{runtime:.1f}",
                             "ok" if executed.get("succeeded") else "failed"])
            node.replace_self(make_table(["", "chapter", "execution time (s)", "status"],
                                         rows, [5, 60, 20, 15]))


def setup(app):
    app.add_node(ChapterTimesNode)
    app.add_directive("chapter-times", ChapterTimes)
    app.add_post_transform(ChapterTimesTransform)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

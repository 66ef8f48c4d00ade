"""The rows of a table a cell printed keep their lines. In an output that is a table (three
lines or more that are rows: three columns or more, two spaces or more between them), each
line no longer than its longest row is marked (`span.output-row`, in a block marked
`aligned-output`) and does not wrap: a row
wider than the column scrolls the output sideways in its box (book/_static/course.css),
where a wrapped row would run on under the next column. The output's other lines, and every
output that is not a table, wrap at their spaces, so that all of it is on the page.
"""

import html
import re

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

GAP = re.compile(r"\S {2,}(?=\S)")   # two columns apart
ALIGNED = "aligned-output"
# an output block as Sphinx writes it, Pygments' lines in its <pre>
BLOCK = re.compile(r'(<div class="[^"]*\baligned-output\b[^"]*">\s*<div class="highlight"><pre>)'
                   r"(.*?)(</pre>)", re.S)
TAG = re.compile(r"<[^>]+>")


def is_row(line):
    return len(GAP.findall(line)) >= 2


def is_table(text):
    return sum(1 for line in text.splitlines() if is_row(line)) >= 3


class MarkAlignedOutputs(SphinxPostTransform):
    default_priority = 400
    formats = ("html",)

    def run(self, **kwargs):
        for block in self.document.findall(nodes.literal_block):
            if "output" in block["classes"] and is_table(block.astext()):
                block["classes"].append(ALIGNED)


def _mark_rows(match):
    lines = match.group(2).split("\n")
    texts = [html.unescape(TAG.sub("", line)) for line in lines]
    # a table's rows: its lines as long as its longest row or shorter (a row whose label
    # fills its padding has one gap left); a longer line is a sentence around the table
    longest = max(len(text) for text in texts if is_row(text))
    marked = []
    for line, text in zip(lines, texts):
        # a line of Pygments' markup: its own spans whole, or it is left as it is
        whole = line.count("<span") == line.count("</span>")
        row = whole and text.strip() and len(text) <= longest
        marked.append(f'<span class="output-row">{line}</span>' if row else line)
    return match.group(1) + "\n".join(marked) + match.group(3)


def mark_rows(app, pagename, templatename, context, doctree):
    body = context.get("body")
    if body and ALIGNED in body:
        context["body"] = BLOCK.sub(_mark_rows, body)


def setup(app):
    app.add_post_transform(MarkAlignedOutputs)
    app.connect("html-page-context", mark_rows)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

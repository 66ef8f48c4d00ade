"""A cell's output that is a table of aligned columns keeps its lines: marked
`aligned-output`, it scrolls sideways in its box on a narrow screen (book/_static/course.css)
instead of wrapping, where a wrapped row would run on under the next column. Other output,
sentences a lab printed, wraps at its spaces so that all of it is on the page.

An output is a table when at least three of its lines hold two columns apart, two spaces or
more between two words.
"""

import re

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

COLUMNS_APART = re.compile(r"\S {2,}\S")
ALIGNED = "aligned-output"


def is_table(text):
    return sum(1 for line in text.splitlines() if COLUMNS_APART.search(line)) >= 3


class MarkAlignedOutputs(SphinxPostTransform):
    default_priority = 400
    formats = ("html",)

    def run(self, **kwargs):
        for block in self.document.findall(nodes.literal_block):
            if "output" in block["classes"] and is_table(block.astext()):
                block["classes"].append(ALIGNED)


def setup(app):
    app.add_post_transform(MarkAlignedOutputs)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

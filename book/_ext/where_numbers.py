"""A banner under each chapter's title: where the page's numbers come from.

Every chapter measures on the CPU of the machine that builds the book (the labs run on gloo
there); its GPU figures are the cost models' predictions or cited from published runs,
unless a GPU box has recorded references under results/ (`make gpu-references`) for the
chapter's labs, which the banner then names. Written once here, so that no chapter repeats
it and none can forget it. The chapters are the pages of the numbered parts of _toc.yml.
"""

import os
import platform
import re
import sys
from pathlib import Path

import yaml
from docutils import nodes
from sphinx.addnodes import pending_xref

TITLE = "Where the numbers come from"


def chapters(srcdir):
    """The docnames of the numbered parts of the table of contents."""
    toc = yaml.safe_load((Path(srcdir) / "_toc.yml").read_text())
    return {chapter["file"] for part in toc.get("parts", []) if part.get("numbered")
            for chapter in part.get("chapters", [])}


def cpu_name(srcdir):
    """The CPU the chapters were executed on, as `make book` recorded it with the unit of
    the status page (scripts/book_cache.py), else this machine's as /proc/cpuinfo names it."""
    from chapter_times import read_unit   # book/_ext is on the path (local_extensions)
    unit = read_unit(srcdir)
    if unit and unit.get("hardware"):
        return unit["hardware"].removeprefix("CPU: ")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{' '.join(line.split(':', 1)[1].split())} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def chapter_labs(source):
    """The labs a chapter launches or shows references of, from its source."""
    return set(re.findall(r'(?:run_lab|lab_failure|gpu_references)\(\s*"(\w+)"', source))


def gpu_boxes(srcdir, labs):
    """[(folder, gpu, world size)] of the boxes under results/ that ran one of `labs`."""
    sys.path.insert(0, str(Path(srcdir) / "labs"))
    from labkit.runtime import references   # torch-free
    return [(folder, summary.get("gpu") or "GPU", summary.get("world_size"))
            for folder, summary in references.boxes(Path(srcdir) / "results")
            if any(o.get("ok") and o.get("lab") in labs for o in summary.get("labs", []))]


def link(docname, target, text):
    ref = pending_xref("", refdomain="std", reftype="doc", reftarget=target,
                       refexplicit=True, refdoc=docname, refwarn=True)
    ref += nodes.inline(text=text)
    return ref


def banner(app, docname, source):
    para = nodes.paragraph()
    para += nodes.Text(
        f"Every measurement on this page was made when the chapter was executed for this "
        f"build, on the CPU of the machine that executed it ({cpu_name(app.srcdir)}), with "
        f"the ranks as processes talking over gloo. GPU figures are the course's predictions "
        f"or cited from published runs")
    boxes = gpu_boxes(app.srcdir, chapter_labs(source))
    if boxes:
        para += nodes.Text(", except the GPU references measured on " + "; ".join(
            f"{count} × {gpu} (results/{folder})" for folder, gpu, count in boxes)
            + " and shown in the section on a GPU box")
    para += nodes.Text(". The ")
    para += link(docname, "/book/status", "status page")
    para += nodes.Text(" lists what was measured where.")
    box = nodes.admonition(classes=["where-numbers"])
    box += nodes.title(text=TITLE)
    box += para
    return box


def add_banner(app, doctree):
    docname = app.env.docname
    if docname not in chapters(app.srcdir):
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not isinstance(section[0], nodes.title):
        return
    source = Path(app.env.doc2path(docname)).read_text(encoding="utf-8")
    section.insert(1, banner(app, docname, source))
    # the banner reads results/: a box added there (the folder's time changes) or a
    # summary rewritten reads the page again
    results = Path(app.srcdir) / "results"
    for path in (results, *results.glob("*/summary.json")):
        app.env.note_dependency(str(path))


def setup(app):
    app.connect("doctree-read", add_banner)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

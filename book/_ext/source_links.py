"""Each file of the repository a page names in inline code (`labs/hybrid.py`,
`labkit/parallel/mesh.py`, `benchmarks/pipeline_bubble.py`) links to its source in the
repository, so that a reader can open the lab a chapter runs. Only names of files that
exist are linked (a command line such as `labs/memory.py predict` is not a file name);
a name given relative to labs/, as chapters write labkit's modules, is found there.
The repository's address is the book's own (_config.yml's `repository`, which the
publishing workflow sets).
"""

import re
from pathlib import Path

from docutils import nodes

PATH = re.compile(r"^(?:labs/|labkit/|benchmarks/|scripts/|tests/)[\w./-]+\.(?:py|sh|json)$")


def source_path(srcdir, text):
    """The file's path in the repository, or None when no such file exists."""
    for candidate in (text, f"labs/{text}"):
        if (Path(srcdir) / candidate).is_file():
            return candidate
    return None


def link_sources(app, doctree):
    options = app.config.html_theme_options or {}
    url, branch = options.get("repository_url"), options.get("repository_branch") or "main"
    if not url:
        return
    for literal in list(doctree.findall(nodes.literal)):
        if isinstance(literal.parent, nodes.reference):
            continue
        path = source_path(app.srcdir, literal.astext().strip())
        if path is None or not PATH.match(literal.astext().strip()):
            continue
        link = nodes.reference("", "", refuri=f"{url.rstrip('/')}/blob/{branch}/{path}",
                               classes=["source-link"])
        literal.replace_self(link)
        link += literal


def setup(app):
    app.connect("doctree-read", link_sources)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""A site that makes no request outside itself, for a GPU cluster without internet access:
MathJax and Pyodide served by the site rather than by jsDelivr's CDN.

`make book OFFLINE=1` takes both from npm's registry at the releases _config.yml pins
(`make mathjax`, `make pyodide`), the way the browser tests take Pyodide, and names the
two folders to this build in the environment:

  BOOK_MATHJAX_DIR   npm's mathjax package's es5/ folder: copied to _static/mathjax/, and
                     Sphinx's mathjax_path points there instead of the CDN
  BOOK_PYODIDE_DIR   npm's pyodide package: sizing_pyodide_dir (sizing_page.py copies it
                     to _static/pyodide/, where the sizing and trace pages load it)

Without them the pages load MathJax and Pyodide from the CDN, as a site on the web does.

_config.yml, under sphinx: config:
  offline_mathjax_version   the MathJax release `make mathjax` takes (3.x: what Sphinx loads
                            from the CDN by default is MathJax 3's tex-mml-chtml.js)
"""

import os
import shutil
from pathlib import Path

MATHJAX_VERSION = "3.2.2"
# The component Sphinx loads by default: TeX and MathML input, CommonHTML output. It finds
# its fonts and any extension it loads later beside itself, so the whole es5/ folder goes.
MATHJAX_SCRIPT = "tex-mml-chtml.js"
SITE_FOLDER = "mathjax"   # under _static/


def local_folder(app, variable, marker):
    """The folder an environment variable names, which must hold `marker`; None if unset."""
    value = os.environ.get(variable)
    if not value:
        return None
    folder = Path(app.srcdir) / value   # an absolute path stays as it is
    if not (folder / marker).is_file():
        raise FileNotFoundError(f"{variable}: no {marker} in {folder}")
    return folder


def use_local_copies(app, config):
    mathjax = local_folder(app, "BOOK_MATHJAX_DIR", MATHJAX_SCRIPT)
    if mathjax is not None:
        config.offline_mathjax_dir = str(mathjax)
        config.mathjax_path = f"{SITE_FOLDER}/{MATHJAX_SCRIPT}"   # relative to _static/
    pyodide = local_folder(app, "BOOK_PYODIDE_DIR", "pyodide.js")
    if pyodide is not None:
        config.sizing_pyodide_dir = str(pyodide)


def copy_mathjax(app, exception):
    if exception is not None or app.builder.format != "html" or not app.config.offline_mathjax_dir:
        return
    shutil.copytree(app.config.offline_mathjax_dir,
                    Path(app.outdir) / "_static" / SITE_FOLDER, dirs_exist_ok=True)


def setup(app):
    app.add_config_value("offline_mathjax_version", MATHJAX_VERSION, "html")
    app.add_config_value("offline_mathjax_dir", "", "html")
    # config-inited: before Sphinx's mathjax extension reads mathjax_path (at each page)
    app.connect("config-inited", use_local_copies)
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

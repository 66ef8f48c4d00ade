"""The sizing page's Python, put into the built site: the predictions subpackage,
labs/labkit/predict/ (the cost models, the planner, the page's entry point `sizing`), is
copied whole at build time, its subfolders (the planner's package) with it, with labkit's
own __init__.py (the site runs the very files the build checks, with no second copy in the
repository and no list of modules to keep in step: whatever that folder holds, which
imports no torch, the page can import), with a small configuration script that says where
Pyodide comes from and which folders to make.

_config.yml, under sphinx: config:
  sizing_pyodide_version  the pinned Pyodide release (default below)
  sizing_pyodide_url      where the page loads it from (default: jsDelivr's CDN, that version)
  sizing_pyodide_dir      a local Pyodide folder (npm's `pyodide` package at that version) to
                          copy into the site as _static/pyodide/ and load from there instead
"""

import json
import shutil
from pathlib import Path

PYODIDE_VERSION = "0.27.7"
# labkit's subpackage of predictions: torch-free by its own rule, checked in the tests
PREDICTIONS = "predict"


def site_modules(labkit):
    """The files the page loads, as paths under labkit/ without ".py": labkit's __init__ and
    every module of its predictions subpackage, those of its subpackages included."""
    folder = labkit / PREDICTIONS
    return ["__init__"] + sorted(path.relative_to(labkit).with_suffix("").as_posix()
                                 for path in folder.rglob("*.py")
                                 if "__pycache__" not in path.parts)


def site_folders(modules):
    """The folders under labkit/ that `modules` sit in, parents first: the page makes them
    before it writes the files."""
    return sorted({name.rsplit("/", 1)[0] for name in modules if "/" in name},
                  key=lambda folder: (folder.count("/"), folder))


def copy_into_site(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    labkit = Path(app.srcdir) / "labs" / "labkit"
    target = static / "labkit"
    modules = site_modules(labkit)
    folders = site_folders(modules)
    for folder in folders:
        (target / folder).mkdir(parents=True, exist_ok=True)
    for name in modules:
        shutil.copyfile(labkit / f"{name}.py", target / f"{name}.py")
    url = app.config.sizing_pyodide_url or (
        f"https://cdn.jsdelivr.net/pyodide/v{app.config.sizing_pyodide_version}/full/")
    if app.config.sizing_pyodide_dir:
        local = Path(app.srcdir) / app.config.sizing_pyodide_dir
        if not (local / "pyodide.js").is_file():
            raise FileNotFoundError(f"sizing_pyodide_dir: no pyodide.js in {local}")
        shutil.copytree(local, static / "pyodide", dirs_exist_ok=True)
        url = "../_static/pyodide/"   # relative to the pages in book/
    config = {"pyodide": url, "version": app.config.sizing_pyodide_version,
              "modules": modules, "folders": folders}
    (static / "sizing-config.js").write_text(
        f"window.SIZING_CONFIG = {json.dumps(config)};\n")


def setup(app):
    app.add_config_value("sizing_pyodide_version", PYODIDE_VERSION, "html")
    app.add_config_value("sizing_pyodide_url", "", "html")
    app.add_config_value("sizing_pyodide_dir", "", "html")
    app.connect("build-finished", copy_into_site)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""The sizing page's Python under Pyodide itself, without a browser or a built site: the
files book/_ext/sizing_page.py copies into the site (copy_into_site, run as the build runs
it), set out as book/_static/sizing.js sets them out (each folder of the page's
configuration made, each module written), imported by the local Pyodide (npm's package
at the release _config.yml pins, `make pyodide`) under Node, and asked the planner's
question; the answer must be the one CPython gives here. It checks what a package of the
predictions (the planner's) needs from the page: its subfolder made and its modules
listed. Without Node or the local Pyodide it skips, saying which.
"""

import importlib.util
import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = re.search(r'sizing_pyodide_version: "([^"]+)"',
                    (REPO / "_config.yml").read_text()).group(1)
PYODIDE = REPO / ".venv" / f"pyodide-{VERSION}"
NODE = shutil.which("node")
FIELDS = {"model": "llama3-70b", "gpus": "256", "global_batch_tokens": "4M",
          "layout": "tp=8,pp=1,dp=32"}

missing = [what for what, present in (
    ("Node (apt install nodejs)", NODE),
    (f"a local Pyodide {VERSION} (make pyodide, which needs npm)",
     (PYODIDE / "pyodide.mjs").is_file())) if not present]
if missing:
    pytest.skip("the sizing page's Pyodide test needs " + ", ".join(missing),
                allow_module_level=True)

# What sizing.js does once Pyodide has loaded, in Node: the same folders, files and call
SCRIPT = """
import { loadPyodide } from %(pyodide)s;
import fs from "fs";
const [site, fields] = process.argv.slice(2);
const text = fs.readFileSync(`${site}/_static/sizing-config.js`, "utf8");
const config = JSON.parse(text.slice(text.indexOf("=") + 1).trim().replace(/;$/, ""));
const pyodide = await loadPyodide();
for (const folder of ["", ...config.folders]) {
  pyodide.FS.mkdirTree(`/home/pyodide/labkit/${folder}`);
}
for (const name of config.modules) {
  pyodide.FS.writeFile(`/home/pyodide/labkit/${name}.py`,
                       fs.readFileSync(`${site}/_static/labkit/${name}.py`, "utf8"));
}
pyodide.globals.set("fields", fields);
console.log(pyodide.runPython(`
import json, sys
sys.path.insert(0, "/home/pyodide")
from labkit.predict import sizing
json.dumps(sizing.run(json.loads(fields)))
`));
"""


def copied_site(outdir):
    spec = importlib.util.spec_from_file_location("sizing_page_ext",
                                                  REPO / "book" / "_ext" / "sizing_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = SimpleNamespace(sizing_pyodide_url="", sizing_pyodide_version=VERSION,
                             sizing_pyodide_dir="")
    module.copy_into_site(SimpleNamespace(builder=SimpleNamespace(format="html"),
                                          outdir=str(outdir), srcdir=str(REPO),
                                          config=config), None)
    return module


def test_pyodide_imports_the_copied_predictions_and_answers_as_cpython(tmp_path):
    from labkit.predict import sizing
    copied_site(tmp_path / "site")
    script = tmp_path / "page.mjs"
    script.write_text(SCRIPT % {"pyodide": json.dumps((PYODIDE / "pyodide.mjs").as_uri())})
    done = subprocess.run([NODE, str(script), str(tmp_path / "site"), json.dumps(FIELDS)],
                          capture_output=True, text=True, timeout=300, check=True)
    there = json.loads(done.stdout.strip().splitlines()[-1])
    here = json.loads(json.dumps(sizing.run(FIELDS)))
    # the same answer, up to the last bit of a float (WebAssembly's libm is not the host's)
    assert same(there["planner"], here["planner"]) and same(there["layout"], here["layout"])
    assert there["layout"]["rank"] is not None


def same(a, b):
    """a == b, floats to 12 significant digits."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
    return a == b

"""The book build's spare kernel (book/_ext/spare_kernel.py), through jupyter_client as pinned:
the second chapter's kernel is the spare, torch already imported, and runs cells, errors and
inline figures as a kernel jupyter started does, with jupyter's own parent and folder; a
launch in another environment starts as jupyter starts it and the refused spare ends; the
one left after the last chapter ends when the build drops it."""

import importlib.util
import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.provisioning import local_provisioner
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

EXT = Path(__file__).resolve().parents[1] / "book" / "_ext" / "spare_kernel.py"

PROBE = """import os, sys
print("torch" in sys.modules, os.getpid(), os.environ["JPY_PARENT_PID"], os.getcwd(),
      os.environ.get("SPARE_PROBE", "-"), sys.argv[0].endswith("ipykernel_launcher.py"))"""
FIGURE = """import matplotlib.pyplot as plt
plt.plot([0, 1], [1, 0]); plt.show()"""


@pytest.fixture
def spare_kernel(monkeypatch):
    spec = importlib.util.spec_from_file_location("spare_kernel", EXT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(local_provisioner, "launch_kernel", module.launch_kernel)
    yield module
    module._drop()


def execute(folder, *sources):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    NotebookClient(notebook, kernel_name="python3", timeout=120,
                   resources={"metadata": {"path": str(folder)}}).execute()
    return notebook.cells


def probe(cells):
    words = cells[0].outputs[0]["text"].split()
    return {"torch": words[0] == "True", "pid": int(words[1]), "parent": int(words[2]),
            "cwd": words[3], "variable": words[4], "launcher": words[5] == "True"}


def test_the_next_kernel_is_the_spare_and_runs_as_jupyters_own(spare_kernel, tmp_path):
    first = probe(execute(tmp_path, PROBE))
    spare = spare_kernel._spare
    assert spare is not None and spare.alive()
    cells = execute(tmp_path, PROBE, FIGURE)
    second = probe(cells)
    assert not first["torch"] and second["torch"]   # jupyter's kernel, then the spare
    assert second["pid"] == spare.process.pid
    for kernel in (first, second):
        assert kernel["parent"] == os.getpid() and kernel["cwd"] == str(tmp_path)
        assert kernel["launcher"]
    assert [output["output_type"] for output in cells[1].outputs] == ["display_data"]
    assert "image/png" in cells[1].outputs[0]["data"]   # the inline backend, as jupyter's
    with pytest.raises(CellExecutionError, match="ZeroDivisionError"):
        execute(tmp_path, "1 / 0")   # a failing cell fails in a spare too


def test_another_environment_starts_as_jupyter_starts_it_and_the_last_spare_ends(
        spare_kernel, tmp_path, monkeypatch):
    execute(tmp_path, PROBE)
    refused = spare_kernel._spare
    monkeypatch.setenv("SPARE_PROBE", "set")
    kernel = probe(execute(tmp_path, PROBE))
    assert not kernel["torch"] and kernel["variable"] == "set"
    assert refused.process.poll() is not None   # ended, not left importing
    last = spare_kernel._spare
    spare_kernel._drop()   # as the build does before it measures the unit again
    assert last.process.returncode is not None and spare_kernel._spare is None

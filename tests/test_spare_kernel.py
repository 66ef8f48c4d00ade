"""The book build's spare kernel (book/_ext/spare_kernel.py), through jupyter_client as pinned:
the second chapter's kernel is the spare, its imports done, and runs cells, inline figures
(the same bytes) and errors as a kernel jupyter started does, with jupyter's own parent and folder; a launch
in another environment starts as jupyter starts it and the refused spare ends; the one left
after the last chapter ends when the build drops it. One test, three kernels: each costs
the machine a second or two (the spares here import a small module where the build's
import torch, and the marker of a spare is that module).
"""

import importlib.util
import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.provisioning import local_provisioner
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

EXT = Path(__file__).resolve().parents[1] / "book" / "_ext" / "spare_kernel.py"

MARKER = "xml.dom.minidom"   # imported by the spares here, by nothing a kernel starts with
PROBE = f"""import os, sys
print("{MARKER}" in sys.modules, os.getpid(), os.environ["JPY_PARENT_PID"], os.getcwd(),
      os.environ.get("SPARE_PROBE", "-"), sys.argv[0].endswith("ipykernel_launcher.py"))"""
FIGURE = """import matplotlib.pyplot as plt
plt.plot([0, 1], [1, 0]); plt.show()"""


# What each spare calls first here, in place of the build's rank server (which imports torch
# and more: about 4 s of CPU a spare): a mark in a file named by the test, one line a call
CALLED = """import os
def mark(path):
    with open(path, "a") as file:
        file.write(f"{os.getpid()}\\n")
"""


@pytest.fixture
def spare_kernel(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("spare_kernel", EXT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # the build's imports but torch (1.6 s of CPU a spare), and the marker
    imports = tuple(name for name in module.SpareKernel.IMPORTS if name != "torch")
    monkeypatch.setattr(module.SpareKernel, "IMPORTS", (*imports, MARKER))
    assert module.START_RANK_SERVER[1:] == ("labkit.runtime.launch", "start_rank_server")
    calls = tmp_path / "calls"
    calls.mkdir()
    (calls / "called.py").write_text(CALLED)
    monkeypatch.setattr(module, "START_RANK_SERVER",
                        (calls, "called", "mark", calls / "marks"))
    monkeypatch.setattr(local_provisioner, "launch_kernel", module.launch_kernel)
    yield module
    module._drop()


def execute(folder, *sources):
    """The cells, executed in a new kernel (the cells so far when one fails), and the error."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    try:
        NotebookClient(notebook, kernel_name="python3", timeout=120,
                       resources={"metadata": {"path": str(folder)}}).execute()
    except CellExecutionError as error:
        return notebook.cells, error
    return notebook.cells, None


def probe(cells):
    words = cells[0].outputs[0]["text"].split()
    return {"spare": words[0] == "True", "pid": int(words[1]), "parent": int(words[2]),
            "cwd": words[3], "variable": words[4], "launcher": words[5] == "True"}


def test_the_next_kernel_is_the_spare_and_runs_as_jupyters_own(spare_kernel, tmp_path,
                                                                 monkeypatch):
    cells, error = execute(tmp_path, PROBE, FIGURE)
    first, spare, drawn = probe(cells), spare_kernel._spare, cells[1].outputs
    assert error is None and spare is not None and spare.alive()

    cells, error = execute(tmp_path, PROBE, FIGURE, "1 / 0", "print('after')")
    second = probe(cells)
    assert not first["spare"] and second["spare"]   # jupyter's kernel, then the spare
    assert second["pid"] == spare.process.pid
    # the spare made its call (the build's: start the chapter's rank server) as it started
    marks = (tmp_path / "calls" / "marks").read_text().split()
    assert str(second["pid"]) in marks
    for kernel in (first, second):
        assert kernel["parent"] == os.getpid() and kernel["cwd"] == str(tmp_path)
        assert kernel["launcher"] and kernel["variable"] == "-"
    # the inline backend, pyplot imported before the kernel started: the same figure,
    # byte for byte, as jupyter's kernel drew
    assert [output["output_type"] for output in cells[1].outputs] == ["display_data"]
    assert cells[1].outputs[0]["data"] == drawn[0]["data"]
    assert "image/png" in drawn[0]["data"]
    assert "ZeroDivisionError" in str(error) and cells[3].outputs == []   # failed, and stopped

    refused = spare_kernel._spare
    monkeypatch.setenv("SPARE_PROBE", "set")
    cells, error = execute(tmp_path, PROBE)
    third = probe(cells)
    assert error is None and not third["spare"] and third["variable"] == "set"
    assert refused.process.poll() is not None   # ended, not left importing
    last = spare_kernel._spare
    spare_kernel._drop()   # as the build does before it measures the unit again
    assert last.process.returncode is not None and spare_kernel._spare is None

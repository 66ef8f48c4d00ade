"""Each chapter's kernel started while the chapter before it executes: a new Python that has
imported ipykernel, torch and matplotlib, then becomes the kernel the next chapter asks for.

The build executes the chapters one after the other, each in a new kernel. Starting one
costs its chapter about 0.8 s of one core before the first cell (Python, ipykernel, the
handshake), and a chapter whose cells use torch spends 1.8 s more importing it, while its
launches leave the other core idle about a quarter of the time. When a kernel is launched,
this starts the next one's Python (labkit.runtime.spare_python, as a chapter's spare for
its next torchrun): it starts the server its chapter's ranks will be forked from
(labkit.runtime.rank_server, which imports torch on its own), imports ipykernel, torch and
pyplot on that idle core, and waits. The next
launch, with the same command line's interpreter, folder and the very same environment,
hands it its arguments; it runs `ipykernel_launcher` as `python -m` would, a fresh kernel
that no cell has touched, its modules imported earlier. Anything else starts as jupyter
starts kernels. The spare left after the last chapter is ended before the unit is measured
again (book/_ext/chapter_times.py), and at exit.

What the spare's imports print goes to the build's log, not to the first cell that would
have imported them (an import that warns would warn there in a kernel jupyter started), and
a variable a cell sets before its first import of torch or matplotlib comes too late: no
chapter does either.

jupyter_client offers no hook between a kernel's command and its process but the
provisioner, registered through a package's entry point; this replaces the one function
its local provisioner calls, `launch_kernel`, and is tested against jupyter_client as
pinned (tests/test_spare_kernel.py).
"""

import atexit
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from jupyter_client.provisioning import local_provisioner

# read from its file, the build's sys.path left alone (labs/ holds a trace.py, which would
# stand in for the standard library's)
LABS_DIR = Path(__file__).resolve().parents[2] / "labs"
_spec = importlib.util.spec_from_file_location(
    "spare_python", LABS_DIR / "labkit/runtime/spare_python.py")
spare_python = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spare_python)

_jupyters_launch = local_provisioner.launch_kernel
# what the kernel calls first: the server its chapter's launches fork their ranks from
# (labkit.runtime.rank_server), which then imports torch beside it
START_RANK_SERVER = (LABS_DIR, "labkit.runtime.launch", "start_rank_server")
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


class SpareKernel(spare_python.SparePython):
    """A Python that imported ipykernel, torch and pyplot, for the next kernel jupyter starts."""

    # pyplot: every chapter's helper imports it (labkit.runtime.notebook)
    IMPORTS = ("ipykernel.kernelapp", "torch", "matplotlib.pyplot")
    MODULES = ("ipykernel_launcher",)
    RUNS_FILES = False

    def _popen(self, command, env, cwd):
        # as jupyter_client starts a kernel: stdout and stderr the build's own, a session of
        # its own (an interrupt goes to its process group). matplotlib reads MPLBACKEND as
        # it is imported, and a kernel sets it to the inline backend, where the environment
        # names none, before any cell runs (ipykernel's kernelapp): the spare imports it so
        # set; the kernel, handed the launch's own environment, sets it again
        if not env.get("MPLBACKEND"):
            env = {**env, "MPLBACKEND": INLINE_BACKEND}
        return subprocess.Popen(command, stdin=subprocess.PIPE, env=env, cwd=cwd,
                                start_new_session=True, text=True)

    def _starts_alike(self, env):
        # a kernel imports more than torch reads at import (IPython, jupyter's paths): only
        # the environment it was started with is the same start
        return env == self._env


_spare = None


def launch_kernel(cmd, stdin=None, stdout=None, stderr=None, env=None, independent=False,
                  cwd=None, **kw):
    """jupyter_client.launcher.launch_kernel, taking the spare when it can run `cmd` as
    asked, then starting the next launch's."""
    global _spare
    as_every_chapter = (env is not None and not independent and not kw
                        and stdin is None and stdout is None and stderr is None)
    if not as_every_chapter:
        return _jupyters_launch(cmd, stdin=stdin, stdout=stdout, stderr=stderr, env=env,
                                independent=independent, cwd=cwd, **kw)
    env = {**env, "JPY_PARENT_PID": str(os.getpid())}   # what jupyter's launch adds
    cwd = os.path.abspath(cwd or os.getcwd())
    process = _spare.run(cmd, env, cwd) if _spare is not None else None
    if process is not None:
        _spare = None
    _drop()   # one it could not take
    if cmd[:3] == [sys.executable, "-m", "ipykernel_launcher"]:   # a kind a spare can take
        try:
            _spare = SpareKernel(env, cwd, call=START_RANK_SERVER)
        except OSError as error:   # the kernel asked for still starts
            print(f"spare_kernel: no spare for the next chapter ({error})", file=sys.stderr)
    return process or _jupyters_launch(cmd, env=env, cwd=cwd)


@atexit.register
def _drop(*_):
    """End the spare nobody asked for (its imports would go on beside what runs next)."""
    global _spare
    if _spare is not None:
        _spare.end()
        _spare = None


def setup(app):
    local_provisioner.launch_kernel = launch_kernel
    # before chapter_times measures the unit again (priority 500)
    app.connect("env-updated", _drop, priority=100)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

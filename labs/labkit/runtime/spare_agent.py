"""A torchrun agent started before its launch: the chapters' launches begin with torch imported.

`python -m torch.distributed.run ...` spends its first 1.3 s of one core importing torch
before it starts a single rank; a bare 2-rank launch takes about 3 s here, so that is a
third of it. Between two launches a chapter's kernel computes predictions and draws plots
on one core, and the other core waits. A spare agent is a new Python, started with the
kernel's own interpreter when a launch ends, that imports torch on that waiting core and then
reads one line from its stdin. The next launch writes there the arguments and environment it
would have given `python -m torch.distributed.run`, and the spare runs torch.distributed.run
as `__main__` with them, as `-m` does. What the agent then does is torchrun's own code; the
ranks it starts are fresh Pythons, as always. Only the agent's import of torch has happened
earlier, in the time the kernel was busy anyway.

A spare is used only for a torchrun command with this interpreter, and only when the
variables read when Python and torch start (IMPORT_TIME) are the ones it started with; else
the launch starts a new process, as without spares. A spare that nobody asks for reads the
end of its stdin when the kernel exits, and exits too.

`labkit.runtime.launch.keep_a_spare_agent()` turns spares on (the chapters' helper,
labkit.runtime.notebook, does); the unit of the build's budget, a bare launch, is measured
without one (scripts/book_cache.py).
"""

import json
import subprocess
import sys

# Read by Python, torch, OpenMP or MKL as they start (LOGLEVEL: torchelastic's loggers, as
# its modules are imported): a spare started with other values would not be the process
# the launch asks for.
IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA", "LD_", "LOGLEVEL")
AGENT = ["-m", "torch.distributed.run"]

# What the spare runs: torch imported (torch.distributed.launcher.api is what torchrun's
# main uses, and imports torch), then the request, then torchrun as `python -m` runs it
# (sys.path[0] the working directory; runpy sets sys.argv[0] to the module's file).
_SPARE_CODE = """
import json, os, runpy, sys
import torch.distributed.launcher.api
request = sys.stdin.readline()
if not request:
    sys.exit(0)
request = json.loads(request)
os.environ.clear()
os.environ.update(request["env"])
sys.argv = ["torch.distributed.run", *request["args"]]
sys.path[0] = os.getcwd()
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""


def import_time_variables(env):
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME)}


class SpareAgent:
    """One Python that has imported torch and waits to run torch.distributed.run."""

    def __init__(self, env, cwd):
        self._import_env = import_time_variables(env)
        self._cwd = str(cwd)
        # as launch._popen starts a lab: stdout and stderr in one pipe, a session of its own
        # (a timeout kills the agent and every rank it started)
        self.process = subprocess.Popen([sys.executable, "-c", _SPARE_CODE],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env,
                                        cwd=cwd, start_new_session=True)

    def alive(self):
        return self.process.poll() is None

    def run(self, command, env, cwd):
        """Hand `command` ([python, "-m", "torch.distributed.run", ...]) to the spare and
        return its process (Popen), or None when the spare cannot run it as asked."""
        if (command[0] != sys.executable or command[1:3] != AGENT or str(cwd) != self._cwd
                or import_time_variables(env) != self._import_env or not self.alive()):
            return None
        try:
            self.process.stdin.write(json.dumps({"args": command[3:], "env": env}) + "\n")
            self.process.stdin.close()
        except OSError:   # it ended between the check and the write
            return None
        return self.process

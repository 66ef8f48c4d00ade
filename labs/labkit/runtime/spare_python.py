"""A Python started before its launch, torch imported: a chapter's next launch begins there.

`python -m torch.distributed.run ...` spends its first 1.3 s of one core importing torch
before it starts a single rank (a bare 2-rank launch takes about 3 s here), and a lab run
as one process, `python labs/<lab>.py`, spends as long before its first line. Between two
launches a chapter's kernel computes predictions and draws plots on one core, and the
other core waits. A spare is a new Python, started with the kernel's own interpreter when a
launch ends, that imports torch on that waiting core and then reads one line from its
stdin: the command and environment of the next launch. It then runs what that command
names, as Python would have:

- `python -m torch.distributed.run ARGS`: torch.distributed.run as `__main__` (runpy, as
  `-m` does). What the agent does is torchrun's own code, and the ranks it starts are
  fresh Pythons, as always;
- `python labs/<lab>.py ARGS`: the script as `__main__` (runpy, as `python FILE` does),
  its folder first on sys.path.

Only the import of torch (and of torchrun's launcher, which a one-process lab does not
need and does not use) has happened earlier, in the time the kernel was busy anyway.

A spare runs a command only with this interpreter, from the folder it was started in, and
when the variables read as Python and torch start (IMPORT_TIME) are the ones it started
with; else the launch starts a new process, as without spares. A spare nobody asks for is
ended with its kernel (labkit.runtime.launch), or reads the end of its stdin and exits.

`labkit.runtime.launch.keep_a_spare_python()` turns spares on (the chapters' helper,
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
TORCHRUN = ["-m", "torch.distributed.run"]

# What the spare runs: torch imported (torch.distributed.launcher.api is what torchrun's
# main uses, and imports torch), then the request, then the command as Python runs it:
# sys.path[0] the working directory for -m, the script's folder for a file, and sys.argv[0]
# the module's file or the script (runpy sets the first)
_SPARE_CODE = """
import json, os, runpy, sys
import torch.distributed.launcher.api
request = sys.stdin.readline()
if not request:
    sys.exit(0)
request = json.loads(request)
os.environ.clear()
os.environ.update(request["env"])
if request["script"] is None:
    sys.argv = ["torch.distributed.run", *request["args"]]
    sys.path[0] = os.getcwd()
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
else:
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    runpy.run_path(request["script"], run_name="__main__")
"""


def import_time_variables(env):
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME)}


class SparePython:
    """One Python that has imported torch and waits for the command it is to run."""

    def __init__(self, env, cwd):
        self._import_env = import_time_variables(env)
        self._cwd = str(cwd)
        # as launch._popen starts a lab: stdout and stderr in one pipe, a session of its own
        # (a timeout kills it and every process it started)
        self.process = subprocess.Popen([sys.executable, "-c", _SPARE_CODE],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env,
                                        cwd=cwd, start_new_session=True)

    def alive(self):
        return self.process.poll() is None

    def run(self, command, env, cwd):
        """Hand `command` ([python, "-m", "torch.distributed.run", ...] or [python, FILE,
        ...]) to the spare and return its process (Popen), or None when the spare cannot
        run it as asked."""
        if command[1:3] == TORCHRUN:
            script, args = None, command[3:]
        elif len(command) > 1 and not command[1].startswith("-"):
            script, args = command[1], command[2:]
        else:
            return None
        if (command[0] != sys.executable or str(cwd) != self._cwd
                or import_time_variables(env) != self._import_env or not self.alive()):
            return None
        request = {"script": script, "args": args, "env": env}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.close()
        except OSError:   # it ended between the check and the write
            return None
        return self.process

"""A Python started before its launch, torch imported: a chapter's next launch begins there.

`python -m torch.distributed.run ...` spends its first 1.3 s of one core importing torch
before it starts a single rank (a bare 2-rank launch takes 3 to 5 s on the 2-core machines
this book is built on), and a lab run
as one process, `python labs/<lab>.py`, spends as long before its first line. Between two
launches a chapter's kernel computes predictions and draws plots on one core, and the
other core waits. A spare is a new Python, started with the kernel's own interpreter when a
launch ends, that imports torch on that waiting core and then reads one line from its
stdin: the command and environment of the next launch. It then runs what that command
names, as Python would have:

- `python -m torch.distributed.run ARGS`: torch.distributed.run as `__main__` (runpy, as
  `-m` does). What the agent does is torchrun's own code; the ranks it starts are fresh
  Pythons, but where the spare was given a call to labkit.runtime.rank_server's
  `fork_ranks_in_torchrun` (labkit.runtime.launch gives it one where the server runs), the
  ranks of the group's first start are forked from that server;
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
without one (scripts/book_cache.py). The book build keeps each chapter's next kernel the same
way (book/_ext/spare_kernel.py, a subclass that imports ipykernel and runs its launcher).
"""

import json
import os
import signal
import subprocess
import sys

# Read by Python, torch, OpenMP or MKL as they start (LOGLEVEL: torchelastic's loggers, as
# its modules are imported): a spare started with other values would not be the process
# the launch asks for.
IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA", "LD_", "LOGLEVEL")

# What the spare runs: its call (argv[1], JSON: a folder, a module found there, a function and
# its arguments, or null), then its imports (the rest of argv), without the working directory
# on its path (-c's ''), where a module of the folder could stand in for one of theirs; then
# the request; then the command as Python runs it: sys.path[0] the working directory for -m,
# the script's folder for a file, and sys.argv[0] the module's file or the script (runpy sets
# the first)
_SPARE_CODE = """
import importlib, json, os, runpy, sys
sys.path.pop(0)
call = json.loads(sys.argv[1])
if call:
    folder, module, function, *arguments = call
    sys.path.insert(0, folder)
    getattr(importlib.import_module(module), function)(*arguments)
    sys.path.remove(folder)
for name in sys.argv[2:]:
    importlib.import_module(name)
request = sys.stdin.readline()
if not request:
    sys.exit(0)
request = json.loads(request)
os.environ.clear()
os.environ.update(request["env"])
if request["module"] is not None:
    sys.argv = [request["module"], *request["args"]]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
else:
    sys.argv = [request["script"], *request["args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(request["script"])))
    runpy.run_path(request["script"], run_name="__main__")
"""


def import_time_variables(env):
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME)}


class SparePython:
    """One Python that has imported torch and waits for the command it is to run."""

    # what it imports while it waits (torch.distributed.launcher.api is what torchrun's main
    # uses, and imports torch), and what it can run: `python -m` one of MODULES, or, when
    # RUNS_FILES, `python FILE`
    IMPORTS = ("torch.distributed.launcher.api",)
    MODULES = ("torch.distributed.run",)
    RUNS_FILES = True

    def __init__(self, env, cwd, call=None):
        """A spare for a launch with `env` from `cwd`. call=(folder, module, function,
        *arguments): a function it calls before its imports (labkit.runtime.rank_server's
        fork_ranks_in_torchrun), its module found in that folder."""
        self._env = dict(env)
        self._cwd = str(cwd)
        call = json.dumps([str(word) for word in call] if call else None)
        self.process = self._popen([sys.executable, "-c", _SPARE_CODE, call, *self.IMPORTS],
                                   env, cwd)

    def _popen(self, command, env, cwd):
        # as launch._popen starts a lab: stdout and stderr in one pipe, a session of its own
        # (a timeout kills it and every process it started)
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                                start_new_session=True)

    def _starts_alike(self, env):
        """Whether a Python started with `env` would have imported what this one did."""
        return import_time_variables(env) == import_time_variables(self._env)

    def alive(self):
        return self.process.poll() is None

    def end(self):
        """Kill it, unless it ended (a process reaped already may have left its number to
        another), and reap it. One nobody asked for has started nothing of its own."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def run(self, command, env, cwd):
        """Hand `command` ([python, "-m", MODULE, ...] or [python, FILE, ...]) to the spare
        and return its process (Popen), or None when the spare cannot run it as asked."""
        if command[1:2] == ["-m"] and command[2:3] and command[2] in self.MODULES:
            module, script, args = command[2], None, command[3:]
        elif self.RUNS_FILES and len(command) > 1 and not command[1].startswith("-"):
            module, script, args = None, command[1], command[2:]
        else:
            return None
        if (command[0] != sys.executable or str(cwd) != self._cwd
                or not self._starts_alike(env) or not self.alive()):
            return None
        request = {"module": module, "script": script, "args": args, "env": env}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.close()
        except OSError:   # it ended between the check and the write
            return None
        return self.process

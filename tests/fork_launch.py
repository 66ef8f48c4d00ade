"""The test suite's way of starting labs: forked from a process that imported torch once.

A test run starts about 130 lab processes. Started afresh, each spends about 1.4 s of CPU
importing torch and about 1.1 s importing torch._dynamo (Optimizer.step, zero_grad and
DDP's __init__ import it), and each torchrun launcher another 1.3 s importing torch: most
of the run's CPU on two cores. Here one server process per test worker imports them once
(multiprocessing's forkserver, PRELOAD), and each launch forks from it:

- `python labs/<lab>.py args` runs the script in the forked process, as Python would;
- `python -m torch.distributed.run --standalone --nproc_per_node=N labs/<lab>.py args`
  runs as torchrun runs it: an agent process hosts the TCPStore (the ranks find it through
  TORCHELASTIC_USE_AGENT_STORE, as under torchrun), forks N ranks with the environment
  torchrun gives them, and, when one fails, ends the others and exits 1.

Anything else (several agents, restarts, other torchrun options), or an environment that
sets a variable torch reads at import (IMPORT_TIME) otherwise than the server had it,
starts a real process: `start` returns None. The chapters always launch real torchrun, and
`LABS_FORK_LAUNCH=0 make pytest` runs these tests that way too.
"""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from labkit.runtime.rank_server import SET_BY_IMPORTS, run_file

# Imported once by the server; the 0.7 s of DTensor (sympy) is paid by the FSDP, tensor-
# and context-parallel labs and the checkpoints.
PRELOAD = ["fork_launch", "torch", "torch.distributed", "torch._dynamo",
           "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint"]
# Read by torch, OpenMP or MKL when they load: a launch that sets one otherwise than the
# server was started with must start a fresh Python.
IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA", "LD_")
# ... except what torch's imports set (in the test process when a test imports them)
NOT_IMPORT_TIME = SET_BY_IMPORTS
TERMINATE_GRACE_S = 5   # after a rank fails, the others get SIGTERM, then SIGKILL


class ForkLauncher:
    """Starts commands (lists, as for subprocess) by forking them from one server process."""

    def __init__(self, server_env):
        self._import_env = _import_time(server_env)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server_env)   # the server's environment is the caller's at start
        try:
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def start(self, command, env, cwd, merge_stderr=True):
        """A ForkedProcess running `command`, or None where only a real process would do."""
        plan = _parse(command)
        if plan is None or _import_time(env) != self._import_env:
            return None
        script, args, nproc = plan
        outputs = tempfile.mkdtemp(prefix="fork-launch-")
        out = os.path.join(outputs, "stdout")
        err = out if merge_stderr else os.path.join(outputs, "stderr")
        process = self._context.Process(target=_agent, daemon=False,
                                        args=(script, args, nproc, dict(env), str(cwd), out, err))
        process.start()
        return ForkedProcess(process, outputs, out, None if merge_stderr else err)


class ForkedProcess:
    """What the tests use of subprocess.Popen: pid (also the process group's), poll, wait,
    returncode, and the output, whole, once the process has ended (`stdout` lines)."""

    def __init__(self, process, outputs, out, err):
        self._process, self._outputs, self._out, self._err = process, outputs, out, err
        self.pid = process.pid
        self.returncode = None

    def poll(self):
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("fork launch", timeout)
        return self.returncode

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def stdout(self):
        self.wait()
        yield from self.read()[0].splitlines(keepends=True)

    def read(self):
        """(stdout, stderr) as text; stderr is '' when it went into stdout."""
        texts = [Path(path).read_text(errors="replace") if path and os.path.exists(path) else ""
                 for path in (self._out, self._err)]
        for path in (self._out, self._err):
            if path and os.path.exists(path):
                os.unlink(path)
        os.rmdir(self._outputs)
        return texts


def _import_time(env):
    return {name: value for name, value in env.items()
            if name.startswith(IMPORT_TIME) and name not in NOT_IMPORT_TIME}


def _parse(command):
    """(script, args, nproc) for the two launches emulated here (nproc None: no torchrun)."""
    if not command or command[0] != sys.executable:
        return None
    words = list(command[1:])
    if words[:2] != ["-m", "torch.distributed.run"]:
        return (words[0], words[1:], None) if words and words[0].endswith(".py") else None
    words = words[2:]
    nproc, standalone = None, False
    while words and words[0].startswith("-"):
        option = words.pop(0)
        if option == "--standalone":
            standalone = True
        elif option.split("=")[0] in ("--nproc_per_node", "--nproc-per-node") and "=" in option:
            nproc = int(option.split("=", 1)[1])
        else:
            return None
    if not (standalone and nproc and words and words[0].endswith(".py")):
        return None
    return words[0], words[1:], nproc


def _agent(script, args, nproc, env, cwd, out, err):
    """In the forked process: its own session (so that a timeout kills it and its ranks
    together), the command's environment, directory and output files; then the script
    itself or the ranks."""
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    sys.stdout.reconfigure(write_through=True)   # PYTHONUNBUFFERED, as the labs run
    sys.stderr.reconfigure(write_through=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.exit(run_file(script, args) if nproc is None else _run_ranks(script, args, nproc))


def _run_ranks(script, args, nproc):
    """torchrun --standalone: the agent's store, nproc ranks, the first failure ends all."""
    import torch.distributed as dist
    from datetime import timedelta

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4 * nproc)
    port = listener.getsockname()[1]
    run_id = str(uuid.uuid4())
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            listener.close()
            os.environ.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
                "GROUP_RANK": "0", "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
            os._exit(run_file(script, args))
        ranks[pid] = rank
    # Hosted after the forks, so that no rank inherits the store's thread.
    store = dist.TCPStore("127.0.0.1", port, nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300), master_listen_fd=listener.fileno(),
                          use_libuv=False)
    failure = None
    while ranks:
        pid, status = os.waitpid(-1, 0)
        code = os.waitstatus_to_exitcode(status)
        rank = ranks.pop(pid, None)
        if rank is not None and code != 0 and failure is None:
            failure = (rank, code)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            signal.signal(signal.SIGALRM, lambda *_: [os.kill(p, signal.SIGKILL) for p in ranks])
            signal.alarm(TERMINATE_GRACE_S)
    del store
    if failure:
        print(f"[fork launch] rank {failure[0]} failed (exitcode: {failure[1]}); "
              f"the other ranks were ended", file=sys.stderr, flush=True)
        return 1
    return 0

"""A chapter's ranks forked from one Python that imported torch once, for torchrun's agent.

Each rank torchrun starts is a new Python, `python -u labs/<lab>.py ARGS`, that spends its
first 2.5 s of one core importing: torch (1.4 s), then torch._dynamo (1.1 s, with FSDP and
sympy), which every `optimizer.step()` imports (torch.optim's `_use_grad_for_differentiable`).
A chapter starts about 75 ranks: most of its CPU, and on two cores a 4-rank launch waits
5 s for it. In a chapter's kernel (labkit.runtime.notebook) a rank server, started with the
kernel's first launch helper, imports those modules once, on the core the kernel leaves
idle, and then forks each rank that torchrun's agent asks it for:

- the agent is torchrun's own (`python -m torch.distributed.run ...`, run in the chapter's
  spare Python, labkit.runtime.spare_python, which calls `fork_ranks_in_torchrun` before its
  imports): its rendezvous, its store, its monitoring, its restarts;
- where torch's SubprocessHandler would start `python -u FILE ARGS` for a rank, it sends the
  file, arguments, environment and folder, with its stdout and stderr, over a Unix socket
  in a folder of the kernel's alone; the server forks, and the child runs FILE as Python
  would (run_file): the rank's environment, its folder first on the path, a session of its
  own (torchrun signals each rank's process group), its output on the agent's;
- the agent sees the child as torchrun sees a process: its pid, and its exit status, sent
  back by the server when it ends. When the agent's connection closes (it ended, or a
  timeout killed it), the server kills that rank's group.

What a rank computes is the lab's own code, on modules imported in another process first.
Only a group's first start is forked: any later start of a local rank, a restart whether
torchrun counts it or not (a node that only saw another node fail keeps its count), starts
new Pythons, as a reader's would, so that the time a restart costs is measured whole; so do the labs that show how torchrun
started them (STARTED_BY_TORCHRUN: a forked rank's stacks end in the server's frames, and
its parent is the server), every rank on a machine with a GPU (a CUDA or ROCm process must
not be forked from one that may have touched the driver), and a rank whose
environment differs from the server's in a variable read at import. A forked rank ends
with its exit handlers and flushed output, but not Python's teardown: its agent hears of
its end sooner, and a peer of a rank that fails may be stopped by the agent before it
notices the lost connection itself. The unit of the build's budget, a bare launch, is measured
without any of it (scripts/book_cache.py).
"""

import atexit
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from .spare_python import import_time_variables

LABS_DIR = Path(__file__).resolve().parents[2]
# what the server imports once: what the labs' ranks import (the DTensor, FSDP and checkpoint
# modules come with torch._dynamo, or are the FSDP, tensor- and context-parallel labs' own)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
           "torch.distributed.fsdp", "torch.distributed.checkpoint")
# labs whose ranks torchrun starts itself, and why: what they show would be the server's
STARTED_BY_TORCHRUN = {
    "hang.py": "prints its own stacks (faulthandler), which would end in the server's frames",
    "ranks.py": "shows each rank's parent as its agent, which the server would be",
}
# what torchrun adds to each rank's environment (torch.distributed.elastic's local agent):
# read by torch.distributed as the rank runs, not as torch is imported
SET_BY_TORCHRUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
MESSAGE_BYTES = 1 << 20


def available():
    """Forking ranks here: Linux (Unix sockets that carry descriptors), and no GPU device
    (NVIDIA's, or ROCm's /dev/kfd)."""
    return (sys.platform == "linux" and hasattr(socket, "send_fds")
            and not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists())


def run_file(script, args):
    """What `python script args` does in a fresh interpreter, in this process; returns its
    exit status: the script as __main__, its folder first on the path, its exit handlers
    run and its output flushed at the end."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as done:
        status = done.code
        if status is None:
            status = 0
        elif not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
    except BaseException:   # noqa: BLE001 (Python's own handling of an uncaught exception)
        sys.excepthook(*sys.exc_info())
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


# ---- in the kernel

class RankServer:
    """The server process, started with `env` in `cwd`; `address` is its socket."""

    def __init__(self, env, cwd):
        self._env = dict(env)
        self._folder = tempfile.mkdtemp(prefix="rank-server-")   # this user's alone (0700)
        self.address = os.path.join(self._folder, "socket")
        # killed with the process that started it (PR_SET_PDEATHSIG), which may be a kernel
        # started ahead that is never used (book/_ext/spare_kernel.py); its forks are not
        code = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); "
                "os.getppid() == int(sys.argv[3]) or sys.exit(); "
                "sys.path.pop(0); sys.path.insert(0, sys.argv[1]); "
                "from labkit.runtime import rank_server; del sys.path[0]; "
                "rank_server.serve(sys.argv[2])")
        self.process = subprocess.Popen([sys.executable, "-c", code, str(LABS_DIR),
                                         self.address, str(os.getpid())], env=env, cwd=cwd,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def end(self):
        """Kill it (its ranks are ended as their agents' connections close) and its folder."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


# ---- in the server

def serve(address):
    """Bind `address` (connections wait there while the imports run), import PRELOAD, then
    fork a rank for each request whose environment it was started alike for, until killed."""
    started_with = _at_import(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    for name in PRELOAD:
        __import__(name)
    woken, wake = os.pipe()   # a child's end wakes the loop (SIGCHLD)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ranks = {}   # pid: the agent's connection
    agents = set()
    while True:
        ready, _, _ = select.select([listener, woken, *agents], [], [])
        if woken in ready:
            os.read(woken, 4096)
        while True:   # every child that ended: its status to its agent
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            agent = ranks.pop(pid, None)
            if agent is not None:
                _send(agent, f"exit {os.waitstatus_to_exitcode(status)}")
        if listener in ready:
            agents.add(listener.accept()[0])
        for agent in [a for a in agents if a in ready]:
            try:
                message, fds, _, _ = socket.recv_fds(agent, MESSAGE_BYTES, 2)
            except OSError:
                message, fds = b"", []
            if not message:   # the agent ended: so does its rank
                agents.discard(agent)
                for pid in [p for p, a in ranks.items() if a is agent]:
                    _kill_group(pid)
                agent.close()
                continue
            request = json.loads(message)
            if _at_import(request["env"]) != started_with:
                for fd in fds:
                    os.close(fd)
                _send(agent, "refused: a variable read at import differs")
                continue
            pid = os.fork()
            if pid == 0:
                _become_rank(request, fds, [listener, woken, wake, *agents])
            for fd in fds:
                os.close(fd)
            ranks[pid] = agent
            _send(agent, f"pid {pid}")


def _at_import(env):
    """The variables read as Python and torch start, but those torchrun sets for each rank."""
    return {name: value for name, value in import_time_variables(env).items()
            if not name.startswith(SET_BY_TORCHRUN)}


def _send(agent, text):
    try:
        agent.send(text.encode())
    except OSError:   # the agent has gone
        pass


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _become_rank(request, fds, inherited):
    """In the forked child: what torchrun's `python -u FILE ARGS` would be; never returns."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for item in inherited:
            item.close() if hasattr(item, "close") else os.close(item)
        os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, target in zip(fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout.reconfigure(write_through=True)   # python -u
        sys.stderr.reconfigure(write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        atexit._clear()
        status = run_file(request["script"], request["args"])
    finally:
        os._exit(status)


# ---- in torchrun's agent

class ForkedRank:
    """What torchrun's agent uses of the Popen of a rank: pid (its process group's too),
    poll, wait and returncode; the exit status comes from the server."""

    def __init__(self, connection, pid):
        self._connection = connection
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            self._read()
        return self.returncode

    def _read(self):
        message = self._connection.recv(64).decode()
        # "exit STATUS"; nothing: the server died, and the rank with it
        self.returncode = int(message.split()[1]) if message else -signal.SIGKILL
        self._connection.close()


def fork_ranks_in_torchrun(address):
    """In the chapter's spare Python, before it imports torch and runs torchrun: each rank
    of the group's first start that the server at `address` can run is forked there."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler)
    handler_class = subprocess_handler.SubprocessHandler
    torchruns_popen = handler_class._popen

    first_start = set()   # the local ranks forked: any later start of one is a restart

    def popen(handler, args, env):
        forkable = (env.get("LOCAL_RANK") not in first_start
                    and handler._stdout is None and handler._stderr is None
                    and list(args[:2]) == [sys.executable, "-u"] and len(args) > 2
                    and Path(args[2]).name not in STARTED_BY_TORCHRUN)
        first_start.add(env.get("LOCAL_RANK"))
        rank = _fork(address, args[2], list(args[3:]), env) if forkable else None
        return rank or torchruns_popen(handler, args, env)

    handler_class._popen = popen


def _fork(address, script, args, env):
    """A ForkedRank running `script`, or None when the server cannot be reached or refuses
    (it was started with other values of the variables read at import)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(address)
        request = {"script": script, "args": args, "env": env, "cwd": os.getcwd()}
        socket.send_fds(connection, [json.dumps(request).encode()],
                        [sys.stdout.fileno(), sys.stderr.fileno()])
        reply = connection.recv(64).decode().split()   # "pid N", after the server's imports
    except OSError:
        connection.close()
        return None
    if reply[:1] != ["pid"]:
        connection.close()
        return None
    return ForkedRank(connection, int(reply[1]))

"""A chapter's ranks forked from one Python that imported torch once, for torchrun's agent.

Each rank torchrun starts is a new Python, `python -u labs/<lab>.py ARGS`, that spends its
first 2.5 s of one core importing: torch (1.4 s), then torch._dynamo (1.1 s, with FSDP and
sympy), which every `optimizer.step()` imports (torch.optim's `_use_grad_for_differentiable`).
The chapters start about 75 ranks in all: most of their CPU, and on two cores a 4-rank
launch waits 5 s for it. In a chapter's kernel (labkit.runtime.notebook) a rank server,
started with the kernel (the build starts each chapter's kernel ahead, book/_ext/
spare_kernel.py) or else by its first launch helper, imports those modules once, on the core
the kernel leaves idle, and then forks each rank that torchrun's agent asks it for:

- the agent is torchrun's own (`python -m torch.distributed.run ...`, run in the chapter's
  spare Python, labkit.runtime.spare_python, which calls `fork_ranks_in_torchrun` before its
  imports): its rendezvous, its store, its monitoring, its restarts;
- where torch's SubprocessHandler would start `python -u FILE ARGS` for a rank, it sends the
  file, arguments, environment and folder, with its stdout and stderr, over a Unix socket
  in a folder of the kernel's alone; the server forks, and the child runs FILE as Python
  would (run_file): the rank's environment, its folder first on the path, a session of its
  own (torchrun signals each rank's process group), its output on the agent's;
- the agent sees the child as torchrun sees a process: its pid (its group's, once in its
  own session), and its exit status, sent back by the server when it ends; until the agent
  has read it, the child is left unreaped, as a Popen's child is until its parent polls.
  When the agent's connection closes first (it ended, or a timeout killed it), the server
  kills the rank's group; a rank dies with the server (PR_SET_PDEATHSIG).

What a rank computes is the lab's own code, on modules imported in another process first;
what it could see differ from a fresh `python -u`: its tracebacks end in the frames that ran
the file; the string hash seed is the server's (PYTHONHASHSEED is drawn once per process);
a warning an import gives went to the server's stderr, once; `time.process_time()` counts
from the fork; and a rank that fails ends without Python's teardown of its modules, so its
agent hears of it sooner, and a peer may be stopped before it notices the lost connection
itself. Its seeds are drawn again (torch's, numpy's; Python's `random` reseeds at a fork),
its threads are joined and its exit handlers run as Python's exit does.

Only a group's first start is forked: any later start of a local rank, a restart whether
torchrun counts it or not (a node that only saw another node fail keeps its count), starts
new Pythons, as a reader's would, so that the time a restart costs is measured whole; so do
the labs that show how torchrun started them (STARTED_BY_TORCHRUN: a forked rank's stacks
end in the server's frames, and its parent is the server), every rank on a machine with a
GPU (a CUDA or ROCm process must not be forked from one that may have touched the driver),
and a rank whose environment differs from the server's in a variable read at import. The
unit of the build's budget, a bare launch, is measured without any of it
(scripts/book_cache.py).
"""

import atexit
import ctypes
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
import threading
from pathlib import Path

from .spare_python import import_time_variables

LABS_DIR = Path(__file__).resolve().parents[2]
# what the server imports once: what the labs' ranks import (DTensor and FSDP come with
# torch._dynamo; the checkpoint modules are the FSDP and at-scale chapters' labs' own)
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
# read by torchrun's agent alone (whether its rendezvous store is lent to the ranks), never
# as torch is imported: a launch that sets it forks from the same server
READ_BY_THE_AGENT = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",)
# written by torch._inductor as it is imported (its default): a kernel that imported it has
# it, and a fresh rank's imports would set it too
SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR",)
MESSAGE_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1   # linux/prctl.h


# an accelerator's device files: NVIDIA's, ROCm's, WSL2's GPU, Intel's render nodes (XPU),
# Habana's and other accelerators: where one is, a rank starts as torchrun starts it
ACCELERATOR_DEVICES = ("nvidia[0-9]*", "kfd", "dxg", "dri/renderD*", "accel*")


def available():
    """Forking ranks here: Linux (Unix sockets that carry descriptors), and no accelerator
    device (ACCELERATOR_DEVICES)."""
    return (sys.platform == "linux" and hasattr(socket, "send_fds")
            and not any(any(Path("/dev").glob(name)) for name in ACCELERATOR_DEVICES))


def run_file(script, args):
    """What `python script args` does in a fresh interpreter, in this process; returns its
    exit status: the script as __main__, its folder first on the path; at the end, as
    Python's own exit does, its threads joined, the exit handlers run (those the imports
    registered in the process it was forked from too) and its output flushed."""
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
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)   # C's stdio, which os._exit would not flush
    return status


# ---- in the kernel

class RankServer:
    """The server process, started with `env` in `cwd`; `address` is its socket."""

    def __init__(self, env, cwd):
        self._folder = tempfile.mkdtemp(prefix="rank-server-")   # this user's alone (0700)
        self.address = os.path.join(self._folder, "socket")
        code = ("import sys; sys.path.pop(0); sys.path.insert(0, sys.argv[1]); "
                "from labkit.runtime import rank_server; del sys.path[0]; "
                "rank_server.serve(sys.argv[2], int(sys.argv[3]))")
        self.process = subprocess.Popen([sys.executable, "-c", code, str(LABS_DIR),
                                         self.address, str(os.getpid())], env=env, cwd=cwd,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def end(self):
        """Kill it, and its folder: a rank still running dies with it (PR_SET_PDEATHSIG),
        and its agent hears that it was killed. (Should this process die first, the server
        removes its folder itself.)"""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


# ---- in the server

def serve(address, parent):
    """Bind `address` (connections wait there while the imports run), import PRELOAD, then
    fork a rank for each request whose environment it was started alike for, until killed
    or until process `parent`, which started it, ends: it then removes its folder and exits
    (PR_SET_PDEATHSIG: the parent may be a kernel started ahead that is never used, killed
    without a word, book/_ext/spare_kernel.py), and its ranks die with it.
    A rank that ends stays a zombie, its pid and group held, until its agent has read its
    status and closed the connection: torchrun signals the group of a rank it has not yet
    seen end, as it would a Popen's child that it has not yet reaped."""
    folder = os.path.dirname(address)

    def gone(*_):
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, gone)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:   # it ended before that was set
        gone()
    started_with = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    for name in PRELOAD:
        __import__(name)
    # what the imports set (TORCHINDUCTOR_CACHE_DIR): a fresh rank's imports would set it too
    set_by_imports = {name: value for name, value in os.environ.items()
                      if name not in started_with}
    woken, wake = os.pipe()   # a child's end wakes the loop (SIGCHLD)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ranks = {}   # pid: the agent's connection
    told = set()   # the pids whose end their agent was sent
    agents = set()
    while True:
        ready, _, _ = select.select([listener, woken, *agents], [], [])
        if woken in ready:
            os.read(woken, 4096)
        for pid in [p for p in ranks if p not in told]:   # each rank that ended, left unreaped
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if ended is not None:
                status = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
                _send(ranks[pid], f"exit {status}")
                told.add(pid)
        if listener in ready:
            agents.add(listener.accept()[0])
        for agent in [a for a in agents if a in ready]:
            try:
                message, fds, _, _ = socket.recv_fds(agent, MESSAGE_BYTES, 2)
            except OSError:
                message, fds = b"", []
            if not message:   # the agent read its rank's end, or ended: reap, or kill first
                agents.discard(agent)
                for pid in [p for p, a in ranks.items() if a is agent]:
                    if pid not in told:
                        _kill_group(pid)
                    os.waitpid(pid, 0)
                    del ranks[pid]
                    told.discard(pid)
                agent.close()
                continue
            request = json.loads(message)
            pid = None
            if _at_import(request["env"]) == _at_import(started_with):
                pid = _fork_rank(request, fds, set_by_imports, [listener, woken, wake, *agents])
            for fd in fds:
                os.close(fd)
            if pid is None:
                _send(agent, "refused")
                continue
            ranks[pid] = agent
            _send(agent, f"pid {pid}")


def _fork_rank(request, fds, set_by_imports, inherited):
    """The pid of a child that runs the request, once it is in a session of its own (so
    that its pid is its group's when the agent hears of it); None if it could not start."""
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(ready_r)
        os.close(ready_w)
        return None
    if pid == 0:
        os.close(ready_r)
        _become_rank(request, fds, set_by_imports, ready_w, inherited)
    os.close(ready_w)
    started = os.read(ready_r, 1)   # nothing: it died first
    os.close(ready_r)
    return pid if started else None


def _at_import(env):
    """The variables read as Python and torch start, but those torchrun sets for each rank,
    those only its agent reads and those torch's own imports set."""
    return {name: value for name, value in import_time_variables(env).items()
            if not name.startswith(SET_BY_TORCHRUN + READ_BY_THE_AGENT)
            and name not in SET_BY_IMPORTS}


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


def _become_rank(request, fds, set_by_imports, ready, inherited):
    """In the forked child: what torchrun's `python -u FILE ARGS` would be; never returns."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # torchrun's way of ending a rank
        for item in inherited:
            item.close() if hasattr(item, "close") else os.close(item)
        os.setsid()
        # killed with the server, which alone could tell its agent how it ended
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.write(ready, b"1")
        os.close(ready)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, target in zip(fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout.reconfigure(write_through=True)   # python -u
        sys.stderr.reconfigure(write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**set_by_imports, **request["env"]})
        # a new process draws its own seeds: torch's generator, numpy's (random's is reseeded
        # at every fork by Python itself)
        sys.modules["torch"].seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
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
        # "exit STATUS"; nothing: the server died, and the rank with it (PR_SET_PDEATHSIG)
        self.returncode = int(message.split()[1]) if message else -signal.SIGKILL
        self._connection.close()


def fork_ranks_in_torchrun(address):
    """In the chapter's spare Python, before it imports torch and runs torchrun: each rank
    of the group's first start that the server at `address` can run is forked there."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler)
    except ImportError:   # a torch that starts its ranks elsewhere: torchrun starts them
        return
    handler_class = subprocess_handler.SubprocessHandler
    torchruns_popen = getattr(handler_class, "_popen", None)
    if torchruns_popen is None:   # started otherwise in this release: torchrun starts them
        return

    first_start = set()   # the local ranks started: any later start of one is a restart

    def popen(handler, args, env):
        # the handler's own index of the local rank (torch 2.13 sets it before it starts the
        # process; older releases may not); its files for the rank's output, if redirected
        local_rank = getattr(handler, "local_rank_id", env.get("LOCAL_RANK"))
        forkable = (local_rank not in first_start
                    and getattr(handler, "_stdout", None) is None
                    and getattr(handler, "_stderr", None) is None
                    and list(args[:2]) == [sys.executable, "-u"] and len(args) > 2
                    and not args[2].startswith("-")   # a script, not torchrun's -m MODULE
                    and Path(args[2]).name not in STARTED_BY_TORCHRUN)
        first_start.add(local_rank)
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

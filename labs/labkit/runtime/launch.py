"""Run a lab under torchrun from a notebook or a test, and get its results back.

    from labkit.runtime.launch import run_lab
    result = run_lab("grad_averaging", nproc=4, args=["--steps", 30])

It runs `python -m torch.distributed.run --standalone --nproc_per_node=N labs/<lab>.py ...`
with this interpreter (the notebook kernel's own), shows the `torchrun` line a reader would
type, streams the lab's output as it comes (labs print on rank 0 only, so that stays short),
and returns the JSON the lab wrote. When the lab fails, it raises `LabError` with the lab's
own error output, so the notebook cell, the book build and the test fail visibly. A bare
`!torchrun ...` cell would not: its exit status is ignored.

In a notebook's kernel a launch's first process (torchrun's agent, or a lab run as one
process) is a Python started when the previous launch ended, which imported torch while
the kernel went on (labkit.runtime.spare_python); it then runs the command as Python
would. The ranks of a group's first start are forked from a server that imported torch
once for the chapter (labkit.runtime.rank_server), where it can; else, and at a restart,
torchrun starts them afresh as always.
"""

import atexit
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from . import rank_server
from .spare_python import SparePython

LABS_DIR = Path(__file__).resolve().parents[2]   # labs/, where the lab scripts are
REPO_DIR = LABS_DIR.parent
ERROR_TAIL_LINES = 60  # how much of a failing lab's output goes into the exception
# A lab still running after this long is killed, and its output so far goes into the error.
# It sits below the book's cell timeout (_config.yml, execute.timeout), so that a stuck lab
# fails its cell with this message rather than with the kernel's bare timeout, and above
# the labs' own --timeout, so that a missing peer is reported by the lab itself first.
LAUNCH_TIMEOUT_S = 300


class LabError(RuntimeError):
    """A lab exited non-zero, timed out, or wrote no result."""

    def __init__(self, message, returncode=None, output=""):
        super().__init__(message)
        self.returncode = returncode
        self.output = output


def reader_command(lab, nproc, args=(), width=88, nnodes=1, max_restarts=0, env=None):
    """The command a reader would type for the same run, from the repository root; past
    `width` characters it continues on the next line (a backslash), so a page shows it
    whole. With nnodes > 1, the command each node runs (HOST: the rendezvous's); `env`,
    variables set for the run, come first (NAME=value torchrun ...)."""
    prefix = [f"{name}={value}" for name, value in (env or {}).items()]
    if nproc is None:
        words = ["python", f"labs/{lab}.py", *map(str, args)]
    elif nnodes > 1:
        words = ["torchrun", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
                 "--rdzv-backend=c10d", "--rdzv-endpoint=HOST:PORT", f"--rdzv-id={lab}",
                 f"labs/{lab}.py", *map(str, args)]
    else:
        words = ["torchrun", "--standalone", f"--nproc_per_node={nproc}",
                 *([f"--max-restarts={max_restarts}"] if max_restarts else []),
                 f"labs/{lab}.py", *map(str, args)]
    lines, line = [], []
    for word in [*prefix, *map(shlex.quote, words)]:
        # an option and its value stay together: break before an option only
        if line and word.startswith("-") and len(" ".join(line + [word])) > width - 4:
            lines.append(" ".join(line))
            line = []
        line.append(word)
    lines.append(" ".join(line))
    return " \\\n    ".join(lines)


def run_lab(lab, nproc=1, args=(), *, nnodes=1, max_restarts=0, env=None,
            timeout=LAUNCH_TIMEOUT_S, echo=True):
    """Launch `labs/<lab>.py` on `nproc` local processes; return its parsed JSON result.

    nproc=None runs `python labs/<lab>.py` as one process without torchrun, for what a
    lab does in one process alone (the memory lab's --simulate-world-size).
    nnodes=K starts K torchrun agents on this machine, each with nproc ranks, that meet
    through a c10d rendezvous on 127.0.0.1 and a free port: K "nodes" as torchrun sees
    them, a world of K x nproc. max_restarts=R lets torchrun start the group again, up to
    R times, when a rank dies. env={NAME: value} sets variables for this run alone (the
    notebook's own environment is left as it is).
    echo=True prints the reader's command and the lab's output as it comes; "command"
    the command alone; False nothing (the output still goes into a failure's message).
    """
    script = LABS_DIR / f"{lab}.py"
    if not script.is_file():
        raise FileNotFoundError(f"no lab named {lab!r}: {script} does not exist")
    args = [str(a) for a in args]
    if echo:
        print(("# on each node:\n" if nnodes > 1 else "") + "$ "
              + reader_command(lab, nproc, args, nnodes=nnodes, max_restarts=max_restarts,
                               env=env),
              flush=True)
    extra_env = {name: str(value) for name, value in (env or {}).items()}
    echo = echo is True   # from here on: whether to stream the lab's output

    with tempfile.TemporaryDirectory(prefix=f"{lab}-") as tmp:
        out = Path(tmp) / f"{lab}.json"
        restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
        commands = [[sys.executable, *launcher, *restarts, str(script), *args, "--out", str(out)]
                    for launcher in _launchers(lab, nproc, nnodes)]
        try:
            returncode, lines = _run_streaming(commands, lab_environment(extra_env), timeout,
                                               echo)
        finally:
            # while the caller reads this result, the next launch's Python imports torch
            _keep_spare()
        if returncode != 0:
            raise LabError(_failure_message(lab, nproc, returncode, lines),
                           returncode, "".join(lines))
        if not out.is_file():
            raise LabError(f"lab {lab} exited 0 but wrote no result to --out", 0, "".join(lines))
        return json.loads(out.read_text())


def lab_environment(extra_env):
    """The environment the lab's processes get: this one, with `extra_env` on top."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # NGC containers set it to 1, which makes every fp32 matmul TF32 and breaks the labs'
    # 1e-5 comparisons; torch reads it once, at import, before a lab could undo it.
    env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "0"
    env.update(extra_env)
    # Without it torchrun prints a banner and sets 1 itself; with N ranks on few
    # cores, one thread per rank is also what keeps them from fighting.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def free_port():
    """A port on 127.0.0.1 that nothing uses now, from the OS (never a fixed one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launchers(lab, nproc, nnodes):
    """The interpreter arguments before the script, one list per agent (node)."""
    if nproc is None:
        return [[]]
    if nnodes == 1:
        return [["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]]
    agent = ["-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
             f"--rdzv-id={lab}-{uuid.uuid4().hex[:8]}"]
    return [agent] * nnodes


def _popen(command, env):
    """`command` as a process of its own, its stdout and stderr merged into one pipe. A new
    session, so that a timeout can kill torchrun and every rank it started."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO_DIR, start_new_session=True)


def keep_a_spare_python():
    """From now on, have a Python ready before each launch, torch imported
    (labkit.runtime.spare_python): the next launch's agent starts its ranks, or a lab
    run as one process its work, about a second sooner; and, where it can
    (labkit.runtime.rank_server), a server that imported torch once, from which that
    agent forks the ranks of a group's first start. The chapters' helper
    (labkit.runtime.notebook) turns it on."""
    global _spares_on
    _spares_on = True
    start_rank_server()
    _keep_spare()


def start_rank_server():
    """The rank server of keep_a_spare_python, started now if it is not running: the book
    build starts it with each chapter's kernel, which it starts ahead
    (book/_ext/spare_kernel.py), so that it has imported torch by the first launch."""
    global _rank_server
    if _rank_server is None and rank_server.available():
        _rank_server = rank_server.RankServer(lab_environment({}), REPO_DIR)


_spares_on = False
_spare = None
# held while the spare is taken or replaced: a chapter may launch from several threads at
# once (the hangs chapter does), and a spare handed to two launches would run only one
_spare_lock = threading.Lock()
_rank_server = None


def _keep_spare():
    global _spare
    with _spare_lock:
        if _spares_on and (_spare is None or not _spare.alive()):
            call = None
            if _rank_server is not None and _rank_server.process.poll() is None:
                call = (LABS_DIR, "labkit.runtime.rank_server", "fork_ranks_in_torchrun",
                        _rank_server.address)
            _spare = SparePython(lab_environment({}), REPO_DIR, call=call)


@atexit.register
def _drop_spare():
    """End the spare and the rank server with their kernel at once: left alone the spare
    would finish importing torch first, beside whatever the machine runs next."""
    global _spare, _rank_server
    if _spare is not None:
        _spare.end()
        _spare = None
    if _rank_server is not None:
        _rank_server.end()
        _rank_server = None


def _start(command, env):
    """`command` in the spare Python when one is on and can run it, else as a new process."""
    global _spare
    with _spare_lock:
        if _spare is not None and (process := _spare.run(command, env, REPO_DIR)) is not None:
            _spare = None
            return process
    return _popen(command, env)


# How a command starts. The test suite puts its own here (tests/conftest.py): one that
# forks the labs from a process that has imported torch already, a few CPU-seconds less
# per process; whatever it returns has Popen's pid (a process group), poll, wait and stdout.
start_process = _start


def _run_streaming(commands, env, timeout, echo):
    """Run `commands` at once (torchrun agents, or one process), echoing their merged
    stdout/stderr line by line; kill them all on timeout. Returns (the first non-zero exit
    status or 0, output lines)."""
    lines, lock = [], threading.Lock()
    procs = [start_process(command, env) for command in commands]
    timers = [_Killer(proc, timeout) for proc in procs]

    def read(proc):
        for line in proc.stdout:
            with lock:
                lines.append(line)
                if echo:
                    print(line, end="", flush=True)

    readers = [threading.Thread(target=read, args=(proc,), daemon=True) for proc in procs]
    try:
        for reader in readers:
            reader.start()
        for proc, reader in zip(procs, readers):
            reader.join()
            proc.wait()
    finally:
        for timer, proc in zip(timers, procs):
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
    if any(timer.fired for timer in timers):
        lines.append(f"[launcher] killed after {timeout} s without finishing\n")
    returncode = next((proc.returncode for proc in procs if proc.returncode), 0)
    return returncode, lines


class _Killer:
    """Kill a process group after `timeout` seconds unless cancelled first."""

    def __init__(self, proc, timeout):
        self.fired = False
        self._timer = threading.Timer(timeout, self._fire, args=(proc,))
        self._timer.daemon = True
        self._timer.start()

    def _fire(self, proc):
        self.fired = True
        _kill_group(proc)

    def cancel(self):
        self._timer.cancel()


def _kill_group(proc):
    """Kill a launch: its process group and every process below it. torchrun starts each
    rank in a session of its own, so killing the agent's group alone would leave the ranks
    running (and holding the output pipe open until their own timeouts end them). The
    group is stopped first, so that no agent starts a rank while the tree is read."""
    _signal_group(proc.pid, signal.SIGSTOP)
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid):
    """The processes `pid` started, and those they started, read from /proc (Linux; none
    found elsewhere, where the group alone is killed)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:   # it ended meanwhile
            continue
        # after the command's name, which may hold spaces, come the state, then the parent
        parent = int(text[text.rindex(")") + 2:].split()[1])
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _failure_message(lab, nproc, returncode, lines):
    """The lab's own error lines first (torchrun's per-rank report can push them out of
    the tail at large N), then the tail of its output."""
    errors = dict.fromkeys(line.rstrip() for line in lines if _is_error_line(lab, line))
    tail = "".join(lines[-ERROR_TAIL_LINES:]).rstrip()
    heading = "".join(f"  {line}\n" for line in errors)
    return (f"lab {lab} failed with exit status {returncode} at nproc={nproc}.\n"
            + (f"Its errors:\n{heading}" if errors else "")
            + f"Its output (last {ERROR_TAIL_LINES} lines):\n{tail}")


def _is_error_line(lab, line):
    """`<lab>: error: ...` (bad input), `SomeError: ...` (an exception), not torchrun's, or
    `what(): ...` (a C++ exception that ended the process, such as gloo's checks)."""
    if line.startswith(f"{lab}: error:") or line.lstrip().startswith("what():"):
        return True
    match = re.match(r"[\w.]*(Error|Exception): ", line)
    return bool(match) and "ChildFailedError" not in line

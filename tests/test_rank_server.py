"""The chapters' rank server (labkit.runtime.rank_server): torchrun's own agent, in a spare
Python, forks the ranks of a group's first start from a server that imported torch once.
Each forked rank sees what torchrun gives a rank and fails as a rank fails; a restart, and
a lab that shows how torchrun started it, get new Pythons; an agent that dies takes its
forked ranks with it. Real processes: the test suite's forked launches are not what a
chapter runs."""

import os
import signal
import sys
import time

import pytest

from labkit.runtime import launch, rank_server
from labkit.runtime.spare_python import SparePython

pytestmark = pytest.mark.skipif(not rank_server.available(), reason="needs Linux, no GPU")

AGENT = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# one write per line: the ranks share the pipe
PROBE = """import os, sys
import torch
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
words = ["probe", os.environ["PROBE"], os.environ["RANK"], os.environ["WORLD_SIZE"], restart,
         str(os.getppid()), str(os.getpgid(0) == os.getpid()), *sys.argv[1:],
         str(torch.initial_seed())]
os.write(1, (" ".join(words) + "\\n").encode())
if os.environ["RANK"] == os.environ.get("FAIL_RANK") and restart == "0":
    sys.exit(3)
if os.environ["RANK"] == os.environ.get("SLEEP_RANK"):
    import time
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def server():
    env = launch.lab_environment({})
    started = rank_server.RankServer(env, launch.REPO_DIR)
    yield started
    started.end()


def agent(server, tmp_path, nproc, *options, script="probe.py", **env):
    """torchrun's agent in a spare that forks from `server`, running the probe as `script`
    with `env` added (the spare started with it too); its Popen."""
    probe = tmp_path / script
    probe.write_text(PROBE)
    base = launch.lab_environment(env)
    call = (launch.LABS_DIR, "labkit.runtime.rank_server", "fork_ranks_in_torchrun",
            server.address)
    spare = SparePython(base, tmp_path, call=call)
    process = spare.run([*AGENT, f"--nproc_per_node={nproc}", *options, str(probe), "--x", "1"],
                        {**base, "PROBE": "seen", **env}, tmp_path)
    assert process is spare.process
    return process


def probes(output):
    return sorted(line.split()[1:] for line in output.splitlines() if line.startswith("probe"))


def test_an_odd_world_is_forked_from_the_server_with_what_torchrun_gives_each_rank(
        server, tmp_path):
    process = agent(server, tmp_path, 3)
    output = process.stdout.read()
    assert process.wait(timeout=120) == 0, output
    # the launch's environment and arguments, torchrun's RANK and WORLD_SIZE, a session of
    # its own (torchrun signals each rank's group); the parent is the server; and torch's
    # seed drawn by each, as a new process draws it
    ranks = probes(output)
    assert [r[:-1] for r in ranks] == [["seen", str(rank), "3", "0", str(server.process.pid),
                                        "True", "--x", "1"] for rank in range(3)], output
    assert len({r[-1] for r in ranks}) == 3, output


def test_a_failing_rank_fails_its_group_and_the_restart_starts_new_pythons(server, tmp_path):
    process = agent(server, tmp_path, 2, "--max-restarts=1", FAIL_RANK="1")
    output = process.stdout.read()
    assert process.wait(timeout=120) == 0, output
    assert "exitcode: 3" in output, output   # the status torchrun heard from the server
    first = [p for p in probes(output) if p[3] == "0"]
    again = [p for p in probes(output) if p[3] == "1"]
    assert len(first) >= 1 and all(p[4] == str(server.process.pid) for p in first), output
    # the restart: torchrun's own processes, children of the agent
    assert [p[1] for p in again] == ["0", "1"], output
    assert all(p[4] == str(process.pid) for p in again), output


def test_an_agent_that_dies_takes_its_forked_ranks_with_it(server, tmp_path):
    process = agent(server, tmp_path, 2, SLEEP_RANK="1")
    lines = []
    while len(lines) < 2:   # both ranks have started
        line = process.stdout.readline()
        assert line, "".join(lines)
        if line.startswith("probe"):
            lines.append(line)
    os.killpg(process.pid, signal.SIGKILL)   # what a launch's timeout does to its agent
    process.wait(timeout=60)
    # the sleeping rank was the server's child, in a group of its own: the server ends it
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _children(server.process.pid):
        time.sleep(0.1)
    assert not _children(server.process.pid), lines


@pytest.mark.parametrize("case", [{"script": "ranks.py"}, {"OMP_NUM_THREADS": "2"}],
                         ids=["ranks.py", "read-at-import"])
def test_torchrun_starts_what_the_server_cannot_run_as_asked(server, tmp_path, case):
    """ranks.py shows each rank's parent as its agent's pid; a rank whose environment
    differs from the server's in a variable torch reads at import is refused there. Either
    way torchrun starts the ranks, children of the agent."""
    process = agent(server, tmp_path, 2, **case)
    output = process.stdout.read()
    assert process.wait(timeout=120) == 0, output
    assert [p[4] for p in probes(output)] == [str(process.pid)] * 2, output


@pytest.mark.parametrize("ending, status", [("sys.exit(5)", 5),
                                            ("os.kill(os.getpid(), signal.SIGKILL)", -9)])
def test_a_rank_that_ended_keeps_its_group_until_its_agent_reads_how(server, tmp_path, ending,
                                                                   status):
    """As a Popen's child is a zombie until its parent polls it: torchrun may still signal
    the group of a rank it has not seen end. Then the status, a signal's as Popen gives it."""
    script = tmp_path / "ends.py"
    script.write_text(f"import os, signal, sys\n{ending}\n")
    env = launch.lab_environment({})
    rank = rank_server._fork(server.address, str(script), [], env)
    assert rank is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _zombie(rank.pid):
        time.sleep(0.05)
    assert _zombie(rank.pid)
    os.killpg(rank.pid, signal.SIGTERM)   # what torchrun's close does: no ProcessLookupError
    assert rank.wait(timeout=30) == status and rank.poll() == status
    deadline = time.monotonic() + 30   # read: the server reaps it, and its group is gone
    while time.monotonic() < deadline and _zombie(rank.pid):
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.killpg(rank.pid, 0)


def test_a_server_whose_kernel_dies_removes_its_folder_and_exits(tmp_path):
    """The build kills a kernel started ahead that no chapter took, with SIGKILL: its rank
    server goes too, and leaves no folder behind."""
    import subprocess
    kernel = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
         "from labkit.runtime import launch, rank_server; "
         "server = rank_server.RankServer(launch.lab_environment({}), launch.REPO_DIR); "
         "print(server.process.pid, server.address, flush=True); time.sleep(600)",
         str(launch.LABS_DIR)], stdout=subprocess.PIPE, text=True)
    pid, address = kernel.stdout.readline().split()
    kernel.kill()
    kernel.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (os.path.exists(os.path.dirname(address))
                                           or os.path.exists(f"/proc/{pid}")):
        time.sleep(0.1)
    assert not os.path.exists(os.path.dirname(address))
    assert not os.path.exists(f"/proc/{pid}") or _zombie(int(pid))


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _children(pid):
    """The living children of process `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and fields[1] == str(pid) and fields[0] != "Z":
            found.append(int(entry))
    return found

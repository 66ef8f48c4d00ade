"""The chapters' spare Python (labkit.runtime.spare_python): a launch it takes runs as
`python -m torch.distributed.run` or `python FILE` runs it, with the launch's own arguments
and environment;
it refuses what it was not started for; it ends when its kernel does; and through run_lab
a failing lab still fails with its own line while the next spare is already on its way.
Real processes: the test suite's forked launches are not what a chapter runs."""

import sys

import pytest

from labkit.runtime import launch
from labkit.runtime.launch import LabError, run_lab
from labkit.runtime.spare_python import SparePython

AGENT = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# one write per line: the ranks share the pipe, and print() unbuffered writes the line and
# its newline apart, so that two ranks' lines could run into one
PROBE = """import os
words = ["probe", os.environ["PROBE"], os.environ.get("SPARE_ONLY", "-"), os.environ["RANK"],
         os.environ["WORLD_SIZE"], str(os.getppid())]
os.write(1, (" ".join(words) + "\\n").encode())
"""


def test_a_spare_runs_torchrun_with_the_launchs_arguments_and_environment(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = launch.lab_environment({})
    spare = SparePython({**env, "SPARE_ONLY": "1"}, tmp_path)
    # an odd world; a variable the spare did not start with reaches every rank, and one
    # the launch does not set is gone
    process = spare.run([*AGENT, "--nproc_per_node=3", str(probe)], {**env, "PROBE": "seen"},
                        tmp_path)
    assert process is spare.process
    output = process.stdout.read()   # its stdin is closed: the request was its one line
    assert process.wait(timeout=120) == 0, output
    lines = sorted(line.split() for line in output.splitlines() if line.startswith("probe"))
    # each rank a child of the spare, which ran as torchrun's agent
    assert lines == [["probe", "seen", "-", str(rank), "3", str(process.pid)]
                     for rank in range(3)]


def test_a_spare_runs_a_file_as_python_does(tmp_path):
    """`python FILE args`: the file as __main__, its arguments, its folder first on the path
    (a module beside it imports), the launch's environment."""
    labs = tmp_path / "labs"   # not the working directory: only the file's folder finds beside
    labs.mkdir()
    (labs / "beside.py").write_text("WHERE = 'beside'\n")
    (labs / "lab.py").write_text(
        "import os, sys\nimport beside\n"
        "print('ran', __name__, beside.WHERE, *sys.argv[1:], os.environ['PROBE'])\n")
    env = launch.lab_environment({})
    spare = SparePython(env, tmp_path)
    process = spare.run([sys.executable, str(labs / "lab.py"), "--out", "x.json"],
                        {**env, "PROBE": "seen"}, tmp_path)
    assert process is spare.process
    output = process.stdout.read()
    assert process.wait(timeout=120) == 0, output
    assert "ran __main__ beside --out x.json seen" in output.splitlines(), output


def test_a_spare_refuses_what_it_was_not_started_for_and_ends_with_its_kernel(tmp_path):
    env = launch.lab_environment({"OMP_NUM_THREADS": "1"})
    spare = SparePython(env, tmp_path)
    agent = [*AGENT, "--nproc_per_node=2", "lab.py"]
    assert spare.run(agent, {**env, "OMP_NUM_THREADS": "2"}, tmp_path) is None   # read at import
    assert spare.run(agent, {**env, "PYTHONHASHSEED": "1"}, tmp_path) is None    # read at start
    assert spare.run(agent, {**env, "LOGLEVEL": "INFO"}, tmp_path) is None       # torchelastic's
    assert spare.run([sys.executable, "-c", "pass"], env, tmp_path) is None     # an option
    assert spare.run(["/usr/bin/python3", "lab.py"], env, tmp_path) is None     # another Python
    assert spare.run(agent, env, tmp_path / "elsewhere") is None
    assert spare.alive()
    spare.process.stdin.close()   # what the kernel's exit does to the spare's stdin
    assert spare.process.wait(timeout=60) == 0


@pytest.fixture
def spares(monkeypatch):
    """run_lab as a chapter's kernel has it: real processes, a spare kept; no rank server
    (it would import torch and more for launches these tests do not fork: its own tests,
    tests/test_rank_server.py, run it with a spare)."""
    monkeypatch.setattr(launch, "start_process", launch._start)
    monkeypatch.setattr(launch, "_spare", None)
    monkeypatch.setattr(launch, "start_rank_server", lambda: None)
    launch.keep_a_spare_python()
    yield
    launch._spares_on = False
    launch._drop_spare()


def test_a_lab_failing_in_the_spare_fails_with_its_own_line(spares):
    spare = launch._spare
    with pytest.raises(LabError) as error:
        run_lab("hang", 2, ["--rank", 5], echo=False)
    assert "hang: error: --rank 5 is not a rank of a world of 2" in str(error.value)
    assert spare.process.returncode not in (None, 0)   # the spare was the agent, and failed
    following = launch._spare   # the next one waits
    assert following is not None and following is not spare and following.alive()
    launch._drop_spare()   # as the kernel exits
    assert following.process.returncode is not None and launch._spare is None


def test_launches_from_several_threads_at_once_share_no_spare(spares, tmp_path):
    """A chapter may launch from several threads (the hangs chapter does): one launch takes
    the spare, the others start as new processes, and every one runs."""
    import threading
    lab = tmp_path / "lab.py"
    lab.write_text("print('ran')\n")
    env = launch.lab_environment({})
    ready = threading.Barrier(4)
    started = []

    def start():
        ready.wait()
        started.append(launch._start([sys.executable, str(lab)], env))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(started) == 4 and len({process.pid for process in started}) == 4
    for process in started:
        assert process.stdout.read().strip() == "ran" and process.wait(timeout=120) == 0

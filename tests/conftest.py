"""Shared test set-up: the labs folder on the path, a lab run as a plain script, and the
checks of the lab contract's one-line errors.

The book's chapters run most labs at the world sizes they show and assert their exact
results in hidden cells; `make test` builds the book after these tests. The tests here
cover what the book does not run: other world sizes (odd ones among them), bad input,
missing peers and failure paths.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent.parent / "labs"
sys.path.insert(0, str(LABS))

from labkit.runtime import launch  # noqa: E402 (needs LABS on the path)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "timed: measures time against a bound (the pipeline bubble under "
                   "controlled time) that the same run's own measurements set, so they hold "
                   "on a busy machine; `-m timed` runs them alone")


# `make test` runs the test files two at a time, handing each worker the next file in
# collection order (--no-loadscope-reorder: xdist would otherwise put the files with the
# most tests first, which here are the cheapest). The files that launch the most
# processes go first, longest first (measured: each file's seconds of its tests that are
# not `timed`, run one after another on a 2-core machine), so that the run does not end on
# one long file while the other worker idles; the rest follow in their usual order.
HEAVY_FIRST = ("test_resilience.py", "test_device_guard.py", "test_rank_server.py",
               "test_spare_python.py", "test_distenv.py", "test_precision.py", "test_slurm.py",
               "test_memory.py", "test_pipeline.py", "test_plan.py", "test_gpu_references.py",
               "test_fault_tolerance.py", "test_fork_launch.py", "test_zero_libraries.py",
               "test_hang.py", "test_sizing.py", "test_fsdp.py", "test_hybrid.py",
               "test_mini_ddp.py", "test_spare_kernel.py", "test_tensor_parallel.py",
               "test_expert_parallel.py", "test_data_order.py", "test_checkpoint.py",
               "test_trace.py", "test_context_parallel.py", "test_grad_averaging.py",
               "test_ring_allreduce.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(HEAVY_FIRST)))   # stable


# The labs start forked from a process that imported torch once (fork_launch.py), unless
# LABS_FORK_LAUNCH=0; about half of the suite's CPU time was those imports. Linux only by
# default: macOS's system libraries are not safe to fork after they have been loaded.
FORK_LAUNCH = os.environ.get("LABS_FORK_LAUNCH", "1" if sys.platform == "linux" else "0") != "0"
_launcher = None


@pytest.fixture(scope="session", autouse=True)
def fork_launch():
    global _launcher
    if not FORK_LAUNCH:
        yield None
        return
    from fork_launch import ForkLauncher

    _launcher = ForkLauncher(launch.lab_environment({}))

    def start(command, env):
        return _launcher.start(command, env, launch.REPO_DIR) or launch._popen(command, env)

    usual_start, launch.start_process = launch.start_process, start
    yield _launcher
    launch.start_process = usual_start
    _launcher = None


def run_script(lab, *args, env_extra=None, timeout=120):
    """`python labs/<lab>.py args...` as a world of one (no torchrun); returns CompletedProcess."""
    return run_python_file(LABS / f"{lab}.py", *args, env_extra=env_extra, timeout=timeout)


def run_python_file(path, *args, env_extra=None, timeout=120):
    """`python path args...`, forked like the labs where it can be, labs/ on its path."""
    env = launch.lab_environment({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(LABS),
                                  **(env_extra or {})})
    command = [sys.executable, str(path), *map(str, args)]
    forked = _launcher and _launcher.start(command, env, os.getcwd(), merge_stderr=False)
    if not forked:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    try:
        forked.wait(timeout)
    except subprocess.TimeoutExpired:
        forked.kill()
        forked.wait()
        raise
    finally:
        stdout, stderr = forked.read()
    return subprocess.CompletedProcess(command, forked.returncode, stdout, stderr)


# what every lab's JSON carries (the lab contract, distenv.DistEnv.metadata)
LAB_METADATA = ("lab", "world_size", "backend", "device", "hardware", "torch_version",
                "created", "args")


def assert_lab_metadata(result, lab):
    """The result says where it came from: the lab contract's fields, and this lab."""
    for key in LAB_METADATA:
        assert key in result, key
    assert result["lab"] == lab


def assert_fails_with_one_line(done, words):
    """The lab exited non-zero and said why in exactly one line on stderr."""
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr


def assert_refused(parse_args, argv, words):
    """The lab's parser refuses `argv` with one line containing `words`. In-process: the
    same code path as on the command line, without starting Python again (each lab's
    tests also check one refusal end to end with assert_fails_with_one_line)."""
    with pytest.raises(SystemExit) as error:
        parse_args([str(a) for a in argv])
    message = str(error.value)
    assert "\n" not in message and words in message, message


@pytest.fixture
def script():
    return run_script

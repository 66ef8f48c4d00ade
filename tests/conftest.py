"""Shared test set-up: the labs folder on the path, and a helper to run a lab as a plain script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent.parent / "labs"
sys.path.insert(0, str(LABS))


def run_script(lab, *args, env_extra=None, timeout=120):
    """`python labs/<lab>.py args...` as a world of one (no torchrun); returns CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, str(LABS / f"{lab}.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def assert_fails_with_one_line(done, words):
    """The lab exited non-zero and said why in exactly one line on stderr."""
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr


@pytest.fixture
def script():
    return run_script

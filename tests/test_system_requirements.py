"""What `TORCH=system` installs beside a GPU box's torch (scripts/system_requirements.py)."""

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import system_requirements as system  # noqa: E402


def test_the_boxs_torch_is_kept_and_torchao_installed_only_beside_its_own_torch():
    assert system.left_out("torch", "torch==2.13.0", "2.6.0+cu124")
    assert system.left_out("torchao", "torchao==0.18.0", "2.13.0+cu128") is None
    why = system.left_out("torchao", "torchao==0.18.0", "2.6.0+cu124")
    assert "torch 2.13" in why and "not run" in why
    assert system.left_out("accelerate", "accelerate==1.15.0", "2.6.0") is None


def test_torchft_only_beside_the_torch_it_asks_for():
    why = system.left_out("torchft", "torchft==0.2.0", "2.6.0+cu124")
    assert "torch >= 2.7" in why and "not run" in why
    assert system.left_out("torchft", "torchft==0.2.0", "2.7.1+cu126") is None
    assert system.left_out("torchft", "torchft==0.2.0", "2.13.0+cpu") is None


def test_it_prints_the_pins_it_keeps_and_says_what_it_leaves_out(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# a comment\ntorch==2.13.0\nnumpy==2.4.6\npytest==9.2.0\n")
    done = subprocess.run([sys.executable, str(SCRIPTS / "system_requirements.py"),
                           str(requirements)], capture_output=True, text=True, check=True)
    kept = done.stdout.split()
    assert "pytest==9.2.0" in kept and "torch==2.13.0" not in kept
    assert "numpy==2.4.6" not in kept   # this environment has a numpy: kept as it is
    assert "not installing torch==2.13.0" in done.stderr

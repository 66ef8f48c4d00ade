"""The tests' fork launcher (fork_launch.py) against what it stands in for: real torchrun and
a fresh Python, on the same small scripts."""

import json
import os
import subprocess
import sys

import pytest

from fork_launch import ForkLauncher
from labkit.runtime.launch import lab_environment

# each rank writes the variables torchrun sets, their values where they do not vary by run,
# and whether a collective over the group works
RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
varying = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
           "TORCHELASTIC_SIGNALS_TO_HANDLE")
base = json.load(open(sys.argv[1]))
env = {k: ("*" if k in varying else v) for k, v in os.environ.items() if base.get(k) != v}
with open(f"{sys.argv[2]}.{dist.get_rank()}", "w") as out:
    json.dump({"env": env, "sum": total.item(), "argv": sys.argv[1:]}, out)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def launcher(fork_launch):
    return fork_launch or ForkLauncher(lab_environment({}))


def _torchrun(script, nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(script), *map(str, args)]


def test_ranks_see_what_torchrun_gives_them_and_meet(launcher, tmp_path):
    script = tmp_path / "ranks_env.py"
    script.write_text(RANK_SCRIPT)
    env = lab_environment({})
    base = tmp_path / "base.json"
    base.write_text(json.dumps(env))
    real = subprocess.run(_torchrun(script, 3, base, tmp_path / "real"), env=env,
                          capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr
    forked = launcher.start(_torchrun(script, 3, base, tmp_path / "forked"), env, tmp_path)
    assert forked is not None and forked.wait(120) == 0, forked.read()
    for rank in range(3):
        seen = {kind: json.loads((tmp_path / f"{kind}.{rank}").read_text())
                for kind in ("real", "forked")}
        assert seen["forked"]["sum"] == seen["real"]["sum"] == 6.0
        # every variable torchrun sets, with its value (TORCHELASTIC_ERROR_FILE and the
        # signal list are the agent's own and not emulated: the labs do not read them)
        real_env = {k: v for k, v in seen["real"]["env"].items()
                    if k not in ("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE")}
        assert seen["forked"]["env"] == real_env
    forked.read()


def test_a_failing_rank_ends_the_others_and_the_launch_exits_1(launcher, tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit('rank 1 gave up')\n"
                      "time.sleep(60)\n")
    forked = launcher.start(_torchrun(script, 3), lab_environment({}), tmp_path)
    assert forked.wait(30) == 1   # not the 60 s the others would sleep
    output, _ = forked.read()
    assert "rank 1 gave up" in output and "rank 1 failed (exitcode: 1)" in output


def test_a_script_exits_as_python_would(launcher, tmp_path):
    cases = {"sys.exit('bad input')": (1, "bad input\n"),
             "sys.exit(3)": (3, ""),
             "print('fine')": (0, ""),
             "raise ValueError('broken')": (1, "ValueError: broken")}
    for body, (status, words) in cases.items():
        script = tmp_path / "exits.py"
        script.write_text(f"import sys\n{body}\n")
        command = [sys.executable, str(script)]
        real = subprocess.run(command, capture_output=True, text=True, timeout=60)
        forked = launcher.start(command, dict(os.environ, **lab_environment({})), tmp_path,
                                merge_stderr=False)
        assert forked.wait(60) == real.returncode == status, body
        stdout, stderr = forked.read()
        assert stdout == real.stdout
        assert words in stderr and words in real.stderr, (body, stderr)


def test_what_it_cannot_emulate_is_left_to_a_real_process(launcher, tmp_path):
    script = str(tmp_path / "any.py")
    env = lab_environment({})
    two_agents = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                  "--nproc_per_node=1", script]
    restarts = _torchrun(script, 2)
    restarts.insert(3, "--max-restarts=1")
    for command in (two_agents, restarts, ["bash", "run.sh"]):
        assert launcher.start(command, env, tmp_path) is None, command
    # a variable torch reads when it is imported, set otherwise than the server had it
    assert launcher.start(_torchrun(script, 2), dict(env, OMP_NUM_THREADS="2"), tmp_path) is None

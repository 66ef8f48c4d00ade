"""The SLURM batch scripts (scripts/slurm/), run here on one machine with stand-in `srun`
and `scontrol` commands: this test does NOT talk to SLURM. The stand-in `scontrol show
hostnames` names this machine once per "node", and the stand-in `srun` starts the tasks a
real one would (one per node, or one per GPU), with the SLURM_* variables a real one sets,
all on this machine. What is checked is what the scripts themselves do: the rendezvous on
the first host, the ranks, and the environment each variant must set up."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from labkit.launch import free_port

REPO = Path(__file__).resolve().parents[1]

SRUN = textwrap.dedent('''\
    #!{python}
    # stand-in srun: --nodes N --ntasks-per-node T, then a command; N x T local tasks
    import os, subprocess, sys
    args, options = sys.argv[1:], {{}}
    while args and args[0].startswith("--"):
        key, _, value = args.pop(0)[2:].partition("=")
        options[key] = value
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    tasks = []
    for task in range(nodes * per_node):
        env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task % per_node),
                   SLURM_NODEID=str(task // per_node), SLURM_NTASKS=str(nodes * per_node),
                   SLURM_NTASKS_PER_NODE=str(per_node))
        tasks.append(subprocess.Popen(args, env=env))
    codes = [t.wait() for t in tasks]
    sys.exit(next((c for c in codes if c), 0))
''')
SCONTROL = textwrap.dedent('''\
    #!/bin/sh
    # stand-in scontrol: "show hostnames LIST" names this machine once per node. It
    # writes the lines a moment apart, as a real one on a busy controller may: a script
    # that reads only the first line and closes the pipe (`| head -n 1` under
    # `set -o pipefail`) then dies of SIGPIPE every time instead of now and then.
    [ "$1 $2" = "show hostnames" ] || exit 2
    for i in $(seq "$SLURM_NNODES"); do echo 127.0.0.1; sleep 0.2; done
''')


@pytest.fixture
def slurm_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2", SLURM_JOB_ID="4242",
                SLURM_GPUS_ON_NODE="1", SLURM_NTASKS_PER_NODE="1", SLURM_SUBMIT_DIR=str(REPO),
                MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("script", ["torchrun.sbatch", "srun.sbatch"])
def test_a_batch_script_runs_two_nodes(script, slurm_env, tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / script), "ranks",
                           "--out", str(out)], env=slurm_env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    # one GPU (rank) per "node" keeps it quick: what is checked is the two-node wiring,
    # and the ranks lab has checked that the layout fits (RANK from GROUP_RANK, LOCAL_RANK)
    assert (result["world_size"], result["local_world_size"], result["num_nodes"]) == (2, 1, 2)
    assert [(r["rank"], r["group_rank"], r["local_rank"]) for r in result["ranks"]] == [
        (0, 0, 0), (1, 1, 0)]
    # the store is on the first host scontrol named (torchrun: the node that got rank 0)
    assert {r["master_addr"] for r in result["ranks"]} <= {"127.0.0.1", socket.getfqdn(),
                                                           socket.gethostname()}


def test_a_script_without_a_lab_says_how_to_use_it(slurm_env):
    done = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "srun.sbatch")],
                          env=slurm_env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "usage: sbatch srun.sbatch LAB" in done.stderr


@pytest.mark.parametrize("script", ["torchrun.sbatch", "srun.sbatch"])
def test_a_failing_scontrol_stops_the_script_before_srun(script, slurm_env, tmp_path):
    # without a first host there is nowhere to rendezvous: the script must stop there,
    # with scontrol's own error, rather than start ranks that would wait for a timeout
    bin_dir = Path(slurm_env["PATH"].split(":")[0])
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'scontrol: error: no such job' >&2\n"
                                      "exit 1\n")
    (bin_dir / "srun").write_text("#!/bin/sh\necho srun ran\n")
    done = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / script), "ranks"],
                          env=slurm_env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "no such job" in done.stderr and "srun ran" not in done.stdout

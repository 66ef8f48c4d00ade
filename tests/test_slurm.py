"""The SLURM batch scripts (scripts/slurm/), run here on one machine with stand-in `srun`
and `scontrol` commands: this test does NOT talk to SLURM. The stand-in `scontrol show
hostnames` names this machine once per "node", and the stand-in `srun` starts the tasks a
real one would (one per node, or one per GPU), with the SLURM_* variables a real one sets,
all on this machine. What is checked is what the scripts themselves do: the rendezvous on
the first host, the ranks, and the environment each variant must set up."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from labkit.runtime.launch import free_port

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
    # stand-in scontrol: "show hostnames LIST" names this machine once per node. A real
    # one expands the list itself (no controller involved) and writes its names through
    # the C library's buffer, a few kilobytes at a time: a script that keeps the first
    # line with `| head -n 1` under `set -o pipefail` dies of SIGPIPE only when scontrol
    # still writes after head has exited, that is with a list longer than one buffer
    # (hundreds of nodes). This one writes each name on its own, a moment apart, so that
    # such a script dies every time, with two nodes.
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


def launched_port(script, slurm_env, job_id):
    """The port a script would give the rendezvous (torchrun.sbatch) or rank 0's store
    (srun.sbatch) for SLURM job `job_id`, read from a stand-in srun that only reports
    what it was given: nothing listens, nothing is bound."""
    bin_dir = Path(slurm_env["PATH"].split(":")[0])
    (bin_dir / "srun").write_text('#!/bin/sh\necho "MASTER_PORT=$MASTER_PORT $*"\n')
    env = {k: v for k, v in slurm_env.items() if k != "MASTER_PORT"}
    env.update(SLURM_JOB_ID=str(job_id), SLURM_NNODES="1", SLURM_JOB_NODELIST="node1")
    done = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / script), "ranks"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    pattern = r"--rdzv-endpoint=\S+:(\d+)" if script == "torchrun.sbatch" else r"MASTER_PORT=(\d+)"
    return int(re.search(pattern, done.stdout).group(1))


def test_each_job_gets_its_own_port_below_the_ephemeral_range(slurm_env):
    # ids 1, 1000 and 10000 apart, and a large one: jobs 1000 apart must not collide (as
    # 29500 + id % 1000 would make them); every port stays in 20000-32767, below Linux's
    # default ephemeral range (32768-60999), and both scripts agree
    ids = [4242, 4243, 5242, 14242, 98_765_432]
    ports = {script: [launched_port(script, slurm_env, i) for i in ids]
             for script in ("torchrun.sbatch", "srun.sbatch")}
    assert ports["torchrun.sbatch"] == ports["srun.sbatch"]
    assert len(set(ports["srun.sbatch"])) == len(ids)
    assert all(20000 <= port < 32768 for port in ports["srun.sbatch"])
    assert ports["srun.sbatch"][0] == 20000 + 4242 % 12768


def test_master_port_overrides_the_derived_port(slurm_env):
    bin_dir = Path(slurm_env["PATH"].split(":")[0])
    (bin_dir / "srun").write_text('#!/bin/sh\necho "MASTER_PORT=$MASTER_PORT $*"\n')
    for script, pattern in (("torchrun.sbatch", r"--rdzv-endpoint=\S+:(\d+)"),
                            ("srun.sbatch", r"MASTER_PORT=(\d+)")):
        done = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / script), "ranks"],
                              env=dict(slurm_env, SLURM_NNODES="1", SLURM_JOB_NODELIST="node1"),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.search(pattern, done.stdout).group(1) == slurm_env["MASTER_PORT"]

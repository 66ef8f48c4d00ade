"""The resilience lab: a rank killed mid-run, the group restarted by torchrun, the run resumed
from its last DCP checkpoint. The chapter runs the kill, the restart and the resume on three
ranks and asserts that the final parameters equal an uninterrupted run's bit for bit
(at_scale.md, hidden cells); here a world of one, bad input, and two torchrun agents as two
nodes, where one node's failure restarts the other's ranks without counting there."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import resilience
from conftest import LABS, assert_fails_with_one_line, assert_refused
from labkit.runtime import launch, rank_server
from labkit.runtime.spare_python import SparePython


def test_bad_input_is_refused_in_one_line(script, tmp_path):
    assert_refused(resilience.parse_args, ["--dir", tmp_path, "--fail-at-step", 8],
                   "--fail-at-step 8 is past the last step (7)")
    assert_refused(resilience.parse_args, ["--dir", tmp_path, "--every", 0],
                   "--every must be at least 1")
    assert_fails_with_one_line(script("resilience", "--dir", tmp_path, "--fail-rank", 3),
                               "--fail-rank 3 is not a rank of a world of 1")


def test_a_run_that_never_saves_still_reports(script, tmp_path):
    """--every past the last step: no checkpoint, nothing resumed, a world of one."""
    out = tmp_path / "result.json"
    done = script("resilience", "--dir", tmp_path / "ckpt", "--every", 8, "--out", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["checkpoints"] == [] and result["resumed_from_step"] == 0
    assert result["max_param_diff_vs_uninterrupted"] == 0.0
    assert result["max_param_diff_resumed_without_rng_state"] is None
    assert result["max_param_diff_resumed_with_ddp_buckets"] == 0.0   # one rank: no sums


def start_two_nodes(folder, env_extra, server):
    """Two torchrun agents on this machine as two nodes of one rank each, meeting through a
    c10d rendezvous, with one restart each (a per-node budget). Rank 1, on the second node,
    crashes at step 3 while rank 0 sleeps outside any collective: the first node's agent
    then stops its worker for the new round (a membership change, counted as no restart
    there), the second node's agent restarts its crashed one (counted). Each agent is
    torchrun's own, and starts its ranks as the chapters' launches do: the group's first
    start forked from `server` (a rank server, labkit.runtime.rank_server; None: new
    Pythons), the restarted group as new Pythons. Returns the two agents, started, and
    where rank 0 writes its JSON."""
    port, out = launch.free_port(), folder / "result.json"
    env = launch.lab_environment(env_extra)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
               str(LABS / "resilience.py"), "--dir", str(folder / "ckpt"), "--steps", "6",
               "--every", "2", "--fail-at-step", "3", "--fail-rank", "1",
               "--survivors-busy-s", "5", "--timeout", "60", "--out", str(out)]
    if server is None:
        agents = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        return agents, out
    call = (LABS, "labkit.runtime.rank_server", "fork_ranks_in_torchrun", server.address)
    agents = [SparePython(env, folder, call=call).run(command, env, folder) for _ in range(2)]
    for agent in agents:
        assert agent is not None
        agent.stdin = None   # the spare closed it once it read the launch: nothing to write
    return agents, out


STORES = {"agent-store": "0", "own-store": "1"}   # TORCH_DISABLE_SHARE_RDZV_TCP_STORE


@pytest.fixture(scope="module")
def two_node_jobs(tmp_path_factory):
    """Both jobs at once, one per store setting, on ports of their own: most of each is
    waiting (rank 0's busy sleep, the rendezvous of the new round), so side by side they
    take little longer than one. Their first starts fork from one rank server (four ranks
    that import torch, its compiler and distributed checkpointing once, not four times).
    {store: ([(exit status, output) per agent], JSON path)}"""
    server = (rank_server.RankServer(launch.lab_environment({}), launch.REPO_DIR)
              if rank_server.available() else None)
    started = {}
    try:
        for store, disable in STORES.items():
            folder = tmp_path_factory.mktemp(store)
            started[store] = start_two_nodes(
                folder, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": disable}, server)
        with ThreadPoolExecutor() as pool:   # every agent's output read as it comes
            outputs = {store: [pool.submit(agent.communicate, timeout=240) for agent in agents]
                       for store, (agents, _) in started.items()}
            texts = {store: [reading.result()[0] for reading in readings]
                     for store, readings in outputs.items()}
    finally:
        if server is not None:
            server.end()
    return {store: ([(agent.returncode, text) for agent, text in zip(agents, texts[store])], out)
            for store, (agents, out) in started.items()}


@pytest.mark.parametrize("store", list(STORES))
def test_two_nodes_restart_as_one_group_when_one_node_fails(two_node_jobs, store):
    """torch's default (the agents' store shared with the workers, kept across restarts)
    and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store for each start). The new group
    forms at once, with no second failure, and resumes bit-identically; restart_count is the
    job's, though the two agents count 0 and 1."""
    agents, out = two_node_jobs[store]
    for status, text in agents:
        assert status == 0, text
    logs = "".join(text for _, text in agents)
    assert logs.count("failed (exitcode") == 1, logs      # the crash, and nothing else
    assert "Connection refused" not in logs and "connectFullMesh" not in logs, logs
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["restart_count"] == 1
    assert result["resumed_from_step"] == 2 and result["lost_steps"] == 1
    assert result["max_param_diff_vs_uninterrupted"] == 0.0

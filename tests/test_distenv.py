"""The lab contract (labkit.runtime.distenv) and the launcher: backend choice, parser types, seeds,
timeouts, one-line errors."""

import ast
import time
import uuid
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import ranks
from conftest import assert_fails_with_one_line
from labkit.runtime import distenv, launch
from labkit.runtime.launch import LABS_DIR as LABS
from labkit.runtime.launch import LabError, free_port, reader_command, run_lab


@pytest.mark.parametrize("requested, local_ranks, gpus, backend", [
    ("auto", 4, 0, "gloo"),    # no GPU: gloo on CPU
    ("auto", 4, 2, "gloo"),    # fewer GPUs than ranks: NCCL would refuse two ranks per GPU
    ("auto", 4, 4, "nccl"),
    ("auto", 4, 8, "nccl"),
    ("gloo", 1, 8, "gloo"),
    ("nccl", 2, 2, "nccl"),
])
def test_choose_backend(requested, local_ranks, gpus, backend):
    chosen, reason = distenv.choose_backend(requested, local_ranks, gpus)
    assert chosen == backend
    # auto must say why it fell back to gloo when it did
    assert (reason is not None) == (requested == "auto" and backend == "gloo")


def test_ranks_are_counted_per_host_across_agents():
    """Two agents on host a (3 ranks in all) and one on host b (2 ranks): each rank learns
    how many ranks share its GPUs, and gets a slot of its own among them."""
    import threading
    store = torch.distributed.HashStore()
    hosts = ["a:*", "a:*", "b:*", "a:*", "b:*"]
    found = {}

    def rank(r):
        found[r] = distenv.count_ranks_on_host(store, len(hosts), hosts[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [found[r][0] for r in range(len(hosts))] == [3, 3, 2, 3, 2]
    assert sorted(found[r][1] for r in (0, 1, 3)) == [0, 1, 2]
    assert sorted(found[r][1] for r in (2, 4)) == [0, 1]
    # two agents of one rank each on a 1-GPU host: LOCAL_RANK 0 twice, NCCL would refuse
    assert distenv.choose_backend("auto", 2, 1)[0] == "gloo"
    # on an 8-GPU host they take a GPU each, by slot; an agent alone keeps LOCAL_RANK
    assert distenv.choose_backend("auto", 2, 8)[0] == "nccl"
    assert [distenv.gpu_index(0, 1, 2, slot) for slot in (0, 1)] == [0, 1]
    assert distenv.gpu_index(3, 8, 8, 5) == 3


def test_a_group_that_saves_asynchronously_gets_gloo_beside_nccl():
    assert distenv.process_group_backend("nccl", cpu_group=True) == "cpu:gloo,cuda:nccl"
    assert distenv.process_group_backend("nccl") == "nccl"
    assert distenv.process_group_backend("gloo", cpu_group=True) == "gloo"


def test_fp32_matmuls_are_ieee_in_a_labs_process(script, tmp_path, monkeypatch):
    """An NGC container's TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 would make them TF32 (torch
    reads it at import): the launcher hands the ranks 0, and the lab turns TF32 off."""
    out = tmp_path / "ranks.json"
    done = script("ranks", "--out", out, env_extra={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["float32_matmul_precision"] == "highest"
    assert result["cuda_matmul_allow_tf32"] is False and result["cudnn_allow_tf32"] is False
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    assert launch.lab_environment({})["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] == "0"


@pytest.mark.parametrize("local_ranks, gpus", [(1, 0), (4, 2)])
def test_nccl_without_enough_gpus_is_a_clear_error(local_ranks, gpus):
    with pytest.raises(SystemExit) as error:
        distenv.choose_backend("nccl", local_ranks, gpus)
    message = str(error.value)
    assert "--backend nccl" in message and "\n" not in message


def test_reader_command_is_what_a_reader_types():
    assert reader_command("grad_averaging", 4, ["--steps", 5]) == \
        "torchrun --standalone --nproc_per_node=4 labs/grad_averaging.py --steps 5"


def test_the_two_node_command_is_what_each_node_types():
    """The chapter on running at scale launches two torchrun agents on this machine
    (run_lab(..., nnodes=2)), which meet through a c10d rendezvous on a free port as two
    nodes, and asserts the ranks' layout; this is the line it shows for each node."""
    assert reader_command("ddp", 8, nnodes=2).startswith(
        "torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT")


def test_a_layout_that_does_not_fit_is_named():
    def rank(r, node, local, agent):
        return {"rank": r, "group_rank": node, "local_rank": local, "local_world_size": 2,
                "agent_pid": agent}
    good = [rank(0, 0, 0, 10), rank(1, 0, 1, 10), rank(2, 1, 0, 11), rank(3, 1, 1, 11)]
    assert ranks.layout_problems(good) == []
    swapped = [rank(0, 0, 0, 10), rank(1, 1, 1, 10), rank(2, 1, 0, 11), rank(3, 0, 1, 11)]
    assert any("rank 1 is not node 1's first rank" in p for p in ranks.layout_problems(swapped))
    twice = good[:3] + [rank(2, 1, 1, 11)]
    assert "once each" in ranks.layout_problems(twice)[0]
    two_agents = good[:3] + [rank(3, 1, 1, 12)]
    assert ranks.layout_problems(two_agents) == ["a node's ranks were not started by one agent"]


def test_env_reaches_the_lab_and_the_readers_command():
    result = run_lab("ranks", None, env={"GROUP_RANK": 3}, echo=False)   # a world of one
    assert result["world_size"] == 1 and result["ranks"][0]["group_rank"] == 3
    assert reader_command("hang", 2, ["--mode", "sleep"],
                          env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).startswith(
        "TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2")


def test_launcher_raises_with_the_labs_own_error():
    # --rank 5 is not a rank of a world of 2: every rank exits, rank 0 alone says why
    with pytest.raises(LabError) as error:
        run_lab("hang", 2, ["--rank", 5], echo=False)
    assert error.value.returncode != 0
    line = "hang: error: --rank 5 is not a rank of a world of 2"
    assert error.value.output.count(line) == 1, error.value.output
    # the line heads the message, above torchrun's report and its ChildFailedError
    heading = str(error.value).split("Its output")[0]
    assert line in heading and "ChildFailedError" not in heading


def test_a_launch_past_its_timeout_ends_with_its_ranks(monkeypatch):
    """torchrun starts each rank in a session of its own: the launcher's timeout must end
    them too, not only the agent's group (else it waits on their output until their own
    timeouts). Real processes: the suite's forked ranks share their agent's session."""
    monkeypatch.setattr(launch, "start_process", launch._popen)
    mark = f"launch-timeout-{uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(LabError, match="killed after 6 s"):   # a rank sleeps outside any
        run_lab("hang", 2, ["--mode", "sleep", "--timeout", 120],   # collective, its peer
                env={"LABS_TEST_MARK": mark}, timeout=6, echo=False)   # waits in one
    assert time.monotonic() - start < 30
    assert not processes_with(f"LABS_TEST_MARK={mark}")


def processes_with(variable):
    """The pids of this user's live processes whose environment holds `variable`."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            pass
    return found


def test_launcher_rejects_an_unknown_lab():
    with pytest.raises(FileNotFoundError):
        run_lab("no_such_lab", 1, echo=False)


def test_out_is_written_atomically_by_a_world_of_one(script, tmp_path):
    out = tmp_path / "sub" / "result.json"
    done = script("ranks", "--out", out)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["world_size"] == 1
    assert [p.name for p in out.parent.iterdir()] == ["result.json"]  # no temp file left


def test_a_missing_peer_times_out_with_one_line(script):
    # Rank 0 of a world of 2 whose rank 1 never comes: it must fail after --timeout. Every
    # lab forms its group through distenv.initialize, so one lab stands for all of them.
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = script("grad_averaging", "--timeout", 2, env_extra=env, timeout=60)
    assert_fails_with_one_line(done, "did not form within --timeout 2 s")


def test_the_labs_error_survives_a_long_torchrun_report():
    """At large N torchrun's per-rank failure report fills the tail; the lab's own error
    still heads the message."""
    lines = ["fsdp: error: --steps must be at least 1, got 0\n"] * 8
    lines += ["  rank      : 3 (local_rank: 3)\n"] * 200
    lines += ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"]
    message = launch._failure_message("fsdp", 8, 1, lines)
    heading = message.split("Its output")[0]
    assert heading.count("fsdp: error: --steps must be at least 1") == 1
    assert "ChildFailedError" not in heading


def test_the_launcher_gives_up_before_the_books_cell_does():
    """A stuck lab must fail its cell with the launcher's message, which names the lab and
    shows its output, not with the kernel's bare timeout: the launcher's limit sits below
    the cell timeout in _config.yml, and above the labs' own collective timeout."""
    config = yaml.safe_load((Path(launch.REPO_DIR) / "_config.yml").read_text())
    cell_timeout = config["execute"]["timeout"]
    assert distenv.DEFAULT_TIMEOUT_S < launch.LAUNCH_TIMEOUT_S < cell_timeout


def test_positive_int_names_the_option_in_its_one_line_error():
    parser = distenv.lab_parser("A lab.\n\nLaunch lines: ...")
    parser.add_argument("--steps", type=distenv.positive_int, default=1)
    parser.add_argument("--sizes", type=distenv.int_list(2), default=[2])
    parser.add_argument("--kinds", type=distenv.choice_list(("a", "b")), default=["a"])
    assert parser.parse_args(["--steps", "3", "--sizes", "2,5", "--kinds", "all"]).kinds == ["a", "b"]
    for argv, words in ((["--steps", "0"], "--steps must be at least 1, got 0"),
                        (["--steps", "x"], "--steps must be a whole number"),
                        (["--sizes", "2,1"], "--sizes must be at least 2, got 1"),
                        (["--kinds", "a,c"], "invalid choice: 'c'")):
        with pytest.raises(SystemExit) as error:
            parser.parse_args(argv)
        assert words in str(error.value) and "\n" not in str(error.value)
    assert "Launch lines" in parser.format_help()    # the docstring's rest, after the options


def test_one_rule_derives_every_seed():
    assert distenv.derived_seed(0, "batch", 3, 1) == distenv.derived_seed(0, "batch", 3, 1)
    seeds = {distenv.derived_seed(seed, "batch", step, rank)
             for seed in range(3) for step in range(50) for rank in range(50)}
    assert len(seeds) == 3 * 50 * 50                 # no two (seed, step, rank) share one
    # seed + rank would give (step 1, rank 0) and (step 0, rank 1) the same stream
    assert distenv.derived_seed(0, 1, 0) != distenv.derived_seed(0, 0, 1)
    assert all(0 <= s < 2 ** 63 for s in seeds)
    a, b = distenv.generator(7, "x"), distenv.generator(7, "x")
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))


def test_each_labs_continued_launch_line_keeps_its_backslash():
    """A launch line split over two lines ends in a backslash, which the docstring (the
    lab's --help) must keep: written once, Python joins the two lines into one."""
    for path in sorted(LABS.glob("*.py")):
        module = ast.parse(path.read_text())
        end = module.body[0].end_lineno if ast.get_docstring(module) else 0
        for number, line in enumerate(path.read_text().splitlines()[:end], 1):
            assert not re.search(r"(?<!\\)\\$", line), f"{path.name}:{number}"

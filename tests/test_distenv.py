"""The shared process-group module: backend choice, metadata, timeouts, the launcher."""

import json
import socket

import pytest

import distenv
from conftest import assert_fails_with_one_line
import launch
from launch import LabError, reader_command, run_lab


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


@pytest.mark.parametrize("local_ranks, gpus", [(1, 0), (4, 2)])
def test_nccl_without_enough_gpus_is_a_clear_error(local_ranks, gpus):
    with pytest.raises(SystemExit) as error:
        distenv.choose_backend("nccl", local_ranks, gpus)
    message = str(error.value)
    assert "--backend nccl" in message and "\n" not in message


def test_reader_command_is_what_a_reader_types():
    assert reader_command("grad_averaging", 4, ["--steps", 5]) == \
        "torchrun --standalone --nproc_per_node=4 labs/grad_averaging.py --steps 5"


def test_launcher_returns_json_with_metadata():
    result = run_lab("grad_averaging", 2, ["--steps", 2], echo=False)
    for field in ("lab", "world_size", "backend", "device", "hardware", "torch_version",
                  "created", "args"):
        assert field in result, field
    assert result["lab"] == "grad_averaging"
    assert result["world_size"] == 2
    assert result["backend"] == "gloo" and result["device"] == "cpu"
    assert result["args"]["steps"] == 2


def test_launcher_raises_with_the_labs_own_error():
    # --samples 5 cannot hold one global batch at N = 3: every rank exits with that line
    with pytest.raises(LabError) as error:
        run_lab("grad_averaging", 3, ["--samples", 5], echo=False)
    assert error.value.returncode != 0
    assert "--samples 5 is smaller than one global batch" in str(error.value)


def test_launcher_rejects_an_unknown_lab():
    with pytest.raises(FileNotFoundError):
        run_lab("no_such_lab", 1, echo=False)


def test_out_is_written_atomically_by_a_world_of_one(script, tmp_path):
    out = tmp_path / "sub" / "result.json"
    done = script("grad_averaging", "--steps", 1, "--out", out)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["world_size"] == 1
    assert [p.name for p in out.parent.iterdir()] == ["result.json"]  # no temp file left


def free_port():
    # Ask the OS for a port nobody uses (never a fixed one).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_peer_times_out_with_one_line(script):
    # Rank 0 of a world of 2 whose rank 1 never comes: it must fail after --timeout.
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = script("grad_averaging", "--timeout", 3, env_extra=env, timeout=60)
    assert_fails_with_one_line(done, "did not form within --timeout 3 s")


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

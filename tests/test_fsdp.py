"""The FSDP lab: scratch ZeRO-3 and FSDP2 against DDP at N = 1 to 4, the collectives they
issue against 2 psi and 3 psi, and the memory timeline and state against the schedule."""

import pytest

import memory_model
from conftest import assert_fails_with_one_line
from launch import run_lab


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_scratch_and_fully_shard_match_ddp_and_the_predictions(nproc):
    result = run_lab("fsdp", nproc, ["--steps", 3], echo=False)
    n, psi, padded = nproc, result["param_count"], result["padded_param_count"]
    assert result["world_size"] == n
    assert max(result["max_param_diff"].values()) <= 1e-5
    assert set(result["max_param_diff"]) == {"scratch_vs_ddp", "fully_shard_vs_ddp"}

    # padding: every unit rounded up to a multiple of N, by less than N
    for numel, rounded in zip(result["unit_param_counts"], result["unit_padded_counts"]):
        assert rounded % n == 0 and 0 <= rounded - numel < n
    assert sum(result["unit_param_counts"]) == psi and sum(result["unit_padded_counts"]) == padded
    assert (padded > psi) == (n in (3, 4))   # the model is shaped so that N = 3, 4 pad

    # bytes sent per rank per step: DDP 2(N-1)/N x 4 psi, ZeRO-3 3(N-1)/N x 4 psi'
    sent = result["comm_bytes_per_rank"]
    assert sent == result["predicted_comm_bytes_per_rank"]
    assert sent["ddp"] == round(2 * (n - 1) * 4 * psi / n)
    assert sent["zero3"] == round(3 * (n - 1) * 4 * padded / n)

    for name in ("ddp", "zero3"):
        timeline = result["memory_timeline"][name]
        assert timeline["events"] == timeline["predicted_events"]
        assert timeline["peak_bytes"] == timeline["predicted_peak_bytes"]
        units = len(result["unit_param_counts"])
        assert len(timeline["events"]) == 4 * units   # start and end, forward and backward
    # DDP holds 4 psi of parameters and 4 psi of gradients all along; ZeRO-3 its shards
    # plus the largest unit twice (gathered parameters and its flat gradient, backward)
    assert result["memory_timeline"]["ddp"]["peak_bytes"] == 8 * psi
    largest = max(result["unit_padded_counts"])
    assert result["memory_timeline"]["zero3"]["peak_bytes"] == 8 * padded // n + 8 * largest

    state = result["state_bytes_per_rank"]
    assert state == result["predicted_state_bytes_per_rank"]
    assert state["ddp"] == memory_model.state_bytes_per_gpu(psi, 1, "ddp", "momentum", "fp32")
    assert state["zero3"]["total"] == 12 * padded // n


def test_the_sawtooth_goes_up_and_down():
    """ZeRO-3's live parameters rise at each unit's start and fall back at its end."""
    events = run_lab("fsdp", 2, ["--steps", 1], echo=False)["memory_timeline"]["zero3"]["events"]
    params = [e["param_bytes"] for e in events]
    assert all(start > end for start, end in zip(params[0::2], params[1::2]))
    assert len(set(params[1::2])) == 1   # every unit freed: back to the shards alone


def test_bad_steps_is_one_line(script):
    assert_fails_with_one_line(script("fsdp", "--steps", 0), "--steps must be at least 1")

"""The scaling lab: its JSON at world sizes 1 and 2 for DDP and FSDP, strong and weak,
and its model's prediction rebuilt from the parts it reports."""

import pytest

import comm_model
import memory_model
import time_model
from conftest import assert_fails_with_one_line
from launch import LabError, run_lab
from transformer import Transformer
import scaling

FAST = ["--steps", 3, "--warmup", 1]
FIELDS = ("step_time_s", "step_time_spread_s", "samples_per_s", "compute_time_s",
          "comm_time_s", "predicted_step_time_s")


def rebuilt_prediction(result):
    """predicted_step_time_s from the parts the JSON reports: the model, recomputed."""
    n, plan = result["world_size"], result["collectives"]
    if n == 1:
        comm = [0.0] * len(plan)
    else:
        a, b = result["alpha_s"], result["beta_bytes_per_s"]
        comm = [comm_model.allreduce_time(c["bytes"], n, a, b) if c["op"] == "all_reduce"
                else time_model.shard_collective_time(c["bytes"], n, a, b) for c in plan]
    return time_model.step_time(result["forward_time_s"], result["backward_time_s"],
                                [c["bytes"] for c in plan], comm, result["model_overlap"],
                                result["optimizer_time_s"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("nproc, scaling_kind, batch_per_rank", [
    (1, "strong", 4), (2, "strong", 2), (2, "weak", 4)])
def test_json_fields(strategy, nproc, scaling_kind, batch_per_rank):
    result = run_lab("scaling", nproc, ["--strategy", strategy, "--scaling", scaling_kind,
                                        "--batch", 4, *FAST], echo=False)
    assert all(isinstance(result[f], float) and result[f] >= 0 for f in FIELDS)
    assert result["step_time_s"] > 0 and result["compute_time_s"] > 0
    assert result["batch_per_rank"] == batch_per_rank
    assert result["global_batch"] == batch_per_rank * nproc
    assert result["samples_per_s"] == pytest.approx(result["global_batch"] / result["step_time_s"])
    parts = result["forward_time_s"] + result["backward_time_s"] + result["optimizer_time_s"]
    assert result["compute_time_s"] == pytest.approx(parts)
    assert result["predicted_step_time_s"] == pytest.approx(rebuilt_prediction(result))
    low, high = result["step_time_quartiles_s"]
    assert low <= result["step_time_s"] <= high
    assert result["step_time_spread_s"] == pytest.approx(high - low)
    if nproc == 1:
        assert result["comm_time_s"] == 0 and result["alpha_s"] is None
        assert result["predicted_step_time_s"] == pytest.approx(result["compute_time_s"])
    else:
        assert result["comm_time_s"] > 0 and result["beta_bytes_per_s"] > 0
        assert result["predicted_step_time_s"] > result["compute_time_s"]


def test_collectives_are_the_steps_own():
    model = Transformer(scaling.SHAPE)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    ddp = scaling.collectives(model, "ddp", 3)
    assert {op for op, _ in ddp} == {"all_reduce"} and sum(b for _, b in ddp) == grad_bytes
    assert ddp[0][1] >= 1 << 20 and len(ddp) == 2  # DDP's 1 MiB first bucket, then the rest
    fsdp = scaling.collectives(model, "fsdp", 3)
    units = len(model.units())
    assert [op for op, _ in fsdp].count("all_gather") == 2 * units
    assert [op for op, _ in fsdp].count("reduce_scatter") == units
    padded = 3 * 4 * sum(memory_model.fsdp2_shard_numel(tuple(p.shape), 3, 0)
                         for p in model.parameters())
    assert sum(b for op, b in fsdp if op == "reduce_scatter") == padded >= grad_bytes


def test_strong_scaling_needs_a_batch_that_divides():
    with pytest.raises(LabError, match="must be a multiple of the world size"):
        run_lab("scaling", 2, ["--batch", 3, *FAST], echo=False)


@pytest.mark.parametrize("args, words", [
    (["--strategy", "zero"], "invalid choice: 'zero'"),
    (["--scaling", "linear"], "invalid choice: 'linear'"),
    (["--batch", 0], "--batch must be at least 1"),
])
def test_bad_input_fails_with_one_line(script, args, words):
    assert_fails_with_one_line(script("scaling", *args), words)

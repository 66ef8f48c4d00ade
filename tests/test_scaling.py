"""The scaling lab: the step measured and taken apart, and its model's prediction rebuilt
from the parts it reports, for DDP and FSDP, strong and weak. The chapter runs N = 1, 2 and
3 and checks part of this on each; here the whole of it on one rank, the collectives of a
step, and bad input."""

import types

import pytest
import torch

import scaling
from conftest import assert_fails_with_one_line, assert_refused
from labkit.predict import comm_model, memory_model, time_model
from labkit.runtime.launch import run_lab
from labkit.model.transformer import Transformer

FAST = ["--steps", 3, "--warmup", 1]
FIELDS = ("step_time_s", "step_time_spread_s", "samples_per_s", "compute_time_s",
          "plain_step_time_s", "comm_time_s", "predicted_step_time_s")


def rebuilt_prediction(run, result):
    """predicted_step_time_s from the parts the JSON reports: the model, recomputed."""
    n, plan = result["world_size"], run["collectives"]
    if n == 1:
        comm = [0.0] * len(plan)
    else:
        a, b = result["alpha_s"], result["beta_bytes_per_s"]
        # gloo carries a reduce-scatter out as an all-reduce (scaling.predicted_comm)
        as_all_reduce = ("all_reduce", "reduce_scatter") if result["backend"] == "gloo" \
            else ("all_reduce",)
        comm = [comm_model.allreduce_time(c["bytes"], n, a, b) if c["op"] in as_all_reduce
                else time_model.shard_collective_time(c["bytes"], n, a, b) for c in plan]
    return time_model.step_time(run["forward_time_s"], run["backward_time_s"],
                                [c["bytes"] for c in plan], comm, run["model_overlap"],
                                run["optimizer_time_s"])


def check_invariants(result):
    """What every run of the lab must report, whatever the machine's speed."""
    n = result["world_size"]
    for run in result["runs"]:
        assert all(isinstance(run[f], float) and run[f] >= 0 for f in FIELDS)
        assert run["step_time_s"] > 0 and run["compute_time_s"] > 0
        assert run["plain_step_time_s"] > 0   # the plain copy's whole step, timed at once
        assert run["global_batch"] == run["batch_per_rank"] * n
        assert run["samples_per_s"] == pytest.approx(run["global_batch"] / run["step_time_s"])
        parts = run["forward_time_s"] + run["backward_time_s"] + run["optimizer_time_s"]
        assert run["compute_time_s"] == pytest.approx(parts)
        assert run["predicted_step_time_s"] == pytest.approx(rebuilt_prediction(run, result))
        low, high = run["step_time_quartiles_s"]
        assert low <= run["step_time_s"] <= high
        assert run["step_time_spread_s"] == pytest.approx(high - low)
        if n == 1:
            assert run["comm_time_s"] == 0 and result["alpha_s"] is None
            assert run["predicted_step_time_s"] == pytest.approx(run["compute_time_s"])
        else:
            assert run["comm_time_s"] > 0 and result["beta_bytes_per_s"] > 0
            assert run["predicted_step_time_s"] > run["compute_time_s"]


def test_one_rank_measures_strong_and_weak_once():
    result = run_lab("scaling", None, ["--strategy", "all", "--scaling", "all", "--batch", 4,
                                       *FAST], echo=False)
    runs = result["runs"]
    assert [(r["strategy"], r["scaling"]) for r in runs] == [
        ("ddp", "strong"), ("ddp", "weak"), ("fsdp", "strong"), ("fsdp", "weak")]
    for strong, weak in (runs[:2], runs[2:]):
        assert strong["step_time_s"] == weak["step_time_s"]   # one rank: the same run
        assert strong["batch_per_rank"] == weak["batch_per_rank"] == 4
    check_invariants(result)
    # FlopCounterMode counts the matrix products of a step of 4 sequences: 6 per weight that
    # multiplies an activation (the blocks' four matrices, the head) and token, and
    # attention's two products, 12 L b s^2 h forward and backward
    shape = scaling.SHAPE
    assert result["shape"] == {"layers": shape.layers, "hidden": shape.hidden,
                               "heads": shape.heads, "seq": shape.seq, "vocab": shape.vocab}
    tokens = 4 * shape.seq
    weights = shape.layers * 12 * shape.hidden ** 2 + shape.vocab * shape.hidden
    assert result["flops_per_step"] == (6 * weights * tokens
                                        + 12 * shape.layers * 4 * shape.seq ** 2 * shape.hidden)


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
    # checked on every rank once the group is up; the launcher shows it (test_distenv)
    args = scaling.parse_args(["--scaling", "all", "--batch", "3"])
    scaling.check_batch(args, 3)
    with pytest.raises(SystemExit, match="must be a multiple of the world size"):
        scaling.check_batch(args, 2)
    scaling.check_batch(scaling.parse_args(["--scaling", "weak", "--batch", "3"]), 2)


@pytest.mark.parametrize("args, words", [
    (["--strategy", "zero"], "invalid choice: 'zero'"),
    (["--scaling", "linear"], "invalid choice: 'linear'"),
    (["--batch", 0], "--batch must be at least 1"),
    (["--steps", 0], "--steps must be at least 1"),
    (["--warmup", -1], "--warmup must be at least 0"),
    (["--sub-worlds", "2,0"], "--sub-worlds must be at least 1"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(scaling.parse_args, args, words)


def test_bad_input_exits_with_one_clear_line(script):
    # a refusal that needs the world's size, so it comes after the process group forms
    assert_fails_with_one_line(script("scaling", "--sub-worlds", 2),
                               "--sub-worlds 2: the world has only 1 rank")
    # the whole world again would write its traces and results twice under one name
    assert_fails_with_one_line(script("scaling", "--sub-worlds", 1),
                               "--sub-worlds 1: that is the whole world, measured anyway; "
                               "a world of one has no smaller one")


def test_flat_allreduce_times_give_no_fit_and_no_prediction(monkeypatch):
    """On NVLink small all-reduces take the same few microseconds whatever their size: the
    fit fails, and the lab says why instead of dying with the fitter's exception."""
    monkeypatch.setattr(scaling.timing, "timed", lambda device, operation, group=None: 5e-6)
    env = types.SimpleNamespace(world_size=8, device=torch.device("cpu"))
    alpha, beta, why = scaling.fit_link(env, 3)
    assert alpha is None and beta is None and "do not grow" in why
    assert scaling.predicted_comm([("all_reduce", 1 << 20)], 8, alpha, beta) is None


def test_the_link_is_fitted_to_the_median_repeat_as_the_step_is_timed(monkeypatch):
    """The step and the communication alone are medians; a link fitted to the fastest
    repeat would price every collective faster than any step sees it."""
    sent, calls = [], iter(range(10 ** 6))
    monkeypatch.setattr(scaling.dist, "all_reduce",
                        lambda buffer, group=None: sent.append(4 * buffer.numel()))

    def timed(device, operation, group=None):
        operation()
        # per size: WARMUP untimed runs, then 5 timed, of which the first 3 twice as slow
        slow = 0 <= next(calls) % (scaling.WARMUP + 5) - scaling.WARMUP < 3
        return (2 if slow else 1) * (1e-3 + sent[-1] / 1e9)   # 2 alpha + S / beta at N = 2
    monkeypatch.setattr(scaling.timing, "timed", timed)
    env = types.SimpleNamespace(world_size=2, device=torch.device("cpu"))
    alpha, beta, why = scaling.fit_link(env, 5)
    # the median repeat is a slow one: alpha 1 ms and beta 0.5 GB/s (the fastest: 0.5 ms, 1 GB/s)
    assert why is None
    assert alpha == pytest.approx(1e-3) and beta == pytest.approx(0.5e9)


def test_a_straggler_made_on_purpose_needs_a_profile():
    assert_refused(scaling.parse_args, ["--slow-rank", 1, "--slow-ms", 5],
                   "--slow-rank slows the profiled steps: give --profile DIR too")
    args = scaling.parse_args(["--profile", "prof", "--slow-rank", "1", "--slow-ms", "5"])
    assert (args.slow_rank, args.slow_ms) == (1, 5.0)

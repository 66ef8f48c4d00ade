"""Chapter 1's lab: averaged gradients over N ranks equal one step on the whole batch.
The chapter runs it at N = 4 and asserts the same; here N = 1 and 3 (odd)."""

import pytest
import torch

import grad_averaging
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.runtime.launch import run_lab

CORRECT = ["ddp", "manual_allreduce", "grad_accumulation"]
PITFALLS = ["sum_not_mean", "no_set_epoch", "unequal_shards"]


@pytest.fixture(scope="module", params=[1, 3])   # the chapter runs N = 4
def result(request):
    n = request.param
    # two steps into the second epoch: enough for no_set_epoch to part ways
    steps = grad_averaging.SAMPLES // (n * grad_averaging.BATCH_PER_RANK) + 2
    # a world of one runs as plain `python labs/grad_averaging.py`, without torchrun
    return run_lab("grad_averaging", None if n == 1 else n, ["--steps", steps], echo=False)


def test_the_result_carries_the_lab_contracts_metadata(result):
    assert_lab_metadata(result, "grad_averaging")
    assert result["backend"] == "gloo" and result["device"] == "cpu"
    assert result["args"]["steps"] == result["microbatches_per_epoch"] + 2


def test_correct_variants_match_the_single_process_reference(result):
    tolerance = result["tolerance"]
    assert tolerance <= 1e-5
    for name in CORRECT:
        variant = result["variants"][name]
        assert variant["expected_equal"] is True
        assert variant["max_param_diff"] <= tolerance, (name, variant)
        # at every step, not only at the worst one
        assert len(result["param_diff_by_step"][name]) == result["args"]["steps"]
        assert max(result["param_diff_by_step"][name]) <= tolerance


def test_pitfalls_differ_wherever_they_can(result):
    n = result["world_size"]
    for name in PITFALLS:
        variant = result["variants"][name]
        if variant["expected_equal"]:
            # only where the pitfall cannot act: one rank (sum = mean, equal shards)
            assert n == 1 and name != "no_set_epoch", name
            assert variant["max_param_diff"] <= result["tolerance"]
        else:
            # "by far": a hundred times the tolerance at the least
            assert variant["max_param_diff"] > 100 * result["tolerance"], (name, variant)


def test_no_set_epoch_agrees_until_the_second_epoch(result):
    diffs = result["param_diff_by_step"]["no_set_epoch"]
    first_epoch = result["microbatches_per_epoch"]
    assert max(diffs[:first_epoch]) <= result["tolerance"]
    assert max(diffs[first_epoch:]) > result["tolerance"]


def test_help_works_without_torchrun(script):
    done = script("grad_averaging", "--help")
    assert done.returncode == 0
    for option in ("--steps", "--batch-per-rank", "--accum", "--backend", "--out",
                   "--seed", "--timeout"):
        assert option in done.stdout
    assert "torchrun --standalone" in done.stdout   # the docstring's launch lines


@pytest.mark.parametrize("args, words", [
    (["--batch-per-rank", 0], "--batch-per-rank must be at least 1"),
    (["--steps", -3], "--steps must be at least 1"),
    (["--accum", 0], "--accum must be at least 1"),
    (["--lr", 0], "--lr must be positive"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(grad_averaging.parse_args, args, words)


def test_bad_input_exits_with_one_clear_line(script):
    assert_fails_with_one_line(script("grad_averaging", "--steps", 0),
                               "--steps must be at least 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: NCCL would work")
def test_nccl_without_gpu_exits_with_one_clear_line(script):
    assert_fails_with_one_line(script("grad_averaging", "--backend", "nccl"),
                               "--backend nccl needs CUDA GPUs")

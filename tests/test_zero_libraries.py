"""DeepSpeed ZeRO-2 and ZeRO-3 and Accelerate on CPU/gloo, against DDP. The chapter runs all
three at N = 2; here DeepSpeed ZeRO-3 at the odd N = 3, and bad input."""

import pytest

import zero_libraries
from conftest import assert_refused
from labkit.runtime.launch import run_lab


def test_deepspeed_zero3_trains_like_ddp_at_n_3():
    nproc = 3
    result = run_lab("zero_libraries", nproc, ["--library", "deepspeed-zero3", "--steps", 3],
                     echo=False)
    assert list(result["libraries"]) == ["deepspeed-zero3"] and result["world_size"] == nproc
    library = result["libraries"]["deepspeed-zero3"]
    assert library["max_param_diff_vs_ddp"] <= 1e-5
    assert result["max_param_change"] > 1e-3   # the weights did move
    # each rank stores about 1/N of every parameter (rounded up per tensor)
    psi, local = result["param_count"], library["local_param_numel"]
    assert psi / nproc <= local < psi / nproc + 64
    assert library["deepspeed_config"]["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("args, words", [
    (["--library", "megatron"], "invalid choice: 'megatron'"),
    ([], "the following arguments are required: --library"),
    (["--library", "all", "--steps", 0], "--steps must be at least 1"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(zero_libraries.parse_args, args, words)

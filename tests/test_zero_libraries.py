"""DeepSpeed ZeRO-2 and ZeRO-3 and Accelerate on CPU/gloo, against DDP. The chapter runs all
of them at N = 2; here DeepSpeed ZeRO-3 at the odd N = 3, at its default persistence
threshold and at 0, and bad input."""

import pytest

import zero_libraries
from conftest import assert_refused
from labkit.runtime.launch import run_lab


def test_deepspeed_zero3_trains_like_ddp_at_n_3():
    nproc = 3
    result = run_lab("zero_libraries", nproc,
                     ["--library", "deepspeed-zero3,deepspeed-zero3-threshold-0", "--steps", 3],
                     echo=False)
    libraries = result["libraries"]
    assert list(libraries) == ["deepspeed-zero3", "deepspeed-zero3-threshold-0"]
    assert result["world_size"] == nproc and result["max_param_change"] > 1e-3  # weights moved
    psi = result["param_count"]
    for name, library in libraries.items():
        assert library["max_param_diff_vs_ddp"] <= 1e-5, name
        assert library["deepspeed_config"]["zero_optimization"]["stage"] == 3
        # each rank's partition is about 1/N of every parameter (rounded up per tensor)
        partition = library["partition_param_numel"]
        assert psi / nproc <= partition < psi / nproc + 64, name
        # an fp32 copy of that partition for the optimizer, beside it even in fp32: stage3.py
        # means to skip it then, but compares a torch.device with a string, never equal
        assert library["master_param_bytes"] >= 4 * partition, name
        held = library["local_param_numel"]
        assert held == partition + library["whole_param_numel"], name
        assert 4 * held <= library["param_storage_bytes"] < 4 * (held + 2 * nproc * 64), name
    default, sharded = libraries["deepspeed-zero3"], libraries["deepspeed-zero3-threshold-0"]
    # DeepSpeed's default threshold, 1e5 elements, is above every tensor of this model: rank 0
    # keeps all of them whole beside its partition, more than DDP's psi
    assert default["persistence_threshold"] == 100_000 and default["deepspeed_config"][
        "zero_optimization"] == {"stage": 3}
    assert default["whole_param_numel"] == psi and default["local_param_numel"] > psi
    # and gathers each of them again after every step, one all-gather per tensor
    assert default["collectives_per_step"]["all_gather_into_tensor"] >= \
        default["whole_param_tensors"] > 1
    # at threshold 0 every parameter is partitioned: nothing is whole between steps
    assert sharded["persistence_threshold"] == 0
    assert sharded["whole_param_tensors"] == 0 and sharded["local_param_numel"] < psi / 2
    assert sharded["collectives_per_step"]["all_gather_into_tensor"] < \
        default["collectives_per_step"]["all_gather_into_tensor"]


@pytest.mark.parametrize("args, words", [
    (["--library", "megatron"], "invalid choice: 'megatron'"),
    ([], "the following arguments are required: --library"),
    (["--library", "all", "--steps", 0], "--steps must be at least 1"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(zero_libraries.parse_args, args, words)

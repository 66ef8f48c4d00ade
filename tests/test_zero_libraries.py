"""DeepSpeed ZeRO-2 and ZeRO-3 and Accelerate at N = 2 and 3 on CPU/gloo, against DDP."""

import pytest

from launch import run_lab


@pytest.mark.parametrize("library, nproc", [
    ("deepspeed-zero2", 2), ("deepspeed-zero3", 2), ("deepspeed-zero3", 3), ("accelerate", 2)])
def test_library_trains_like_ddp(library, nproc):
    result = run_lab("zero_libraries", nproc, ["--library", library, "--steps", 3], echo=False)
    assert result["library"] == library and result["world_size"] == nproc
    assert result["max_param_diff_vs_ddp"] <= 1e-5
    assert result["max_param_change"] > 1e-3   # the weights did move
    psi, local = result["param_count"], result["local_param_numel"]
    if library == "deepspeed-zero3":
        # each rank stores about 1/N of every parameter (rounded up per tensor)
        assert psi / nproc <= local < psi / nproc + 64
        assert result["deepspeed_config"]["zero_optimization"]["stage"] == 3
    else:
        assert local == psi

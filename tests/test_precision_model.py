"""The number formats' cost model (labkit/predict/precision_model.py) by hand, and against
torch's own casts and torch._scaled_mm on CPU: the range of each format, the error of
rounding to it, the error of an FP8 matrix product, and the outlier a scale absorbs."""

import math

import pytest
import torch

from labkit.predict import precision_model as pm

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", pm.FORMATS)
def test_each_format_s_range_is_torch_s(name):
    fmt, info = pm.FORMATS[name], torch.finfo(TORCH_DTYPES[name])
    assert fmt.max == info.max and fmt.min_normal == info.smallest_normal
    assert fmt.bytes == info.bits // 8
    assert fmt.mantissa_bits == {"fp32": 23, "bf16": 7, "fp16": 10, "e4m3": 3, "e5m2": 2}[name]
    # the smallest subnormal survives a cast; half of it (a tie) rounds to even, zero
    tiny = torch.tensor([fmt.min_subnormal, fmt.min_subnormal / 2], dtype=torch.float64)
    assert tiny.to(TORCH_DTYPES[name]).double().tolist() == [fmt.min_subnormal, 0.0]


def test_grid_spacing_by_hand():
    assert pm.grid_spacing("e4m3", 1.0) == 0.125 and pm.grid_spacing("e4m3", 448) == 32
    assert pm.grid_spacing("e4m3", 0.001) == 2.0 ** -9          # subnormal
    assert pm.grid_spacing("bf16", 1.0) == 2.0 ** -7
    assert pm.grid_spacing("fp16", 1000.0) == 0.5
    with pytest.raises(ValueError, match="beyond"):
        pm.grid_spacing("e4m3", 500)
    with pytest.raises(ValueError, match="unknown format 'int8'"):
        pm.rounding_rms("int8")


@pytest.mark.parametrize("name", ["bf16", "fp16", "e4m3", "e5m2"])
def test_rounding_error_matches_torch_s_casts(name):
    """Values spread evenly in log2 have Benford's significands: torch's round-to-nearest
    errs by the model's RMS within 3 %."""
    generator = torch.Generator().manual_seed(0)
    x = 2.0 ** (torch.rand(200_000, generator=generator, dtype=torch.float64) * 6 - 3)
    rounded = x.to(TORCH_DTYPES[name]).double()
    measured = ((rounded - x) / x).pow(2).mean().sqrt().item()
    assert measured == pytest.approx(pm.rounding_rms(name), rel=0.03)
    assert pm.rounding_rms(name) == pytest.approx(0.212 * 2.0 ** -pm.FORMATS[name].mantissa_bits,
                                                  rel=0.002)


@pytest.mark.parametrize("distribution", ["gaussian", "log_uniform"])
@pytest.mark.parametrize("name", ["bf16", "e4m3", "e5m2"])
def test_the_norm_wise_error_depends_on_the_data(name, distribution):
    """What a product sees is the norm-wise error, |round(x) - x| / |x|: it weighs each
    value's error by its size, so it depends on the data. Gaussian data measure about
    0.213 x 2^-m, close to the per-value Benford RMS by chance; log-uniform data, whose
    per-value error is the Benford RMS, measure 0.196 x 2^-m norm-wise. Within 2 %."""
    generator = torch.Generator().manual_seed(3)
    if distribution == "gaussian":
        x = torch.randn(400_000, generator=generator, dtype=torch.float64)
    else:
        x = 2.0 ** (torch.rand(400_000, generator=generator, dtype=torch.float64) * 6 - 3)
    rounded = x.to(TORCH_DTYPES[name]).double()
    measured = ((rounded - x).norm() / x.norm()).item()
    assert measured == pytest.approx(pm.normwise_rounding_rms(name, distribution), rel=0.02)
    m = pm.FORMATS[name].mantissa_bits
    assert pm.normwise_rounding_rms(name, "log_uniform") == pytest.approx(0.1962 * 2.0 ** -m,
                                                                         rel=1e-3)
    assert pm.normwise_rounding_rms(name, "gaussian") == pytest.approx(0.2127 * 2.0 ** -m,
                                                                      rel=1e-3)


def test_block_scaled_formats_by_hand():
    """MXFP8: E4M3 elements, 32 to an E8M0 scale, 8.25 bits a value; NVFP4: E2M1 (largest
    6, one subnormal step of 0.5), 16 to an E4M3 scale, 4.5 bits, plus one fp32 scale per
    tensor. A power-of-two scale moves values along the grid (MXFP8 errs as e4m3); NVFP4's
    scale puts each block's largest value on 6 exactly, which takes E[max^2] / 16 of the
    block's squares out of the error (E[max^2] of 16 Gaussians, about 4.55)."""
    mx, nv = pm.BLOCK_SCALED["mxfp8"], pm.BLOCK_SCALED["nvfp4"]
    assert (mx.element, mx.block, mx.scale, mx.bits_per_value()) == ("e4m3", 32, "e8m0", 8.25)
    assert (nv.element, nv.block, nv.scale, nv.bits_per_value()) == ("e2m1", 16, "e4m3", 4.5)
    assert nv.bits_per_value(1024) == 4.5 + 32 / 1024
    assert pm.get_format("e2m1").max == 6 and pm.get_format("e2m1").min_subnormal == 0.5
    assert pm.normwise_rounding_rms("mxfp8") == pm.normwise_rounding_rms("e4m3")
    assert pm.gaussian_block_max_square(1) == pytest.approx(1, rel=1e-4)
    assert pm.gaussian_block_max_square(16) == pytest.approx(4.55, rel=0.01)
    assert pm.normwise_rounding_rms("nvfp4") == pytest.approx(
        pm.normwise_rounding_rms("e2m1") * math.sqrt(1 - pm.gaussian_block_max_square(16) / 16))
    with pytest.raises(ValueError, match="unknown distribution"):
        pm.normwise_rounding_rms("e4m3", "uniform")


def scaled_mm(a, b, a_format, b_format):
    """torch._scaled_mm with one scale per tensor, each set so its largest value lands on
    the format's largest, accumulated in fp32."""
    def cast(x, name):
        scale = x.abs().amax() / pm.FORMATS[name].max
        return (x / scale).to(TORCH_DTYPES[name]), scale
    qa, sa = cast(a, a_format)
    qb, sb = cast(b, b_format)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)


@pytest.mark.parametrize("a_format, b_format", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_an_fp8_matrix_product_errs_as_predicted(a_format, b_format):
    """Gaussian activations and weights, per-tensor scales (e5m2 x e4m3 as a gradient
    times a weight): the output's relative error within 10 % of the model's."""
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(64, 512, generator=generator)
    w = torch.randn(256, 512, generator=generator) / math.sqrt(512)
    exact = a @ w.t()
    error = ((scaled_mm(a, w, a_format, b_format) - exact).norm() / exact.norm()).item()
    assert error == pytest.approx(pm.gemm_relative_error(a_format, b_format), rel=0.10)


def test_a_per_tensor_scale_absorbs_an_outlier_up_to_the_format_s_headroom():
    """One activation channel made F times larger sets the per-tensor scale; the other
    values, about 4F below the largest for Gaussian data, stay normal in e4m3 while 4F is
    under its headroom (28,672), and lose precision beyond it. Measured on the product of
    the other channels alone."""
    assert pm.outlier_headroom("e4m3") == 28_672
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(64, 512, generator=generator)
    w = torch.randn(256, 512, generator=generator) / math.sqrt(512)
    rest = torch.arange(512) != 7

    def error_of_the_rest(factor):
        spiked = a.clone()
        spiked[:, 7] *= factor
        scale = spiked.abs().amax() / pm.FORMATS["e4m3"].max
        rounded = (spiked / scale).to(torch.float8_e4m3fn).float() * scale
        exact = spiked[:, rest] @ w[:, rest].t()
        return ((rounded - spiked)[:, rest] @ w[:, rest].t()).norm().item() / exact.norm().item()

    clean = error_of_the_rest(1)
    assert clean == pytest.approx(pm.gemm_relative_error("e4m3"), rel=0.10)
    inside = [f for f in (10, 100, 1000) if 4 * f < pm.outlier_headroom("e4m3")]
    assert inside == [10, 100, 1000]
    for factor in inside:
        assert error_of_the_rest(factor) < 1.1 * clean
    assert 4 * 1e5 > pm.outlier_headroom("e4m3") and error_of_the_rest(1e5) > 3 * clean


def test_the_recipes_keep_and_send_what_their_names_say():
    """Bytes per parameter by hand: the ZeRO paper's mixed precision keeps 2 + 2 + 4 + K,
    FSDP2's keeps its fp32 shard as the master (4 + 4 + K) and sends less; the memory
    model and the communication model read the same table."""
    from fractions import Fraction

    from labkit.predict import comm_model, memory_model
    assert memory_model.bytes_per_parameter("adam", "mixed") == (2, 2, 12)   # 16 psi
    for name in ("fp32", "bf16_autocast", "bf16_params", "bf16_reduce", "fp8_allgather"):
        assert memory_model.bytes_per_parameter("momentum", name) == (4, 4, 4), name
    psi, n = 1000, 4
    # ZeRO-3: two all-gathers and a reduce-scatter, each (N - 1)/N of the bytes
    expected = {"fp32": (4, 4), "bf16_autocast": (4, 4), "bf16_params": (2, 4),
                "bf16_reduce": (2, 2), "mixed": (2, 2)}
    for name, (gather, reduce) in expected.items():
        assert comm_model.data_parallel_bytes_per_rank("zero3", psi, n, precision=name) == (
            Fraction(3, 4) * psi * (2 * gather + reduce)), name
    # FP8 weights: 600 of the 1000 parameters gathered in one byte, the rest in bf16
    assert pm.gathered_bytes("fp8_allgather", psi, fp8_numel=600) == 600 + 2 * 400
    assert comm_model.data_parallel_bytes_per_rank(
        "zero3", psi, n, precision="fp8_allgather", fp8_numel=600) == Fraction(3, 4) * (
        2 * 1400 + 4 * psi)
    assert comm_model.data_parallel_bytes_per_rank("ddp", psi, n, precision="bf16_reduce") == (
        comm_model.data_parallel_bytes_per_rank("ddp", psi, n, value_bytes=2))
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        memory_model.bytes_per_parameter("adam", "fp4")


def test_a_sum_in_bf16_errs_as_the_ring_model_says():
    """Values already in bf16 added one at a time in bf16 (each partial sum rounded, as a
    ring passes it on) against their exact sum: no error for one value, then growing as
    sqrt((n + 1)/2 - 1/n), within 15 % of the model, which under-predicts by 5-8 %: the
    exact sum of two bf16 values carries only a bit or two beyond bf16, so half-step ties
    are common and the rounding error is not uniform."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(8, 1 << 16, generator=generator).to(torch.bfloat16)
    errors = []
    for n in range(1, 9):
        partial = values[0].clone()
        for k in range(1, n):
            partial = partial + values[k]
        exact = values[:n].double().sum(0)
        errors.append(((partial.double() - exact).norm() / exact.norm()).item())
        assert errors[-1] == pytest.approx(pm.sum_relative_error("bf16", n), rel=0.15, abs=0)
    assert errors[0] == 0 and errors == sorted(errors)
    assert pm.sum_relative_error("bf16", 1024) == pytest.approx(
        pm.rounding_rms("bf16") * math.sqrt(512.5 - 1 / 1024))
    with pytest.raises(ValueError, match="at least one value"):
        pm.sum_relative_error("bf16", 0)

"""The planner's computation priced by its shapes (Settings.rate "shape": time_model's
tile- and wave-quantised matrix products under a roofline, compute.shaped_compute) and a price
for each interleaved chunk's sends (Settings.chunk_price): each checked by hand, against
its limits, and the defaults against the plans the planner gave before either existed."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parents[1] / "labs"
sys.path.insert(0, str(LABS))

from labkit.predict import hardware, planner, time_model  # noqa: E402

import plan  # noqa: E402

A100_SMS, A100_HBM = 108, hardware.A100_80GB_HBM_BYTES_S
FLAT_A100 = 0.55 * 312e12    # the planner's flat rate on an A100


def test_a_worked_product_by_hand():
    """2,048 tokens through a 2,304 x 2,304 weight on an A100 (GPT 1.7B's hidden size):
    8 x 18 = 144 tiles of 256 x 128, exact, so no tile quantisation; 144 tiles on 108 SMs
    take two waves, the second a third full: 144 / 216 = 2/3 of the ceiling. Its traffic,
    2 bytes x (2048 x 2304 + 2304^2 + 2048 x 2304) = 29.5 MB, takes 14 us at 2,039 GB/s
    against 190 us of compute, so the rate is 2/3 x 171.6 = 114.4 TFLOP/s."""
    assert time_model.gemm_shape_efficiency(2048, 2304, A100_SMS) == pytest.approx(2 / 3)
    rate = time_model.gemm_rate(2048, 2304, 2304, FLAT_A100, A100_HBM, A100_SMS)
    assert rate == pytest.approx(114.4e12, rel=1e-9)
    # one token more takes a ninth row of tiles, nearly empty: 162 tiles, still two waves
    more = time_model.gemm_rate(2049, 2304, 2304, FLAT_A100, A100_HBM, A100_SMS)
    assert more == pytest.approx(FLAT_A100 * 2049 / 2304 * 162 / 216, rel=1e-9)
    # a single token (m = 1) through an 8,192 x 8,192 weight: one row of a 256-row tile
    # in 64 tiles on 108 SMs, (1/256) x (64/108) of the ceiling, 0.40 TFLOP/s, below the
    # 2.0 TFLOP/s its traffic allows (about 1 FLOP a byte): one tile's loss is an upper
    # bound (a GEMV kernel would stream the weight), and a training step's products have
    # thousands of rows
    one = time_model.gemm_rate(1, 8192, 8192, FLAT_A100, A100_HBM, A100_SMS)
    assert one == pytest.approx(FLAT_A100 / 256 * 64 / 108, rel=1e-9)
    assert one < 2 * 8192 ** 2 / (2 * (2 * 8192 + 8192 ** 2) / A100_HBM)
    # 64 tokens through a 64 x 64 weight: an eighth of one tile on one of the 108 SMs,
    # 171.6 / 8 / 108 = 0.20 TFLOP/s, where its traffic (21 FLOPs a byte) would allow 43.5
    small = time_model.gemm_rate(64, 64, 64, FLAT_A100, A100_HBM, A100_SMS)
    assert small == pytest.approx(FLAT_A100 / 8 / 108, rel=1e-9)


def test_large_products_reach_the_flat_rate_and_none_exceeds_it():
    """Whole tiles in whole waves run at the ceiling exactly; larger shapes tend to it; no
    shape exceeds it or its traffic's bound."""
    m, n = 256 * 108, 128 * 10          # 1,080 tiles: ten full waves on 108 SMs
    assert time_model.gemm_rate(m, n, 8192, FLAT_A100, A100_HBM, A100_SMS) == \
        pytest.approx(FLAT_A100, rel=1e-12)
    for size in (10_000, 100_000, 1_000_000):
        rate = time_model.gemm_rate(size + 7, size + 3, 4096, FLAT_A100, A100_HBM, A100_SMS)
        assert rate <= FLAT_A100
    assert rate == pytest.approx(FLAT_A100, rel=2e-3)
    for m, n, k in ((1, 1, 1), (7, 300, 5000), (4096, 129, 64), (300, 300, 300)):
        rate = time_model.gemm_rate(m, n, k, FLAT_A100, A100_HBM, A100_SMS)
        bound = 2 * m * n * k / (2 * (m * k + k * n + m * n) / A100_HBM)
        assert rate <= min(FLAT_A100, bound) * (1 + 1e-12)


def test_the_rate_rises_where_it_must():
    """Within one row of tiles the rate grows with the rows (the tile's idle part shrinks),
    and at any shape with the inner dimension k (more FLOPs per byte moved); a layer's
    products run faster as a micro-batch brings more tokens in whole tiles."""
    rates = [time_model.gemm_rate(m, 4096, 4096, FLAT_A100, A100_HBM, A100_SMS)
             for m in range(1, 257, 5)]
    assert all(a < b for a, b in zip(rates, rates[1:]))
    rates = [time_model.gemm_rate(1000, 3000, k, FLAT_A100, A100_HBM, A100_SMS)
             for k in (1, 2, 8, 64, 512, 4096, 32768)]
    assert all(a <= b for a, b in zip(rates, rates[1:])) and rates[0] < rates[-1]
    gpt = planner.Model(80, 12288, 96, 2048, 51200, tied=True)
    a100 = planner.Hardware(gpus=8, peak_tflops=312)
    layer = [planner.linear_rate(gpt, tokens, 8, a100, FLAT_A100) for tokens in (1, 256, 2048)]
    assert layer[0] < layer[1] < layer[2] <= FLAT_A100
    # the kernels that are not products: fewer bytes per rank as tp splits them
    kernel = [planner.elementwise_bytes_per_token(gpt, tp, True, False)[0] for tp in (1, 2, 8)]
    assert kernel[0] > kernel[1] > kernel[2]


def test_the_shape_rate_costs_at_least_the_flat_one_and_tends_to_it():
    """Every product at most at the flat rate, and more kernels priced: a step's compute
    under "shape" is never less than under "flat", and for a wide model on large
    micro-batches it comes within the memory-bound kernels' share of it."""
    gpt = planner.Model(24, 2304, 24, 2048, 51200, tied=True)    # GPT 1.7B
    a100 = dict(peak_tflops=312, nvlink_gb_s=240, network_gb_s=24)
    hw = planner.Hardware(gpus=32, **a100)
    layout = {"dp": 32, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "chunks": 1, "micro_batch": 4,
              "microbatches": 4, "zero": "ddp", "recompute": "full"}
    flat = planner.Settings(global_batch_tokens=512 * 2048, flash_attention=False,
                            rate="flat")
    shape = dataclasses.replace(flat, rate="shape")
    a, b = (planner.step_time(gpt, layout, s, hw) for s in (flat, shape))
    assert b["compute"] > a["compute"] and b["recompute"] > a["recompute"]
    wide = planner.Model(8, 65536, 512, 2048, 65536, tied=True)
    hw8 = planner.Hardware(gpus=8, **a100)
    layout8 = {**layout, "dp": 1, "tp": 8, "micro_batch": 8, "microbatches": 1}
    settings = planner.Settings(global_batch_tokens=8 * 2048, rate="flat")
    a, b = (planner.step_time(wide, layout8, s, hw8)
            for s in (settings, dataclasses.replace(settings, rate="shape")))
    assert a["compute"] < b["compute"] < 1.05 * a["compute"]


# Published runs, as the 5-D chapter gives them to the planner: the model, GPUs, hardware,
# global batch in tokens, the run's settings, its layout, and the ZeRO stage the layout
# itself runs (None: any of the row's). Narayanan et al. (2021), Table 1 (A100s at 80 % and
# 96 % of their links' line rate; Megatron-LM's settings of 2021); Dubey et al. (2024),
# Table 4 (Llama 3's asynchronous sends and fp32 reductions; its FSDP taken as ZeRO-2);
# NVIDIA NeMo's 24.07 performance summary (Nemotron-4 340B in FP8); Black et al. (2022)
# and GPT-NeoX's configs/20B.yml (A100s of 40 GB, half the network per GPU)
A100 = dict(peak_tflops=312, nvlink_gb_s=240, network_gb_s=24)
MEGATRON_2021 = dict(zero=("ddp",), flash_attention=False, recompute=("full",),
                     sequence_parallel=False, grad_reduce="fp16")
PUBLISHED = {
    "GPT 145.6B": (planner.Model(80, 12288, 96, 2048, 51200, tied=True), 1536, A100,
                   2304 * 2048, MEGATRON_2021, dict(tp=8, pp=8), None),
    "Llama 3 405B, 8K": (planner.PRESETS["llama3-405b"], 16384, {}, 16 * 2 ** 20,
                         dict(pp_async=True, grad_reduce="fp32"), dict(tp=8, pp=16, chunks=8),
                         ("zero2",)),
    "Nemotron-4 340B, FP8": (planner.Model(96, 18432, 96, 4096, 256000, ffn_hidden=73728,
                                           kv_heads=8), 128, {}, 32 * 4096,
                             dict(precision="fp8", grad_reduce="bf16"),
                             dict(tp=8, pp=8, chunks=12), None),
    "GPT-NeoX-20B": (planner.Model(44, 6144, 64, 2048, 50432), 96,
                     dict(A100, gpu_memory_gb=40, network_gb_s=12), 1536 * 2048,
                     dict(MEGATRON_2021, zero=("zero1",)), dict(tp=2, pp=4), None),
}
KEYS = ("dp", "tp", "pp", "cp", "ep", "etp", "chunks", "micro_batch", "zero", "recompute")
# What the planner gave for them before Settings.rate and chunk_price existed, and gives
# with rate="flat" and no chunk price: the three
# fastest configurations (KEYS, step seconds), how many fit, and the published layout's
# rank and step seconds
BEFORE = {
    "GPT 145.6B": ([([24, 4, 16, 1, 1, 4, 5, 1, "ddp", "full"], 24.671842965616786),
                    ([48, 8, 4, 1, 1, 8, 20, 1, "ddp", "full"], 24.865280227413333),
                    ([48, 8, 4, 1, 1, 8, 10, 1, "ddp", "full"], 24.94105245667655)],
                   99, 4, 24.94950055103851),
    "Llama 3 405B, 8K": ([([64, 8, 32, 1, 1, 8, 4, 1, "zero1", "none"], 7.191120714064831),
                          ([128, 8, 16, 1, 1, 8, 8, 1, "zero2", "none"], 7.478419568317093),
                          ([128, 8, 16, 1, 1, 8, 4, 1, "zero2", "none"], 8.148160105953917)],
                         277, 2, 7.478419568317093),
    "Nemotron-4 340B, FP8": ([([2, 8, 8, 1, 1, 8, 12, 1, "zero2", "none"], 3.5144064177625047),
                              ([1, 8, 16, 1, 1, 8, 6, 1, "ddp", "none"], 3.5339043733200795),
                              ([1, 8, 16, 1, 1, 8, 6, 1, "zero1", "none"], 3.5339043733200795)],
                             295, 1, 3.5144064177625047),
    "GPT-NeoX-20B": ([([24, 2, 2, 1, 1, 2, 23, 2, "zero1", "full"], 34.078153023901535),
                      ([24, 2, 2, 1, 1, 2, 22, 2, "zero1", "full"], 34.08025453732943),
                      ([24, 2, 2, 1, 1, 2, 23, 4, "zero1", "full"], 34.10676149288046)],
                     461, 56, 35.144110092725136),
}


def planned(name, **changes):
    """(the plan, the published layout's rank_layout) of a PUBLISHED row."""
    model, gpus, hw_kw, tokens, set_kw, degrees, layout_zero = PUBLISHED[name]
    hw = planner.Hardware(gpus=gpus, **hw_kw)
    settings = planner.Settings(global_batch_tokens=tokens, **{**set_kw, **changes})
    layout = {"cp": 1, "ep": 1, **degrees}
    layout["dp"] = gpus // (layout["tp"] * layout["pp"])
    found = planner.plan(model, settings, hw)
    mine = planner.rank_layout(model, layout, dataclasses.replace(
        settings, zero=layout_zero or settings.zero), hw, found)
    return found, mine


@pytest.mark.parametrize("name", BEFORE)
def test_the_flat_rate_gives_the_plans_it_gave_before(name):
    found, mine = planned(name, rate="flat", chunk_price=False)
    top, count, rank, step = BEFORE[name]
    assert [([c[k] for k in KEYS], c["time_s"]["step"]) for c in found[:3]] == \
        [(keys, pytest.approx(s, rel=1e-12)) for keys, s in top]
    assert (len(found), mine["rank"]) == (count, rank)
    assert mine["step_time_s"] == pytest.approx(step, rel=1e-12)


def test_under_the_shape_rate_a_pipeline_takes_larger_micro_batches():
    """Narayanan et al. (2021, section 3.4): a larger micro-batch runs each product faster,
    against a longer fill and drain. At one rate for every FLOP only the bubble counts, and
    GPT 145.6B's fastest layout takes one sequence a micro-batch; priced by shape, more."""
    flat, _ = planned("GPT 145.6B", rate="flat")
    shape, mine = planned("GPT 145.6B", rate="shape")
    assert flat[0]["pp"] > 1 and flat[0]["micro_batch"] == 1
    assert shape[0]["pp"] > 1 and shape[0]["micro_batch"] > 1
    assert mine["time_s"]["step"] > 0 and math.isfinite(mine["time_s"]["step"])


def test_each_chunk_pays_its_sends_latency_even_overlapped():
    """Interleaved with v chunks, Megatron-LM overlaps the sends (pp_async None): without
    chunk_price they cost nothing outside the fill and drain; with it, each of the m x v x 2
    sends waits its latency, here alone, since each transfer is shorter than the chunk's
    computation beside it."""
    model = planner.PRESETS["llama3-70b"]
    hw = planner.Hardware(gpus=64)
    settings = planner.Settings(global_batch_tokens=128 * 8192)
    seconds = {}
    for v in (2, 4):
        layout = {"dp": 4, "tp": 8, "pp": 2, "cp": 1, "ep": 1, "chunks": v, "micro_batch": 1,
                  "microbatches": 32, "zero": "zero1", "recompute": "none"}
        plain = planner.step_time(model, layout, settings, hw)
        priced = planner.step_time(model, layout, dataclasses.replace(
            settings, chunk_price=True), hw)
        assert plain["pp"] == 0
        alpha = hw.nvlink[0] if 8 * 2 * 4 <= hw.gpus_per_node else hw.network[0]
        assert priced["pp"] == pytest.approx(32 * v * 2 * alpha, rel=1e-12)
        seconds[v] = priced["pp"]
    assert seconds[4] == pytest.approx(2 * seconds[2])
    # a transfer longer than the chunk's computation leaves the rest exposed
    long = planner.chunk_exposed_seconds(model, 1, 8192, 8, 1, 4, 2, 32, 4, hw, 1e-6, 2e-6)
    transfer = 2 * 8192 * model.hidden / 8 / hw.network[1]
    assert long == pytest.approx(32 * 4 * (2 * hw.network[0] + 2 * transfer)
                                 - 1e-6 - 2e-6, rel=1e-9)


def test_the_command_line_takes_the_rate_and_the_chunk_price(capsys):
    argv = ["--params", "350M", "--gpus", "4", "--top", "1"]
    plain = plan.settings_from_args(plan.parse_args(argv))
    assert (plain.rate, plain.chunk_price) == (planner.Settings.rate, False) == ("shape", False)
    priced = plan.settings_from_args(plan.parse_args([*argv, "--rate", "flat",
                                                      "--chunk-price"]))
    assert priced == dataclasses.replace(plain, rate="flat", chunk_price=True)
    plan.main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["rate"] == "shape"
    best = out["configurations"][0]
    model = plan.parse_args(argv).model_shape
    flat = planner.evaluate(model, {k: best[k] for k in (*KEYS, "microbatches")},
                            dataclasses.replace(plain, rate="flat"),
                            plan.hardware_from_args(plan.parse_args(argv)))
    assert best["time_s"]["step"] > flat["time_s"]["step"]
    with pytest.raises(SystemExit):
        plan.parse_args([*argv, "--rate", "fast"])

"""The tensor-parallel rules of thumb in the cost models, against hand arithmetic: the
volume per layer and micro-batch, and communication over compute, (2/9)(t-1)R/(h beta)."""

from fractions import Fraction

import pytest

from labkit.predict import comm_model, hardware, time_model

S, B, H = 4096, 1, 8192


@pytest.mark.parametrize("t", [1, 2, 3, 4, 8, 64])
def test_layer_volume_matches_the_collectives_per_layer(t):
    sbh = S * B * H
    assert comm_model.tensor_parallel_layer_values(S, B, H, t) == Fraction(8 * (t - 1), t) * sbh
    assert comm_model.tensor_parallel_layer_values(S, B, H, t, recompute=True) == \
        Fraction(12 * (t - 1), t) * sbh                       # six all-reduces
    sp = comm_model.tensor_parallel_layer_values(S, B, H, t, sequence_parallel=True)
    assert sp == Fraction(10 * (t - 1), t) * sbh             # 25 % more than 8
    assert comm_model.tensor_parallel_layer_values(
        S, B, H, t, sequence_parallel=True, regather_inputs=False) == Fraction(8 * (t - 1), t) * sbh
    # the same count as one layer of the step's plan (tensor_parallel_collectives, 1 value = 1 byte)
    for sequence_parallel, value in ((False, Fraction(8 * (t - 1), t) * sbh), (True, sp)):
        plan = comm_model.tensor_parallel_collectives(2, S, B, H, t, sequence_parallel,
                                                      embedding=False, head=False)
        per_layer = [item for item in plan if item[1] == sbh]
        sent, _ = comm_model.collectives_summary(per_layer, t, value_bytes=1)
        assert sent == 2 * value


def test_comm_to_compute_is_the_ratio_of_the_two_times_and_independent_of_b_and_s():
    rate = hardware.H100_BF16_FLOPS * hardware.UTILIZATION
    beta = hardware.NVLINK[1]
    for t in (2, 8, 16):
        for seq, batch in ((4096, 1), (2048, 8)):
            comm = 2 * comm_model.tensor_parallel_layer_values(seq, batch, H, t) / beta
            compute = 3 * 24 * batch * seq * H ** 2 / t / rate
            ratio = comm_model.tensor_parallel_comm_to_compute(t, H, rate, beta)
            assert ratio == pytest.approx(float(comm) / compute, rel=1e-12)
            assert ratio == pytest.approx(2 / 9 * (t - 1) * rate / (H * beta), rel=1e-12)
    # the course's H100 constants: about 21 % at t = 8, h = 8192, and twice that at h = 4096
    at_8192 = comm_model.tensor_parallel_comm_to_compute(8, 8192, rate, beta)
    at_4096 = comm_model.tensor_parallel_comm_to_compute(8, 4096, rate, beta)
    assert round(100 * at_8192) == 21 and round(100 * at_4096) == 42
    assert at_4096 == pytest.approx(2 * at_8192)
    t_even = comm_model.tensor_parallel_break_even_tp(8192, rate, beta)
    assert comm_model.tensor_parallel_comm_to_compute(t_even, 8192, rate, beta) == pytest.approx(1)


def test_layer_matmul_coefficient():
    assert comm_model.layer_matmul_coefficient(H, 64) == 24
    # 24 b s h^2 is the weight part of time_model.layer_forward_flops
    assert time_model.layer_forward_flops(S, B, H) - 4 * B * S ** 2 * H == 24 * B * S * H ** 2
    llama3_70b = comm_model.layer_matmul_coefficient(8192, 64, 8, 28672, gated=True)
    # Q 2, K and V 2 x 2/8, output 2, SwiGLU 3 x 2 x 3.5
    assert llama3_70b == Fraction(51, 2)
    rate, beta = 1e15, 1e11
    assert comm_model.tensor_parallel_comm_to_compute(
        8, H, rate, beta, matmul_coefficient=llama3_70b) == pytest.approx(
        comm_model.tensor_parallel_comm_to_compute(8, H, rate, beta) * 24 / 25.5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_adds_the_forward_collectives_in_the_step_plan_too(sequence_parallel):
    t, sbh = 4, S * B * H
    plan = comm_model.tensor_parallel_collectives(1, S, B, H, t, sequence_parallel,
                                                  embedding=False, head=False, recompute=True)
    per_layer = [item for item in plan if item[1] == sbh]
    sent, _ = comm_model.collectives_summary(per_layer, t, value_bytes=1)
    assert sent == comm_model.tensor_parallel_layer_values(
        S, B, H, t, sequence_parallel=sequence_parallel, recompute=True)

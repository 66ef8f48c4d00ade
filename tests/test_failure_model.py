"""The failure cost models: MTBF over N devices, Young/Daly's interval, and a seeded
simulation of goodput whose best interval lands where the formula says."""

import math

import pytest

from labkit.predict import failure_model

DAY, HOUR = 86400, 3600


def test_llama3_interruptions_give_a_device_mtbf_of_years():
    """Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs (Dubey et al.,
    2024): one every ~3.1 hours for the job, each GPU ~5.8 years between failures."""
    job = 54 * DAY / 419
    assert job / HOUR == pytest.approx(3.09, abs=0.01)
    device = failure_model.device_mtbf(54 * DAY, 419, 16384)
    assert device / (365 * DAY) == pytest.approx(5.8, abs=0.05)
    assert failure_model.job_mtbf(device, 16384) == pytest.approx(job)
    # the same devices, 8 times fewer of them: 8 times longer between interruptions
    assert failure_model.job_mtbf(device, 2048) == pytest.approx(8 * job)
    # the constants the chapter uses are the published figures (section 3.3.4)
    assert (failure_model.LLAMA3_DAYS, failure_model.LLAMA3_INTERRUPTIONS,
            failure_model.LLAMA3_GPUS, failure_model.LLAMA3_HARDWARE_SHARE) == (
        54, 419, 16384, 0.78)


def test_young_daly_by_hand():
    assert failure_model.young_daly_interval(60, 3 * HOUR) == pytest.approx(
        math.sqrt(2 * 60 * 10800))
    assert failure_model.young_daly_interval(0, HOUR) == 0
    with pytest.raises(ValueError):
        failure_model.young_daly_interval(60, 0)


def test_the_simulation_s_best_interval_is_young_daly_s():
    checkpoint, restart, mtbf = 60.0, 300.0, 3 * HOUR
    best = failure_model.young_daly_interval(checkpoint, mtbf)
    intervals = [best * f for f in (0.125, 0.25, 0.5, 1, 2, 4, 8)]
    simulated = [sum(failure_model.simulate_goodput(t, checkpoint, restart, mtbf, 2000 * HOUR,
                                                    seed) for seed in range(3)) / 3
                 for t in intervals]
    assert simulated.index(max(simulated)) == 3                # the optimum is the formula's
    for t, g in zip(intervals, simulated):
        first_order = failure_model.expected_goodput(t, checkpoint, restart, mtbf)
        if t <= 2 * best:          # the first-order curve holds while tau is small against M
            assert g == pytest.approx(first_order, abs=0.02)
        else:                      # beyond, it counts more lost work than there is
            assert g > first_order


def test_without_failures_only_the_saves_cost():
    g = failure_model.simulate_goodput(600, 60, 300, 1e15, 100 * HOUR)
    assert g == pytest.approx(600 / 660, rel=1e-3)


def test_daly_s_leading_terms_are_young_s_less_one_save():
    # Daly (2006): tau_opt = sqrt(2 delta M) [1 + ...] - delta, for delta < 2 M
    assert failure_model.daly_interval(60, 3 * HOUR) == pytest.approx(
        math.sqrt(2 * 60 * 10800) - 60)
    with pytest.raises(ValueError):
        failure_model.daly_interval(2 * HOUR, HOUR)


def test_an_async_save_protects_nothing_until_it_is_written():
    """A save that stalls 6 s and goes on writing for 20 min: each failure loses W on top
    of half an interval, in the formula and in the simulation alike; and a save cannot
    start before the last one is written (tau >= W)."""
    stall, write, restart, mtbf = 6.0, 1200.0, 300.0, 3 * HOUR
    assert failure_model.young_daly_interval(stall, mtbf) == pytest.approx(
        math.sqrt(2 * stall * mtbf))                  # 360 s, shorter than the write
    tau = failure_model.young_daly_interval(stall, mtbf, write)
    assert tau == write
    durable = failure_model.expected_goodput(tau, stall, restart, mtbf)
    written_late = failure_model.expected_goodput(tau, stall, restart, mtbf, write)
    assert durable - written_late == pytest.approx(tau / (tau + stall) * write / mtbf)
    assert durable - written_late > 0.1
    late = [failure_model.simulate_goodput(tau, stall, restart, mtbf, 2000 * HOUR, seed,
                                           write_s=write) for seed in range(3)]
    safe = [failure_model.simulate_goodput(tau, stall, restart, mtbf, 2000 * HOUR, seed)
            for seed in range(3)]
    assert sum(late) / 3 == pytest.approx(written_late, abs=0.02)
    assert sum(safe) / 3 == pytest.approx(durable, abs=0.02)
    with pytest.raises(ValueError):
        failure_model.expected_goodput(30, stall, restart, mtbf, write)

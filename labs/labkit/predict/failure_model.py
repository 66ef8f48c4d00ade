"""Failures at scale, as cost models: how often a job of N devices is interrupted, how often
to checkpoint, and what fraction of the time is left for useful work (goodput).

Pure functions and a seeded simulation, no process group. Times are in seconds unless a
name says otherwise.

  job_mtbf            one device's mean time between failures over N devices, failures
                      independent: MTBF / N
  device_mtbf         the other way round, from a job's observed interruptions
  young_daly_interval the checkpoint interval that loses the least time, Young's
                      sqrt(2 C M) (1974), C the time a save stalls training; never
                      shorter than W, the time an asynchronous save goes on writing
  daly_interval       the leading terms of Daly's higher-order optimum (2006),
                      sqrt(2 C M) - C
  expected_goodput    the useful fraction of time at interval tau, to first order:
                      tau / (tau + C) x (1 - (R + (tau + C) / 2 + W) / M), R the time to
                      restart; a save protects nothing until it is written, W after its
                      stall (W = 0 for a blocking save)
  simulate_goodput    the same measured on a seeded run of exponential failures: work is
                      saved every tau of progress, a save counts once written, a failure
                      loses what came after the last written save and costs a restart
"""

import math
import random

DAY = 86_400
# The published example: Llama 3's 54-day snapshot of pre-training on 16,384 H100 GPUs saw
# 419 unexpected interruptions, about 78 % of them confirmed or suspected hardware (Dubey
# et al. 2024, section 3.3.4)
LLAMA3_DAYS, LLAMA3_INTERRUPTIONS, LLAMA3_GPUS = 54, 419, 16_384
LLAMA3_HARDWARE_SHARE = 0.78


def job_mtbf(device_mtbf_s, devices):
    """Mean time between interruptions of a job that stops whenever any of its `devices`
    fails, each failing independently with mean time `device_mtbf_s`."""
    if devices < 1 or device_mtbf_s <= 0:
        raise ValueError("need devices >= 1 and a positive device MTBF")
    return device_mtbf_s / devices


def device_mtbf(job_seconds, interruptions, devices):
    """One device's MTBF implied by `interruptions` of a job of `devices` over
    `job_seconds` (e.g. Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs)."""
    if interruptions < 1:
        raise ValueError("need at least one interruption to estimate an MTBF")
    return job_seconds / interruptions * devices


def young_daly_interval(checkpoint_s, mtbf_s, write_s=0.0):
    """Young's first-order optimum interval between checkpoints, sqrt(2 C M): shorter and
    the saves cost more than they protect, longer and each failure loses more work. An
    asynchronous save that goes on writing for `write_s` after its stall adds W to what
    every failure loses whatever the interval, so the optimum stays, but a save cannot
    start before the last one is written: the interval is at least W."""
    if checkpoint_s < 0 or mtbf_s <= 0 or write_s < 0:
        raise ValueError("need a checkpoint cost >= 0, a write time >= 0, a positive MTBF")
    return max(math.sqrt(2 * checkpoint_s * mtbf_s), write_s)


def daly_interval(checkpoint_s, mtbf_s):
    """The leading terms of Daly's higher-order optimum (Daly 2006),
    sqrt(2 C M) [1 + ...] - C for C < 2 M: Young's interval less one save. The two differ
    by C, which matters only once a save is no longer short against the MTBF."""
    if not 0 <= checkpoint_s < 2 * mtbf_s:
        raise ValueError("Daly's estimate holds for 0 <= C < 2 M")
    return math.sqrt(2 * checkpoint_s * mtbf_s) - checkpoint_s


def expected_goodput(interval_s, checkpoint_s, restart_s, mtbf_s, write_s=0.0):
    """First-order useful fraction of wall time: a save stalling training for C after every
    tau of work, and per failure (one every M) a restart R and, on average, half an
    interval of work lost, plus W: an asynchronous save written W after its stall protects
    nothing until then, so a failure meanwhile goes back to the save before (tau >= W)."""
    if interval_s <= 0:
        raise ValueError("the interval must be positive")
    if interval_s < write_s:
        raise ValueError("a save cannot start before the last one is written: tau >= W")
    saving = interval_s / (interval_s + checkpoint_s)
    failing = 1 - (restart_s + (interval_s + checkpoint_s) / 2 + write_s) / mtbf_s
    return max(0.0, saving * failing)


def simulate_goodput(interval_s, checkpoint_s, restart_s, mtbf_s, work_s, seed=0,
                     write_s=0.0):
    """Useful fraction of wall time to finish `work_s` of work, failures arriving as a
    Poisson process of mean gap `mtbf_s` (seeded). Progress is saved after every tau of
    work, stalling training for C; the save is written `write_s` later, while work goes on
    (0: a blocking save, written when its stall ends). A failure loses the progress since
    the last written save and costs R before work resumes; failures during a restart
    restart it."""
    if interval_s < write_s:
        raise ValueError("a save cannot start before the last one is written: tau >= W")
    rng = random.Random(seed)
    clock, progress, written = 0.0, 0.0, 0.0
    pending = None   # (progress it holds, when it is written)
    next_failure = rng.expovariate(1 / mtbf_s)
    while progress < work_s:
        segment = min(interval_s, work_s - progress)
        last = progress + segment >= work_s   # the end of the job needs no save
        needed = segment + (0.0 if last else checkpoint_s)
        if clock + needed <= next_failure:
            clock += needed
            progress += segment
            if pending is not None and pending[1] <= clock:
                written, pending = pending[0], None
            if not last:
                pending = (progress, clock + write_s)
                if write_s == 0:
                    written, pending = progress, None
            continue
        if pending is not None and pending[1] <= next_failure:
            written = pending[0]                # written before the failure came
        clock, progress, pending = next_failure, written, None   # the rest is lost
        while True:                             # restart, itself interruptible
            next_failure = clock + rng.expovariate(1 / mtbf_s)
            if clock + restart_s <= next_failure:
                clock += restart_s
                break
            clock = next_failure
    return work_s / clock

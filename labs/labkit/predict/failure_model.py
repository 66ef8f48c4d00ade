"""Failures at scale, as cost models: how often a job of N devices is interrupted, how often
to checkpoint, and what fraction of the time is left for useful work (goodput).

Pure functions and a seeded simulation, no process group. Times are in seconds unless a
name says otherwise.

  job_mtbf            one device's mean time between failures over N devices, failures
                      independent: MTBF / N
  device_mtbf         the other way round, from a job's observed interruptions
  young_daly_interval the checkpoint interval that loses the least time, sqrt(2 C M)
                      (Young, 1974; Daly, 2006, first order), C the time to save one
  expected_goodput    the useful fraction of time at interval tau, to first order:
                      tau / (tau + C) x (1 - (R + (tau + C) / 2) / M), R the time to
                      restart
  simulate_goodput    the same measured on a seeded run of exponential failures: work is
                      saved every tau of progress, a failure loses what came after the
                      last save and costs a restart
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


def young_daly_interval(checkpoint_s, mtbf_s):
    """Young's first-order optimum interval between checkpoints, sqrt(2 C M): shorter and
    the saves cost more than they protect, longer and each failure loses more work."""
    if checkpoint_s < 0 or mtbf_s <= 0:
        raise ValueError("need a checkpoint cost >= 0 and a positive MTBF")
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def expected_goodput(interval_s, checkpoint_s, restart_s, mtbf_s):
    """First-order useful fraction of wall time: a blocking save of C after every tau of
    work, and per failure (one every M) a restart R and, on average, half an interval of
    work lost."""
    if interval_s <= 0:
        raise ValueError("the interval must be positive")
    saving = interval_s / (interval_s + checkpoint_s)
    failing = 1 - (restart_s + (interval_s + checkpoint_s) / 2) / mtbf_s
    return max(0.0, saving * failing)


def simulate_goodput(interval_s, checkpoint_s, restart_s, mtbf_s, work_s, seed=0):
    """Useful fraction of wall time to finish `work_s` of work, failures arriving as a
    Poisson process of mean gap `mtbf_s` (seeded). Progress is saved (blocking, C) after
    every tau of work; a failure during work or a save loses the progress since the last
    completed save and costs R before work resumes; failures during a restart restart it."""
    rng = random.Random(seed)
    clock, saved = 0.0, 0.0
    next_failure = rng.expovariate(1 / mtbf_s)
    while saved < work_s:
        segment = min(interval_s, work_s - saved)
        # the work, then its save, have to fit before the next failure
        needed = segment + (checkpoint_s if saved + segment < work_s else 0.0)
        if clock + needed <= next_failure:
            clock += needed
            saved += segment
            continue
        clock = next_failure                    # what was not saved is lost
        while True:                             # restart, itself interruptible
            next_failure = clock + rng.expovariate(1 / mtbf_s)
            if clock + restart_s <= next_failure:
                clock += restart_s
                break
            clock = next_failure
    return work_s / clock

"""Timing a distributed operation honestly: every rank starts together (barrier), the GPU
is synchronised before the clock is read, the slowest rank's time counts, and repeats are
summarised by their median and quartiles (the first runs, which set things up, are dropped
by the caller as warm-up)."""

import statistics
import time

import torch
import torch.distributed as dist


def timed(device, operation, group=None):
    """Seconds `operation()` took on the slowest rank (of `group`; None: of the world)."""
    if device.type == "cuda":
        # work queued before (a warm-up, a copy of the input) must not run on our clock
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    operation()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def summary(times):
    """(median, lower quartile, upper quartile) of a list of times."""
    ordered = sorted(times)
    quartile = max(1, len(ordered) // 4)
    return statistics.median(ordered), ordered[quartile - 1], ordered[-quartile]


def compute_times(model, optimizer, loss_fn, inputs, targets, device, repeats, warmup=2,
                  group=None):
    """Median seconds of forward, backward and optimizer step of `model`, with no
    communication at all: what one rank computes in a data-parallel step.

    Every rank runs it at the same time, so ranks that share cores or memory bandwidth
    slow each other down here as they do in the real step (every rank of `group`; None:
    of the world). Returns a dict of medians.
    """
    phases = {"forward_s": [], "backward_s": [], "optimizer_s": []}
    state = {}

    def forward():
        state["loss"] = loss_fn(model(inputs), targets)

    def backward():
        state.pop("loss").backward()

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for index in range(warmup + repeats):
        for name, phase in zip(phases, (forward, backward, step)):
            elapsed = timed(device, phase, group)
            if index >= warmup:
                phases[name].append(elapsed)
    return {name: statistics.median(times) for name, times in phases.items()}

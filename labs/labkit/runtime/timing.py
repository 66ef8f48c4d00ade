"""Timing a distributed operation honestly: every rank starts together (barrier), the GPU
is synchronised before the clock is read, the slowest rank's time counts, and repeats are
summarised by their median and quartiles (the first runs, which set things up, are dropped
by the caller as warm-up). A wait for one message (wait_for_work) returns when the message
is in, on NCCL as on gloo, so the clock read around it times the wait."""

import datetime
import math
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


# what a wait on a CUDA work may take of the group's timeout before it gives up itself
NCCL_GIVE_UP_FRACTION = 0.8


def wait_for_work(work, device, timeout_s=0.0):
    """Return when `work` (a send or receive) is done, within `timeout_s` (0: no limit),
    with the CPU blocked until then on every backend: the one way the lab waits for a
    message, so that the time around this call is the time the message took.

    gloo: work.wait() blocks the thread until the message is in (a condition variable).
    NCCL: work.wait() only makes the current stream wait for NCCL's and returns at once
    (WorkNCCL::wait: synchronize() is ncclEndEvent_->block(currentStream)); with a timeout
    it then polls isCompleted() with a sleep of kSynchronizeBusyWaitMillis (1 ms in the
    newest source, 10 ms in older ones, where only TORCH_NCCL_BLOCKING_WAIT=1 made it
    poll at all), so a blocked receive returns up to a sleep late. Here the thread asks
    is_completed() (a cudaEventQuery of NCCL's end event) without sleeping: it wakes
    within microseconds, as current_stream().synchronize() after wait() would, but unlike
    a synchronize it can give up after `timeout_s`. Then work.wait() orders the current
    stream after the work (already done) and raises its error if it failed."""
    if timeout_s:
        limit = datetime.timedelta(seconds=timeout_s)
    if torch.device(device).type == "cuda":
        # NCCL's watchdog thread times every work out at the group's own timeout (the
        # lab's --timeout too) and then tears the process down (TORCH_NCCL_ASYNC_ERROR_
        # HANDLING's default): giving up at the same moment would race it, and the lab's
        # one line could be lost in the abort. The thread gives up first, at 0.8 of it,
        # and never calls a wait that would abort the communicator itself.
        give_up_s = NCCL_GIVE_UP_FRACTION * timeout_s if timeout_s else math.inf
        deadline = time.perf_counter() + give_up_s
        while not work.is_completed():
            if time.perf_counter() > deadline:
                raise RuntimeError(f"not done within {give_up_s:g} s")
    if timeout_s:
        work.wait(timeout=limit)
    else:
        work.wait()

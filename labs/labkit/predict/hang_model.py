"""Where each rank of a job that fell out of step waits, and for how long: the prediction
of the hang lab (labs/hang.py). Pure functions, no process group, no torch.

A process group matches its collectives by order: every rank's n-th collective on the group
meets the other ranks' n-th, whatever it is (PyTorch's process groups expect every rank to
issue the same calls in the same order, and check nothing of it). At each place in that
order, one of five things happens:

  the same operation on the same sizes   it completes, once the last rank arrives; if the
                                         n-th collectives were different steps of the
                                         program, it pairs the wrong data without a word
  a rank that arrives later than the     the ranks that were there give up after the
  timeout                                group's timeout; the late rank says nothing
  no call from a rank (it has left)      the backend decides: its connections close
  different operations                   on gloo, which tags each message with its kind
                                         of operation, none of them completes: every
                                         rank waits there until the group's timeout; on
                                         NCCL, which tags nothing (a barrier is a
                                         one-element all-reduce), the backend decides
  the same operation on other sizes      the backend decides (gloo aborts when a message is
                                         longer than its buffer, NCCL reads the bytes it
                                         expects)

With TORCH_DISTRIBUTED_DEBUG=DETAIL the group compares every collective's operation and
sizes across the ranks before running it, and names the last two at once, on every rank.

  Collective        one call a rank issues: what it says it was doing (label), the
                    operation, its number of elements, and how late the rank issues it
  lab_program       the collectives rank r of labs/hang.py issues, for each --mode
  where_ranks_wait  {rank: Wait(label, seconds, why)} for the ranks that end with a
                    message, at the first place where the ranks' collectives do not all
                    complete; {} when every one completes
"""

import dataclasses

MODES = ("none", "skip_collective", "wrong_shape", "sleep")
# what where_ranks_wait says about each waiting rank
TIMEOUT, NAMED, BACKEND = "timeout", "named at once", "up to the backend"


@dataclasses.dataclass(frozen=True)
class Collective:
    label: str            # what the rank says it was doing: "the all-reduce of step 2"
    op: str               # "all_reduce", "barrier", ...
    numel: int = 0        # elements each rank contributes (0 for a barrier)
    late_s: float = 0.0   # time the rank spends outside any collective before issuing it


@dataclasses.dataclass(frozen=True)
class Wait:
    label: str                # the collective the rank ends in
    seconds: float | None     # how long it waits there (None: up to the backend)
    why: str                  # TIMEOUT, NAMED or BACKEND


def lab_program(mode, rank, steps, at_step, breaking_rank, numel, timeout_s):
    """The collectives rank `rank` of the hang lab issues: one all-reduce of `numel`
    elements per step, then a barrier; in step `at_step`, `breaking_rank` skips its
    all-reduce, sends one element more, or sleeps 2 s past the timeout before it."""
    breaks = rank == breaking_rank and mode != "none"
    program = []
    for step in range(steps):
        sent, late_s = numel, 0.0
        if breaks and step == at_step:
            if mode == "skip_collective":
                continue
            if mode == "wrong_shape":
                sent += 1
            else:   # sleep
                late_s = timeout_s + 2
        program.append(Collective(f"the all-reduce of step {step}", "all_reduce", sent, late_s))
    program.append(Collective("the final barrier", "barrier"))
    return program


def where_ranks_wait(programs, timeout_s, checked=False, backend="gloo"):
    """Walk the ranks' programs (one list of Collective per rank, in the order issued) place
    by place, and return {rank: Wait} for the ranks that end
    with a message at the first place where not every collective completes (a rank that is
    still late then is missing from it: it says nothing). checked: the process group
    compares every collective's operation and sizes across the ranks before running it
    (TORCH_DISTRIBUTED_DEBUG=DETAIL). backend: "gloo" tags each message with its kind of
    operation, so different operations never pair; "nccl" tags nothing, and runs a barrier
    as a one-element all-reduce: there what differs in kind or size is up to the backend,
    and a barrier meeting a one-element all-reduce completes."""
    now = 0.0   # when the ranks left the previous collective: together, once it completed
    for place in range(max(len(p) for p in programs)):
        calls = {rank: p[place] for rank, p in enumerate(programs) if place < len(p)}
        if len(calls) < len(programs):
            # a rank has left (its program ended): its connections close under the others
            return {rank: Wait(c.label, None, BACKEND) for rank, c in calls.items()}
        # DETAIL compares what the program called; the backend sees only what it sends
        ops, sizes = {c.op for c in calls.values()}, {c.numel for c in calls.values()}
        if checked and (len(ops) > 1 or len(sizes) > 1):
            return {rank: Wait(c.label, 0.0, NAMED) for rank, c in calls.items()}
        if backend == "nccl":   # a barrier is a one-element all-reduce there
            sent = [("all_reduce", 1) if c.op == "barrier" else (c.op, c.numel)
                    for c in calls.values()]
            ops, sizes = {op for op, _ in sent}, {numel for _, numel in sent}
        elif len(ops) > 1:
            # another operation: nothing matches, and every rank waits it out
            return {rank: Wait(c.label, timeout_s, TIMEOUT) for rank, c in calls.items()}
        if len(ops) > 1 or len(sizes) > 1:
            return {rank: Wait(c.label, None, BACKEND) for rank, c in calls.items()}
        arrived = {rank: now + c.late_s for rank, c in calls.items()}
        last = max(arrived.values())
        gave_up = {rank for rank, t in arrived.items() if last - t > timeout_s}
        if gave_up:
            return {rank: Wait(calls[rank].label, timeout_s, TIMEOUT) for rank in gave_up}
        now = last
    return {}

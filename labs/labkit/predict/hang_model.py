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
  no call from a rank (it has left:      on gloo, its connections close and the others
  its process exited)                    fail at once; on NCCL they wait for the timeout
                                         (the timeout ends the wait: wait() under blocking
                                         wait, as in the lab, else the watchdog)
  different operations                   on gloo, which tags each message with its kind
                                         of operation, none of them completes: every
                                         rank waits there until the group's timeout; on
                                         NCCL, which tags nothing (a barrier is a
                                         one-element all-reduce), the backend decides
  the same operation on other sizes      the backend decides (gloo aborts when a message is
                                         longer than its buffer, NCCL reads the bytes it
                                         expects)

With TORCH_DISTRIBUTED_DEBUG=DETAIL every collective is preceded, on a helper gloo group, by
a monitored barrier (every rank reports to rank 0, which names the ranks that do not) and a
comparison of the collective's operation and sizes across the ranks: a mismatch is named at
once, on every rank; a rank that has left, at once, by rank 0 (its gloo connections close).

  Collective        one call a rank issues: what it says it was doing (label), the
                    operation, its number of elements, and how late the rank issues it
  lab_program       the collectives rank r of labs/hang.py issues, for each --mode
  where_ranks_wait  {rank: Wait(label, seconds, why)} for the ranks that end with a
                    message, at the first place where the ranks' collectives do not all
                    complete; {} when every one completes; on "gloo" or "nccl"
  collective_waits  {rank: seconds} each rank spends waiting inside the collectives that
                    complete: a straggler makes the others wait, and waits least itself
  flight_recorder_env, flight_recorder_default_entries
                    what to set, by torch release, for every rank of an NCCL job to keep
                    its last collectives and write them out when one times out; what the
                    recorder keeps when nothing is set
"""

import dataclasses

MODES = ("none", "skip_collective", "wrong_shape", "sleep", "exit")
BACKENDS = ("gloo", "nccl")
# what where_ranks_wait says about each waiting rank
TIMEOUT, NAMED, BACKEND = "timeout", "named at once", "up to the backend"
CLOSED = "connection closed"
# PyTorch's flight recorder, by release (FlightRecorder.hpp, ProcessGroupNCCL.hpp): from
# 2.8 it reads TORCH_FR_BUFFER_SIZE and TORCH_FR_DUMP_TEMP_FILE first, and the older names
# (TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE) with a deprecation
# warning; up to 2.10 its buffer defaults to 0 entries, nothing recorded; from 2.11, to
# 2000 (pytorch PR #172843). TORCH_NCCL_DUMP_ON_TIMEOUT keeps its name throughout (its
# default: off unless TORCH_DISTRIBUTED_DEBUG=DETAIL before pytorch PR #143446, on since).
# ProcessGroupNCCL writes a dump only if TORCH_NCCL_TRACE_BUFFER_SIZE, which it alone reads
# (2000 if unset in the releases that read TORCH_FR_*), is above 0: a 0 under either name
# silences the recorder.
FR_RENAMED, FR_KEEPS_BY_DEFAULT = (2, 8), (2, 11)
FR_ENTRIES = 2000
FR_BUFFER_SIZES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")


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
    all-reduce, sends one element more, sleeps 2 s past the timeout before it, or exits
    (its program ends there)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    breaks = rank == breaking_rank and mode != "none"
    program = []
    for step in range(steps):
        sent, late_s = numel, 0.0
        if breaks and step == at_step:
            if mode == "exit":
                return program
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
    by place, and return {rank: Wait} for the ranks that end with a message at the first
    place where not every collective completes (a rank that is still late then is missing
    from it: it says nothing).

    checked: the process group checks every collective first (TORCH_DISTRIBUTED_DEBUG=
    DETAIL): a monitored barrier, then the operations and sizes compared, both over a
    helper gloo group, whatever the backend. backend: "gloo" tags each message with its
    kind of operation, so different operations never pair; "nccl" tags nothing, and runs a
    barrier as a one-element all-reduce: there what differs in kind or size is up to the
    backend, and a barrier meeting a one-element all-reduce completes.

    A rank whose program ends before the others' has left: its process exited. Its gloo
    connections close, and the ranks waiting on them fail at once (a rank waiting on
    another that failed, at once too); NCCL's transports do not tell, and the others wait
    for the timeout. Checked, the monitored barrier meets the closed connections first:
    rank 0 names the missing ranks at once, and the others fail with it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    now = 0.0   # when the ranks left the previous collective: together, once it completed
    for place in range(max(len(p) for p in programs)):
        calls = {rank: p[place] for rank, p in enumerate(programs) if place < len(p)}
        if len(calls) < len(programs):
            # a rank has left (its program ended, its process exited)
            if checked:
                return {rank: Wait(c.label, 0.0, NAMED if rank == 0 else CLOSED)
                        for rank, c in calls.items()}
            if backend == "gloo":
                return {rank: Wait(c.label, 0.0, CLOSED) for rank, c in calls.items()}
            return {rank: Wait(c.label, timeout_s, TIMEOUT) for rank, c in calls.items()}
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


def collective_waits(programs, timeout_s):
    """{rank: seconds} each rank spends inside the collectives that complete, waiting for
    the last rank to arrive (up to the first place where not all complete, as in
    where_ranks_wait). Every rank leaves a collective when the last one arrives, so every
    rank's step takes as long as the slowest rank's: step times do not tell the ranks
    apart, the waits do. The straggler is the rank that waits least (nothing, when it is
    the last to arrive everywhere); its lateness is the others' wait."""
    waits, now = {rank: 0.0 for rank in range(len(programs))}, 0.0
    for place in range(min(len(p) for p in programs)):
        calls = [p[place] for p in programs]
        if len({(c.op, c.numel) for c in calls}) > 1:
            break
        arrived = [now + c.late_s for c in calls]
        last = max(arrived)
        if any(last - t > timeout_s for t in arrived):
            break
        for rank, t in enumerate(arrived):
            waits[rank] += last - t
        now = last
    return waits


def torch_release(version):
    """(major, minor) of a torch version string: "2.13.0+cpu" -> (2, 13)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()))


def flight_recorder_default_entries(torch_version):
    """Entries the flight recorder keeps when no variable sets it: 0 (it records nothing)
    up to torch 2.10, 2000 from 2.11."""
    return FR_ENTRIES if torch_release(torch_version) >= FR_KEEPS_BY_DEFAULT else 0


def flight_recorder_env(torch_version, prefix, entries=FR_ENTRIES):
    """{variable: value} that makes every rank of an NCCL job keep its last `entries`
    collectives and, when one times out or fails, write them to `prefix`<global rank>:
    the names the given torch release reads first, so that none warns of a deprecated one.
    (The dump is written by ProcessGroupNCCL's threads: none with TORCH_NCCL_BLOCKING_WAIT;
    and none if an inherited TORCH_NCCL_TRACE_BUFFER_SIZE is 0, which a caller must refuse
    or override: FR_BUFFER_SIZES.)"""
    if torch_release(torch_version) >= FR_RENAMED:
        size, dump_file = "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    else:
        size, dump_file = "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
    return {size: str(entries), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", dump_file: prefix}

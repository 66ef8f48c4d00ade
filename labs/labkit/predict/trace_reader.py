"""Reading a torch.profiler trace: per rank, how long a step computed, communicated, and
waited, and how much of its communication no computation hid. No torch: the same code
reads a trace in labs/trace.py and in the reader's browser.

A trace is the Chrome-trace JSON that torch.profiler's export_chrome_trace writes, one
file per rank: {"traceEvents": [...], "distributedInfo": {"rank": r, ...}, ...}. Complete
events ("ph": "X") carry a start "ts" and a duration "dur", in microseconds.

What counts as what, within the profiled steps (torch.profiler's "ProfilerStep#n"
annotations, the window every figure is measured in):

  CUDA traces   (a trace with events of category "kernel"): the kernels only, as
                HolisticTraceAnalysis classifies them. Kernels named nccl... are
                communication, the others computation, whatever stream they ran on; the
                window runs from the first kernel of the profiled steps to the last.
  CPU traces    (gloo): communication is what gloo records: a collective as one
                "gloo:<collective>" annotation on one of gloo's worker threads, from the
                moment it starts to the moment it completes; a send or a receive as
                "gloo:send" or "gloo:recv" on the calling thread, from the isend or irecv
                until its wait returns (so a send waited for late stays open meanwhile).
                Computation is the own time of ATen's operators ("aten::...", cat cpu_op)
                on the threads that run the model (those holding the step annotations):
                the time each ran itself, not inside an operator it called. The rest of
                such a thread's time (autograd's nodes, hooks, Python) is bookkeeping, and
                a hook that waits for a collective (DDP's reducer, FSDP2's gathers and
                reductions in backward) waits there, recording no operator of its own: that
                time is exposed communication or idle time, never computation.

Per rank (analyze): compute_s and communication_s, each the union of its intervals;
exposed_communication_s, communication no computation overlaps; overlap_fraction,
1 - exposed / communication; idle_s, neither computing nor communicating;
not_computing_fraction, the share of the window spent not computing; collectives, a count
by kind; and bubble_fraction, for a pipeline stage (a trace whose collectives are sends
and receives), that same share: the schedule's bubble and the transfers no computation
hid, which the pipeline lab measures as a stage's idle share.
"""

import gzip
import json
import re

STEP = re.compile(r"^ProfilerStep#\d+$")
# collective kinds, from NCCL kernel names (ncclDevKernel_AllReduce_Sum_f32_RING_LL,
# ncclKernel_AllGather_RING_LL_Sum_int8_t, ncclDevKernel_SendRecv) and gloo's annotations
KINDS = (("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
         ("allgather", "all_gather"), ("all_gather", "all_gather"),
         ("reducescatter", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
         ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
         ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send"),
         ("recv", "recv"), ("barrier", "barrier"), ("reduce", "reduce"),
         ("gather", "gather"), ("scatter", "scatter"))
POINT_TO_POINT = {"send", "recv", "send_recv"}
# c10d operators on the model's thread that only hand work to the backend, or wait on it
HANDOFF = re.compile(r"^c10d::|^record_param_comms$|wait", re.IGNORECASE)


class TraceError(ValueError):
    """A file that cannot be read as a profiled step: one line saying why."""


def load(text, name="trace"):
    """The trace in `text` (a JSON string), or TraceError saying in one line why not."""
    try:
        trace = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise TraceError(f"{name}: not a trace (not JSON; torch.profiler's "
                         f"export_chrome_trace writes JSON)") from None
    if isinstance(trace, list):   # the Chrome-trace array form
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{name}: a trace of another format (no traceEvents list, as a "
                         f"Chrome trace has)")
    return trace


def load_file(path):
    """load() of the file at `path`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise TraceError(f"{path}: {error.strerror}") from None
    if data[:2] == b"\x1f\x8b":   # tensorboard_trace_handler(use_gzip=True) writes .json.gz
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise TraceError(f"{path}: a broken .gz file ({error})") from None
    return load(data.decode("utf-8", errors="replace"), str(path))


def union(intervals):
    """Sorted, non-overlapping [start, end] covering the same time as `intervals`."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals):
    return sum(end - start for start, end in intervals)


def subtract(intervals, remove):
    """The parts of `intervals` (merged) that `remove` (merged) does not cover."""
    result, j = [], 0
    for start, end in intervals:
        while j < len(remove) and remove[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(remove) and remove[k][0] < end:
            if remove[k][0] > cursor:
                result.append([cursor, remove[k][0]])
            cursor = max(cursor, remove[k][1])
            k += 1
        if cursor < end:
            result.append([cursor, end])
    return result


def intersect(intervals, window):
    """The parts of `intervals` (merged) inside `window` (merged)."""
    result, i, j = [], 0, 0
    while i < len(intervals) and j < len(window):
        start = max(intervals[i][0], window[j][0])
        end = min(intervals[i][1], window[j][1])
        if start < end:
            result.append([start, end])
        if intervals[i][1] < window[j][1]:
            i += 1
        else:
            j += 1
    return result


def within(start, window):
    """Whether the instant `start` falls in the merged `window`."""
    return any(low <= start <= high for low, high in window)


def collective_kind(name):
    """all_reduce, all_gather, ... from an NCCL kernel's or a gloo annotation's name."""
    key = name.lower().replace("ncclkernel_", "").replace("nccldevkernel_", "")
    key = key.replace("gloo:", "")
    for pattern, kind in KINDS:
        if key.startswith(pattern):
            return kind
    return "other"


def is_work(name):
    """Whether a CPU operator computes: ATen's operators do the arithmetic and the copies;
    the rest on the thread (autograd's nodes, hooks, Python) is bookkeeping around them, and
    where a hook waits for a collective (DDP's reducer, FSDP2's gathers and reductions in
    backward), the wait is recorded as that bookkeeping's own time."""
    return name.startswith("aten::") and not HANDOFF.search(name)


def own_time(ops):
    """[start, end] in which an operator of `ops` (a thread's operators, which nest) that
    is_work ran itself, not inside another operator it called: an operator's time inside
    a call it made is the call's."""
    intervals, stack = [], []   # [start, end, own start, is work, thread] of open operators

    def close(top):
        if top[3] and top[2] < top[1]:
            intervals.append([top[2], top[1]])

    for e in sorted(ops, key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"])):
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and (stack[-1][4] != (e["pid"], e["tid"]) or stack[-1][1] <= start):
            close(stack.pop())
        if stack:   # the parent's own time stops where this call starts, resumes after it
            parent = stack[-1]
            if parent[3] and parent[2] < start:
                intervals.append([parent[2], start])
            parent[2] = max(parent[2], min(end, parent[1]))
        stack.append([start, end, start, is_work(str(e.get("name", ""))),
                      (e["pid"], e["tid"])])
    while stack:
        close(stack.pop())
    return intervals


def classify(trace, name="trace"):
    """{kind, steps, window, compute, communication, collectives} of one rank's trace: the
    profiled steps' window and the merged [start, end] intervals (microseconds) in it that
    computed and that communicated, with the communication events' names; TraceError
    where it holds no profiled step."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
              and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    steps = [e for e in events if STEP.match(str(e.get("name", "")))]
    if not steps:
        raise TraceError(f"{name}: no profiled steps (no ProfilerStep#n annotation: profile "
                         f"with a schedule and call prof.step() after every step)")
    step_window = union([e["ts"], e["ts"] + e["dur"]] for e in steps)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        kind = "cuda"
        # a kernel belongs to the steps whose CPU side launched it (the launch shares its
        # "correlation" id); the GPU runs behind the CPU, so its window is the kernels'
        launched = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
        ours = []
        for e in kernels:
            launch = launched.get((e.get("args") or {}).get("correlation"))
            if within(launch, step_window) if launch is not None else \
                    intersect([[e["ts"], e["ts"] + e["dur"]]], step_window):
                ours.append(e)
        if not ours:
            raise TraceError(f"{name}: no kernels ran in the profiled steps")
        window = [[min(e["ts"] for e in ours), max(e["ts"] + e["dur"] for e in ours)]]
        comm, computing = [], []
        for e in ours:
            if str(e.get("name", "")).lower().startswith("nccl"):
                comm.append(e)
            else:
                computing.append([e["ts"], e["ts"] + e["dur"]])
    else:
        kind = "cpu"
        window = step_window
        model_threads = {(e.get("pid"), e.get("tid")) for e in steps}
        comm = [e for e in events if str(e.get("name", "")).startswith("gloo:")
                and intersect([[e["ts"], e["ts"] + e["dur"]]], window)]
        computing = own_time([e for e in events if e.get("cat") == "cpu_op"
                              and (e.get("pid"), e.get("tid")) in model_threads])
    return {"kind": kind, "steps": len(steps), "window": window,
            "compute": intersect(union(computing), window),
            "communication": intersect(union([e["ts"], e["ts"] + e["dur"]] for e in comm),
                                       window),
            "collectives": [str(e["name"]) for e in comm]}


def analyze(trace, name="trace"):
    """{rank, kind, steps, window_s, compute_s, communication_s, exposed_communication_s,
    overlap_fraction, idle_s, not_computing_fraction, collectives} of one rank's trace."""
    parts = classify(trace, name)
    window, comm_time, compute_time = parts["window"], parts["communication"], parts["compute"]
    exposed = subtract(comm_time, compute_time)
    busy = union(comm_time + compute_time)
    window_us = length(window)
    communication = length(comm_time)
    counts = {}
    for collective in parts["collectives"]:
        kind_of = collective_kind(collective)
        counts[kind_of] = counts.get(kind_of, 0) + 1
    not_computing = 1 - length(compute_time) / window_us if window_us else None
    info = trace.get("distributedInfo") or {}
    return {"rank": info.get("rank", 0), "kind": parts["kind"], "steps": parts["steps"],
            "window_s": window_us / 1e6, "compute_s": length(compute_time) / 1e6,
            "communication_s": communication / 1e6,
            "exposed_communication_s": length(exposed) / 1e6,
            "overlap_fraction": (1 - length(exposed) / communication) if communication else None,
            "idle_s": (window_us - length(busy)) / 1e6,
            "not_computing_fraction": not_computing,
            "bubble_fraction": not_computing if counts and set(counts) <= POINT_TO_POINT
            else None,
            "collectives": dict(sorted(counts.items()))}


def memory_timeline(trace, device="cpu"):
    """[(seconds since the profiled steps began, bytes allocated)] on `device` (cpu or cuda):
    torch.profiler's "[memory]" events (recorded with profile_memory=True), one per
    allocation and free, inside the profiled steps, with the allocator's running total.
    On CPU that total is kept only while memory profiling is on, net of frees: in a
    process's first profile it starts near zero and shows what the steps allocate and
    free, not what the process held before (a later profile starts where it left off).
    On CUDA it is the caching allocator's memory_allocated(), everything the process
    holds."""
    device_type = {"cpu": 0, "cuda": 1}[device]
    steps = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
             and STEP.match(str(e.get("name", "")))]
    if not steps:
        raise TraceError("no profiled steps (no ProfilerStep#n annotation)")
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    return [((e["ts"] - start) / 1e6, e["args"]["Total Allocated"])
            for e in trace["traceEvents"]
            if isinstance(e, dict) and e.get("name") == "[memory]"
            and isinstance(e.get("args"), dict) and e["args"].get("Device Type") == device_type
            and "Total Allocated" in e["args"] and start <= e.get("ts", -1) <= end]


def analyze_all(named_traces):
    """{"ranks": {rank: analyze() and its "file"}} of [(name, trace)], one trace per rank;
    TraceError for a second trace of one rank."""
    ranks = {}
    for name, trace in named_traces:
        result = analyze(trace, name)
        if result["rank"] in ranks:
            raise TraceError(f"{name}: a second trace of rank {result['rank']}")
        ranks[result["rank"]] = {**result, "file": name}
    return {"ranks": dict(sorted(ranks.items()))}


def analyze_texts(named_texts):
    """analyze_all of [(name, JSON text)]: what a page that was handed the files reads."""
    return analyze_all([(name, load(text, name)) for name, text in named_texts])

"""Reading a torch.profiler trace: per rank, how long a step computed, communicated, and
waited, and how much of its communication no computation hid. No torch: the same code
reads a trace in labs/trace.py and in the reader's browser.

A trace is the Chrome-trace JSON that torch.profiler's export_chrome_trace writes, one
file per rank: {"traceEvents": [...], "distributedInfo": {"rank": r, ...}, ...}. Complete
events ("ph": "X") carry a start "ts" and a duration "dur", in microseconds.

What counts as what, within the profiled steps (torch.profiler's "ProfilerStep#n"
annotations, the window every figure is measured in):

  CUDA traces   (a trace with events of category "kernel"): the GPU's events, kernels and
                memory copies and sets (categories gpu_memcpy, gpu_memset), that the CPU
                launched inside the profiled steps (the launch shares the event's
                "correlation" id; an event with no launch record counts if it ran inside
                the steps). A kernel is communication if its args name a collective
                ("Collective name", which Kineto copies from torch's record_param_comms
                onto the kernels it launched) or its name starts with nccl; a memory copy
                or set is communication if record_param_comms launched it (NCCL >= 2.28
                runs some collectives on the copy engine), else a memory copy, as are
                kernels named Memcpy/Memset; every other kernel computes, whatever stream
                it ran on. These are HolisticTraceAnalysis's classes (hta/common/types.py),
                with the collective's args read first. The window runs from the first of
                these events to the last.
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
1 - exposed / communication; memory_copy_s, memory copies and sets during which nothing
computed or communicated; idle_s, none of these; so the window is compute + exposed +
memory copy + idle. not_computing_fraction, the share of the window spent not computing;
collectives, a count by kind (of kernels on a GPU: a grouped or coalesced operation is one
kernel, and a group of one rank launches none); per_collective, each one's kind, group,
bytes and, where the args give its size, algorithm and bus bandwidth (nccl-tests'
definitions, comm_model.bus_bandwidth); exposed_by_group_s, the exposed communication of
each process group; and bubble_fraction, for a pipeline stage (a trace whose collectives
are all sends and receives, not an all-to-all), the share of the window not computing.

Across ranks (analyze_all): stragglers, from the k-th collective of each process group
matched across ranks: the rank that started it last is the one the others waited for.
"""

import gzip
import json
import re

from . import comm_model

STEP = re.compile(r"^ProfilerStep#\d+$")
# collective kinds, matched on a name lowercased and without underscores: NCCL's kernels
# (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ncclKernel_AllGather_RING_LL_Sum_int8_t,
# ncclDevKernel_SendRecv, ncclSymkDevKernel_AllGather_...), gloo's annotations
# (gloo:all_reduce), and the "Collective name" torch records (allreduce, _allgather_base,
# reduce_scatter_tensor_coalesced, all_to_allv, send)
KINDS = (("allreduce", "all_reduce"), ("allgather", "all_gather"),
         ("reducescatter", "reduce_scatter"), ("alltoall", "all_to_all"),
         ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send"),
         ("recv", "recv"), ("barrier", "barrier"), ("reduce", "reduce"),
         ("gather", "gather"), ("scatter", "scatter"))
PREFIXES = ("nccldevkernel", "ncclkernel", "ncclsymkdevkernel", "gloo:", "nccl:", "c10d::")
POINT_TO_POINT = {"send", "recv", "send_recv"}
# c10d operators on the model's thread that only hand work to the backend, or wait on it
HANDOFF = re.compile(r"^c10d::|^record_param_comms$|wait", re.IGNORECASE)
# HolisticTraceAnalysis's memory class (hta/common/types.py, MemoryKernelGroupingPattern)
MEMORY = re.compile(r"^(hip)?Memcpy|^(hip)?Memset|^dma")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# the op torch records around each collective; Kineto copies its args onto the kernels
PARAM_COMMS = "record_param_comms"
# the args a collective's kernel carries (torch/csrc/profiler/util.h, kCommsName ...)
COLLECTIVE_ARGS = ("Collective name", "In msg nelems", "Out msg nelems", "Group size",
                   "dtype", "Process Group Name", "Process Group Description",
                   "Process Group Ranks")
# bytes per element of the dtype names torch records (c10's ScalarType names)
DTYPE_BYTES = {"Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
               "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8,
               "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
               "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "Float8_e8m0fnu": 1,
               "UInt16": 2, "UInt32": 4, "UInt64": 8}


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
    """all_reduce, all_gather, ... from an NCCL kernel's or a gloo annotation's name, or a
    "Collective name" arg; "other" for what names none (NCCL's "coalesced")."""
    key = str(name).lower()
    for prefix in PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
    key = key.replace("_", "")
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


def launching_ops(events):
    """{correlation: the CPU operators around that launch on its thread, innermost last}:
    the innermost is what Kineto links a GPU event to ("External id"), found here by
    nesting so that traces older than the collective args read the same."""
    marks = [(e["pid"], e["tid"], e["ts"], 0, -e["dur"], i) for i, e in enumerate(events)
             if e.get("cat") == "cpu_op"]
    marks += [(e["pid"], e["tid"], e["ts"], 1, 0, i) for i, e in enumerate(events)
              if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in (e.get("args") or {})]
    found, stack = {}, []
    for pid, tid, ts, is_launch, _, i in sorted(marks, key=lambda m: m[:5]):
        while stack and (stack[-1][0] != (pid, tid) or stack[-1][1] <= ts):
            stack.pop()
        e = events[i]
        if is_launch:
            if stack:
                found[e["args"]["correlation"]] = [op for _, _, op in stack]
        else:
            stack.append(((pid, tid), ts + e["dur"], e))
    return found


def collective_of(event, ops):
    """{kind, group, group_size, bytes} of a communication event: from its own collective
    args, else from those of the record_param_comms that launched it (`ops`, innermost
    last), else from the c10d operator that did (an older trace: c10d::alltoall_base_
    launching ncclKernel_SendRecv), else from its name; sizes None where no args give them."""
    args = event.get("args") or {}
    for op in reversed(ops):
        if "Collective name" in args:
            break
        args = op.get("args") or {}
    if "Collective name" not in args:
        args = event.get("args") or {}
    named = [str(op.get("name", "")) for op in reversed(ops)
             if str(op.get("name", "")).startswith(("c10d::", "nccl:"))]
    kind = collective_kind(args.get("Collective name") or (named or [event.get("name", "")])[0])
    group = args.get("Process Group Description") or args.get("Process Group Name")
    size = args.get("Group size")
    elements = [args.get(k) for k in ("In msg nelems", "Out msg nelems")
                if isinstance(args.get(k), (int, float))]
    width = DTYPE_BYTES.get(args.get("dtype"))
    # nccl-tests' size S: the larger buffer (all-gather's output, reduce-scatter's input)
    message = int(max(elements) * width) if elements and width else None
    return {"kind": kind, "group": str(group) if group is not None else None,
            "group_size": int(size) if isinstance(size, (int, float)) else None,
            "bytes": message}


def bandwidths(record):
    """The record with its algorithm bandwidth (bytes / duration) and bus bandwidth (times
    nccl-tests' factor, comm_model.BUSBW_FACTORS), in bytes/s; None where unknown. A
    kernel's duration includes its wait for the last rank, so both are lower bounds."""
    seconds, message, n = record["dur_s"], record["bytes"], record["group_size"]
    algbw = message / seconds if message is not None and seconds > 0 else None
    busbw = comm_model.bus_bandwidth(record["kind"], message, seconds, n) \
        if algbw is not None and n and record["kind"] in comm_model.BUSBW_FACTORS else None
    return {**record, "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw}


def classify(trace, name="trace"):
    """{kind, steps, window, compute, communication, memory_copy, collectives,
    per_collective} of one rank's trace: the profiled steps' window and the merged [start,
    end] intervals (microseconds) in it that computed, communicated and copied memory,
    with the communication events' names and one record for each; TraceError where it
    holds no profiled step."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
              and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    steps = [e for e in events if STEP.match(str(e.get("name", "")))]
    if not steps:
        raise TraceError(f"{name}: no profiled steps (no ProfilerStep#n annotation: profile "
                         f"with a schedule and call prof.step() after every step)")
    step_window = union([e["ts"], e["ts"] + e["dur"]] for e in steps)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    records, copies = [], []
    if any(e.get("cat") == "kernel" for e in gpu):
        kind = "cuda"
        # an event belongs to the steps whose CPU side launched it (the launch shares its
        # "correlation" id); the GPU runs behind the CPU, so its window is the events'
        launched = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
        ops = launching_ops(events)
        ours = []
        for e in gpu:
            launch = launched.get((e.get("args") or {}).get("correlation"))
            if within(launch, step_window) if launch is not None else \
                    intersect([[e["ts"], e["ts"] + e["dur"]]], step_window):
                ours.append(e)
        if not ours:
            raise TraceError(f"{name}: no kernels ran in the profiled steps")
        window = [[min(e["ts"] for e in ours), max(e["ts"] + e["dur"] for e in ours)]]
        comm, computing = [], []
        for e in ours:
            event_name = str(e.get("name", ""))
            chain = ops.get((e.get("args") or {}).get("correlation"), [])
            copy = e.get("cat") != "kernel" or MEMORY.match(event_name)
            # a kernel by its name, as HTA; a copy by what launched it: a collective's
            if (event_name.lower().startswith("nccl") and not copy) or (copy and (
                    "Collective name" in (e.get("args") or {})
                    or (chain and chain[-1].get("name") == PARAM_COMMS))):
                comm.append(e)
                records.append({"name": event_name, "start_us": e["ts"], "dur_s": e["dur"] / 1e6,
                                **collective_of(e, chain)})
            elif copy:
                copies.append([e["ts"], e["ts"] + e["dur"]])
            else:
                computing.append([e["ts"], e["ts"] + e["dur"]])
    else:
        kind = "cpu"
        window = step_window
        model_threads = {(e.get("pid"), e.get("tid")) for e in steps}
        comm = [e for e in events if str(e.get("name", "")).startswith("gloo:")
                and intersect([[e["ts"], e["ts"] + e["dur"]]], window)]
        records = [{"name": str(e["name"]), "start_us": e["ts"], "dur_s": e["dur"] / 1e6,
                    "kind": collective_kind(e["name"]), "group": None, "group_size": None,
                    "bytes": None} for e in comm]
        computing = own_time([e for e in events if e.get("cat") == "cpu_op"
                              and (e.get("pid"), e.get("tid")) in model_threads])
    return {"kind": kind, "steps": len(steps), "window": window,
            "compute": intersect(union(computing), window),
            "communication": intersect(union([e["ts"], e["ts"] + e["dur"]] for e in comm),
                                       window),
            "memory_copy": intersect(union(copies), window),
            "collectives": [r["kind"] for r in records],
            "per_collective": sorted((bandwidths(r) for r in records),
                                     key=lambda r: r["start_us"])}


def analyze(trace, name="trace"):
    """{rank, kind, steps, window_s, compute_s, communication_s, exposed_communication_s,
    overlap_fraction, memory_copy_s, idle_s, not_computing_fraction, bubble_fraction,
    collectives, exposed_by_group_s, per_collective} of one rank's trace."""
    parts = classify(trace, name)
    window, comm_time, compute_time = parts["window"], parts["communication"], parts["compute"]
    exposed = subtract(comm_time, compute_time)
    # a copy counts where nothing computed or communicated, so the parts add up to the window
    copying = subtract(parts["memory_copy"], union(comm_time + compute_time))
    busy = union(comm_time + compute_time + copying)
    window_us = length(window)
    communication = length(comm_time)
    counts = {}
    for kind_of in parts["collectives"]:
        counts[kind_of] = counts.get(kind_of, 0) + 1
    by_group = {}
    for r in parts["per_collective"]:
        start = r["start_us"]
        by_group.setdefault(r["group"] or "unknown", []).append(
            [start, start + r["dur_s"] * 1e6])
    not_computing = 1 - length(compute_time) / window_us if window_us else None
    info = trace.get("distributedInfo") or {}
    return {"rank": info.get("rank", 0), "kind": parts["kind"], "steps": parts["steps"],
            "window_s": window_us / 1e6, "compute_s": length(compute_time) / 1e6,
            "communication_s": communication / 1e6,
            "exposed_communication_s": length(exposed) / 1e6,
            "overlap_fraction": (1 - length(exposed) / communication) if communication else None,
            "memory_copy_s": length(copying) / 1e6,
            "idle_s": (window_us - length(busy)) / 1e6,
            "not_computing_fraction": not_computing,
            "bubble_fraction": not_computing if counts and set(counts) <= POINT_TO_POINT
            else None,
            "collectives": dict(sorted(counts.items())),
            # each group's own; where two groups communicate at once, both count that time
            "exposed_by_group_s": {group: length(subtract(intersect(union(spans), window),
                                                          compute_time)) / 1e6
                                   for group, spans in sorted(by_group.items())},
            "per_collective": parts["per_collective"],
            "base_time_us": (trace.get("baseTimeNanoseconds") or 0) / 1e3}


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


def stragglers(ranks):
    """{matched, by_rank, straggler, worst} across ranks (analyze()'s results by rank): the
    k-th collective of each process group on every rank that ran it is one collective.
    The rank that started it last is the one the others waited for; the shortest of its
    durations approximates the transfer itself, so each rank's duration beyond it is a
    wait, accounted to the last rank. by_rank: {rank: {last, caused_wait_s, waited_s}};
    straggler: the rank that caused the most waiting (None below two ranks); worst: the
    five latest arrivals. Start times add each file's baseTimeNanoseconds; ranks on
    different hosts compare only as well as their clocks agree. Sends and receives are
    left out (a pair, not a group), as is a collective two ranks name differently."""
    sequences = {}
    base = min((r["base_time_us"] for r in ranks.values()), default=0)
    for rank, r in ranks.items():
        seen = {}
        for c in r["per_collective"]:
            if c["kind"] in POINT_TO_POINT:
                continue
            group = c["group"] or "unknown"   # without args: one sequence per rank
            k = seen[group] = seen.get(group, -1) + 1
            sequences.setdefault((group, k), {})[rank] = (
                (r["base_time_us"] - base) + c["start_us"], c["dur_s"], c["kind"])
    by_rank = {rank: {"last": 0, "caused_wait_s": 0.0, "waited_s": 0.0} for rank in ranks}
    matched = []
    for (group, k), runs in sorted(sequences.items()):
        if len(runs) < 2 or len({kind for _, _, kind in runs.values()}) > 1:
            continue
        last = max(runs, key=lambda rank: runs[rank][0])
        transfer = min(dur for _, dur, _ in runs.values())
        waits = {rank: dur - transfer for rank, (_, dur, _) in runs.items()}
        by_rank[last]["last"] += 1
        by_rank[last]["caused_wait_s"] += sum(w for rank, w in waits.items() if rank != last)
        for rank, w in waits.items():
            by_rank[rank]["waited_s"] += w
        matched.append({"group": group, "index": k, "kind": runs[last][2], "last_rank": last,
                        "late_s": (runs[last][0] - min(t for t, _, _ in runs.values())) / 1e6,
                        "transfer_s": transfer, "waits_s": waits})
    causes = {rank: b["caused_wait_s"] for rank, b in by_rank.items() if b["last"]}
    return {"matched": len(matched), "by_rank": by_rank,
            "straggler": max(causes, key=causes.get) if causes else None,
            "worst": sorted(matched, key=lambda m: -m["late_s"])[:5]}


def analyze_all(named_traces):
    """{"ranks": {rank: analyze() and its "file"}, "stragglers": stragglers()} of [(name,
    trace)], one trace per rank; TraceError for a second trace of one rank."""
    ranks = {}
    for name, trace in named_traces:
        result = analyze(trace, name)
        if result["rank"] in ranks:
            raise TraceError(f"{name}: a second trace of rank {result['rank']}")
        ranks[result["rank"]] = {**result, "file": name}
    ranks = dict(sorted(ranks.items()))
    return {"ranks": ranks, "stragglers": stragglers(ranks)}


def analyze_texts(named_texts):
    """analyze_all of [(name, JSON text)]: what a page that was handed the files reads."""
    return analyze_all([(name, load(text, name)) for name, text in named_texts])

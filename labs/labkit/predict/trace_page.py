"""The trace page's entry point (book/your_trace.md): the reader's own torch.profiler traces,
one per rank, read by trace_reader, each rank's figures per profiled step, and beside them
the planner's prediction of a step for the model and layout the reader names (sizing.run's
answer for the same fields), with the exposed communication of each parallelism on both
sides; each rank's collectives by group, the rank the others waited for, and each rank's
intervals to draw on one clock. No torch: the page runs it in the browser with Pyodide.

The page hands over each file already slimmed in the browser (trace_compact's shape: only
the complete events, each with the fields trace_reader reads), so that a trace of hundreds
of megabytes reaches Python as a fraction of its size.
"""

from . import sizing, trace_reader

import re

# the planner's parts of a step that are communication no computation hid
EXPOSED_PARTS = ("tp", "pp", "dp", "cp", "ep")
# a process group's part, from the description torch's DeviceMesh gives it ("mesh_" and
# the dimension's name, torch/distributed/device_mesh.py): torchtitan's dp_shard,
# dp_replicate and dp_shard_cp are data parallel, as FSDP's fsdp is
GROUP_PART = re.compile(r"^mesh_(?:(tp)|(pp)|(cp)|(ep)|(dp\w*|fsdp\w*))$")


def part_of(group):
    """tp, pp, cp, ep or dp for a DeviceMesh group's description; None for another."""
    found = GROUP_PART.match(str(group or ""))
    if not found:
        return None
    return ("tp", "pp", "cp", "ep", "dp")[next(i for i, g in enumerate(found.groups()) if g)]


def per_step(rank):
    """A rank's figures (trace_reader.analyze) per profiled step, in seconds."""
    steps = rank["steps"]
    return {"rank": rank["rank"], "file": rank["file"], "kind": rank["kind"], "steps": steps,
            "step_s": rank["window_s"] / steps, "compute_s": rank["compute_s"] / steps,
            "communication_s": rank["communication_s"] / steps,
            "exposed_communication_s": rank["exposed_communication_s"] / steps,
            "overlap_fraction": rank["overlap_fraction"],
            "memory_copy_s": rank["memory_copy_s"] / steps, "idle_s": rank["idle_s"] / steps,
            "not_computing_fraction": rank["not_computing_fraction"],
            "bubble_fraction": rank["bubble_fraction"],
            "collectives_per_step": {kind: count / steps
                                     for kind, count in rank["collectives"].items()},
            "exposed_by_group_s": {group: seconds / steps for group, seconds
                                   in rank["exposed_by_group_s"].items()},
            "exposed_by_part_s": exposed_by_part(rank["exposed_by_group_s"], steps),
            "collective_table": collective_table(rank)}


def exposed_by_part(by_group, steps):
    """{part: exposed seconds a step} of the groups whose description names a planner's
    part (two groups of one part add up)."""
    parts = {}
    for group, seconds in by_group.items():
        part = part_of(group)
        if part is not None:
            parts[part] = parts.get(part, 0.0) + seconds / steps
    return parts


def collective_table(rank):
    """A rank's collectives by process group and kind: {group, kind, per_step, bytes (the
    median message), median_s, busbw_bytes_per_s (the median; None without sizes)}."""
    rows = {}
    for c in rank["per_collective"]:
        rows.setdefault((c["group"] or "unknown", c["kind"]), []).append(c)
    def median(values):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else None
    return [{"group": group, "kind": kind, "per_step": len(found) / rank["steps"],
             "bytes": median(c["bytes"] for c in found),
             "median_s": median(c["dur_s"] for c in found),
             "busbw_bytes_per_s": median(c["busbw_bytes_per_s"] for c in found)}
            for (group, kind), found in sorted(rows.items())]


def timeline(trace, name="trace", limit=4000):
    """A rank's profiled steps to draw: {origin_us, compute, exposed, communication,
    memory_copy}, each a list of [start, end] in ms from the window's start, merged, at
    most `limit` intervals each (the longest kept, so a browser draws them quickly)."""
    parts = trace_reader.classify(trace, name)
    origin = parts["window"][0][0]
    exposed = trace_reader.subtract(parts["communication"], parts["compute"])
    def ms(intervals):
        kept = sorted(intervals, key=lambda i: i[0] - i[1])[:limit]
        return sorted([(s - origin) / 1e3, (e - origin) / 1e3] for s, e in kept)
    return {"origin_us": origin, "compute": ms(parts["compute"]), "exposed": ms(exposed),
            "communication": ms(parts["communication"]),
            "memory_copy": ms(parts["memory_copy"])}


def prediction(fields):
    """The planner's step for the reader's model and layout (or its best layout, if none
    is named), in the same parts: {layout, step_s, compute_s, exposed_communication_s,
    bubble_s, command}; None where the fields name no model."""
    if not str(fields.get("model", "") or "").strip():
        return None
    answer = sizing.run(fields)
    planned = answer.get("layout") or ((answer.get("planner") or {}).get("best") or [None])[0]
    if planned is None or planned.get("reason"):
        why = planned["reason"] if planned else "no layout fits"
        raise sizing.SizingError(f"the planner has no prediction for it: {why}")
    time_s = planned["time_s"]
    return {"layout": {key: planned[key] for key in ("tp", "pp", "dp", "cp", "ep", "zero",
                                                     "micro_batch", "microbatches",
                                                     "recompute")},
            "named": bool(answer.get("layout")),
            "step_s": time_s["step"], "compute_s": time_s["compute"] + time_s["recompute"],
            "exposed_communication_s": sum(time_s[part] for part in EXPOSED_PARTS),
            "exposed_by_part_s": {part: time_s[part] for part in EXPOSED_PARTS},
            "bubble_s": time_s["bubble"], "command": answer["command"]}


def answer(named_texts, fields):
    """{ranks: [per_step of each rank, by rank], prediction} of the files [(name, JSON
    text)] and the form's `fields`; trace_reader.TraceError or sizing.SizingError, one
    line, for what cannot be read."""
    traces = [(name, trace_reader.load(text, name)) for name, text in named_texts]
    result = trace_reader.analyze_all(traces)
    timelines = {}
    for name, trace in traces:
        info = trace.get("distributedInfo") or {}
        timelines[info.get("rank", 0)] = timeline(trace, name)
    # one clock for all ranks: each rank's origin against the earliest, in ms
    first = min(t["origin_us"] + r["base_time_us"] for t, r in
                zip(timelines.values(), (result["ranks"][k] for k in timelines)))
    for rank, t in timelines.items():
        t["offset_ms"] = (t.pop("origin_us") + result["ranks"][rank]["base_time_us"] - first) / 1e3
    return {"ranks": [per_step(r) for r in result["ranks"].values()],
            "stragglers": {key: result["stragglers"][key]
                           for key in ("matched", "by_rank", "straggler")},
            "timelines": [{"rank": rank, **timelines[rank]} for rank in sorted(timelines)],
            "prediction": prediction(fields)}

"""The trace page's entry point (book/your_trace.md): the reader's own torch.profiler traces,
one per rank, read by trace_reader, each rank's figures per profiled step, and beside them
the planner's prediction of a step for the model and layout the reader names (sizing.run's
answer for the same fields). No torch: the page runs it in the browser with Pyodide.

The page hands over each file already slimmed in the browser (trace_compact's shape: only
the complete events, each with the fields trace_reader reads), so that a trace of hundreds
of megabytes reaches Python as a fraction of its size.
"""

from . import sizing, trace_reader

# the planner's parts of a step that are communication no computation hid
EXPOSED_PARTS = ("tp", "pp", "dp", "cp", "ep")


def per_step(rank):
    """A rank's figures (trace_reader.analyze) per profiled step, in seconds."""
    steps = rank["steps"]
    return {"rank": rank["rank"], "file": rank["file"], "kind": rank["kind"], "steps": steps,
            "step_s": rank["window_s"] / steps, "compute_s": rank["compute_s"] / steps,
            "communication_s": rank["communication_s"] / steps,
            "exposed_communication_s": rank["exposed_communication_s"] / steps,
            "overlap_fraction": rank["overlap_fraction"], "idle_s": rank["idle_s"] / steps,
            "not_computing_fraction": rank["not_computing_fraction"],
            "bubble_fraction": rank["bubble_fraction"],
            "collectives_per_step": {kind: count / steps
                                     for kind, count in rank["collectives"].items()}}


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
            "bubble_s": time_s["bubble"], "command": answer["command"]}


def answer(named_texts, fields):
    """{ranks: [per_step of each rank, by rank], prediction} of the files [(name, JSON
    text)] and the form's `fields`; trace_reader.TraceError or sizing.SizingError, one
    line, for what cannot be read."""
    ranks = trace_reader.analyze_texts(named_texts)["ranks"]
    return {"ranks": [per_step(r) for r in ranks.values()], "prediction": prediction(fields)}

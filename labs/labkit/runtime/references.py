"""The GPU references under results/, as a chapter's "On a GPU box" section shows them.

`make gpu-references` (benchmarks/gpu_references.py) writes results/<gpu>-x<N>/<lab>.json
on a GPU box: the lab's own result under "result", and under "reference" what it ran on.
A lab's result names each prediction `predicted_<name>` beside the figure it predicts
(`<name>`, or `measured_<name>`); `figure_pairs` finds every such pair, and `section` is
the Markdown a chapter prints: for each box that ran the lab, what it ran on, then each
figure beside its prediction. Where no box has run it, it says so. `failures` is what a
box's summary.json says of the labs that did not run there, and `gpu_traces` and
`trace_section` the profiled steps it kept (results/<gpu>-x<N>/traces/<lab>/), read by
the course's trace reader.

Torch-free: the status page's build extension reads the same folder.
"""

import json
import math
import numbers
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[3] / "results"
# Predictions whose measured figure does not follow the naming rule
MEASURED_FOR = {"predicted_peak_bytes": "peak_cuda_bytes"}
# Fields that tell the entries of a list apart, in the order a label takes them
IDENTIFIERS = ("world_size", "strategy", "variant", "schedule", "microbatches", "rank",
               "name", "size_bytes", "numel", "library")
MAX_ROWS = 20   # the figures furthest from their predictions; the file has them all


def references(lab, results=None):
    """[(folder name, {"reference": ..., "result": ...})] for each box that ran `lab`."""
    results = RESULTS if results is None else Path(results)
    found = []
    for path in sorted(results.glob(f"*/{lab}.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "reference" in data and "result" in data:
            found.append((path.parent.name, data))
    return found


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _item_label(item, index, parent):
    """A list entry's name: its identifying fields, its rank in a list per rank, or #index."""
    if isinstance(item, dict):
        named = [f"{key} {item[key]}" for key in IDENTIFIERS if key in item][:2]
        if named:
            return ", ".join(named)
    return f"rank {index}" if parent.endswith("per_rank") else f"#{index}"


def _measured_key(mapping, key):
    rest = key[len("predicted_"):]
    for candidate in (MEASURED_FOR.get(key), rest, f"measured_{rest}"):
        if candidate and candidate in mapping:
            return candidate
    return None


def figure_pairs(result):
    """[(quantity, measured, predicted)]: every number a lab's result predicts, beside it."""
    rows = []

    def leaves(measured, predicted, path):
        if _is_number(measured) and _is_number(predicted):
            rows.append((" · ".join(path), measured, predicted))
        elif isinstance(measured, dict) and isinstance(predicted, dict):
            for key in predicted:
                if key in measured:
                    leaves(measured[key], predicted[key], [*path, str(key)])
        elif (isinstance(measured, list) and isinstance(predicted, list)
              and len(measured) == len(predicted)):
            for index, (m, p) in enumerate(zip(measured, predicted)):
                leaves(m, p, [*path, _item_label(m, index, path[-1] if path else "")])

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key.startswith("predicted_"):
                    measured = _measured_key(node, key)
                    if measured is not None:
                        leaves(node[measured], value, [*path, measured])
                elif isinstance(value, (dict, list)):
                    walk(value, [*path, key])
        elif isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, [*path, _item_label(item, index, path[-1] if path else "")])

    walk(result, [])
    return rows


def _format(value):
    if isinstance(value, numbers.Integral):
        return f"{value:,}"
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.4g}"


def _ratio(measured, predicted):
    if predicted == 0:
        return "exact" if measured == 0 else "–"
    return f"{measured / predicted:.3f}"


def _distance(measured, predicted):
    if measured == predicted:
        return 0.0
    if predicted == 0 or not (math.isfinite(measured) and math.isfinite(predicted)):
        return math.inf
    return abs(measured / predicted - 1)


def versions(reference):
    """'driver …, CUDA …, NCCL …, torch …', those the reference records."""
    return ", ".join(f"{name} {reference[key]}" for name, key in (
        ("driver", "driver_version"), ("CUDA", "cuda_version"), ("NCCL", "nccl_version"),
        ("torch", "torch_version")) if reference.get(key))


def describe(reference):
    """What a box ran on, in one sentence."""
    gpu = reference.get("gpu") or "CPU"
    return (f"{reference['world_size']} × {gpu}, {reference['backend']}, "
            f"{reference['date'][:10]} ({versions(reference)}): `{reference['command']}`")


def section(lab, results=None):
    """A chapter's GPU references for `lab`, as Markdown."""
    found = references(lab, results)
    if not found:
        return (f"No GPU reference is recorded for `labs/{lab}.py` yet. On a GPU box, "
                f"`make gpu-references` runs it with NCCL on every GPU and writes "
                f"`results/<gpu>-x<N>/{lab}.json`; the next build shows it here, each "
                f"figure beside its prediction.")
    parts = []
    for folder, data in found:
        rows = figure_pairs(data["result"])
        exact = sum(1 for _, m, p in rows if m == p)
        shown = sorted((row for row in rows if row[1] != row[2]),
                       key=lambda row: -_distance(row[1], row[2]))[:MAX_ROWS]
        parts.append(f"**{folder}**: {describe(data['reference'])}. Of its {len(rows)} "
                     f"predicted figures, {exact} equal their prediction exactly"
                     + (f"; the {len(shown)} furthest from it:" if shown else "."))
        if shown:
            lines = ["| figure | measured | predicted | measured / predicted |",
                     "| --- | ---: | ---: | ---: |"]
            lines += [f"| {name} | {_format(m)} | {_format(p)} | {_ratio(m, p)} |"
                      for name, m, p in shown]
            parts.append("\n".join(lines))
    return "\n\n".join(parts)


def boxes(results=None):
    """[(folder name, summary)] for each box's summary.json: what ran there, and when."""
    results = RESULTS if results is None else Path(results)
    return [(path.parent.name, json.loads(path.read_text()))
            for path in sorted(results.glob("*/summary.json"))]


def failures(summary):
    """[the first error line of each lab that did not run ok] in a box's summary.json, with
    the lab's name in front where the line does not start with it ("zero_libraries: not
    run: why")."""
    said = []
    for o in summary["labs"]:
        if not o["ok"]:
            error = o.get("error") or "failed"
            said.append(error if error.startswith(f"{o['lab']}:") else f"{o['lab']}: {error}")
    return said


# results/<box>/traces/<lab>/<run>-rank<r>.json.gz, as make gpu-references keeps them
TRACE_FILE = re.compile(r"^(?P<run>.+)-rank(?P<rank>\d+)\.json(\.gz)?$")


def gpu_traces(results=None):
    """{(folder, run): [paths, by rank]}: each box's profiled runs (ddp-weak-n8, ...), each
    with its ranks' traces."""
    results = RESULTS if results is None else Path(results)
    runs = {}
    for path in sorted(results.glob("*/traces/*/*")):
        match = TRACE_FILE.match(path.name)
        if match:
            runs.setdefault((path.parents[2].name, match["run"]), []).append(
                (int(match["rank"]), path))
    return {key: [path for _, path in sorted(ranked)] for key, ranked in runs.items()}


def trace_section(results=None):
    """A Markdown table of each box's profiled runs as the trace reader takes them apart:
    the slowest rank's window per profiled step, and its computation, communication,
    exposed communication and idle time; "" where no box kept a trace."""
    from ..predict import trace_reader   # torch-free too; only needed here
    rows = []
    for (folder, run), paths in gpu_traces(results).items():
        ranks = trace_reader.analyze_all([(path.name, trace_reader.load_file(path))
                                          for path in paths])["ranks"]
        slowest = max(ranks.values(), key=lambda r: r["window_s"])
        per_step = 1e3 / max(slowest["steps"], 1)   # ms per profiled step
        rows.append(f"| {folder} | {run} | {len(ranks)} | {slowest['rank']} | "
                    + " | ".join(f"{slowest[key] * per_step:.3g}" for key in (
                        "window_s", "compute_s", "communication_s",
                        "exposed_communication_s", "idle_s")) + " |")
    if not rows:
        return ""
    return "\n".join(["| box | run | ranks | slowest rank | step (ms) | compute | "
                      "communication | exposed | idle |",
                      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows])

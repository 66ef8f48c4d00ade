"""The pipeline bubble against (p-1)/(m+p-1) at every m from 1 to 16 and p = 2, 3, 4: the
controlled-time benchmark behind the pipeline chapter's claim.

    python benchmarks/pipeline_bubble.py                  # forward 40 ms, backward 80 ms
    python benchmarks/pipeline_bubble.py --out results/cpu/pipeline_bubble.json

Each p is one launch of labs/pipeline.py, which sweeps m and runs GPipe and 1F1B from
scratch in it. Every forward lasts --compute-ms and every backward twice that (the lab's
--compute-ms), so the schedule sets the timeline; what the formula leaves out is the time
between ops, a message and a process waking up, which shrinks against longer ops. The
result goes to --out: each launch's metadata (hardware, torch, arguments) and its points
{schedule, microbatches, bubble_fraction, predicted_bubble_fraction}. The exit status is
1 if any point is more than --tolerance from the formula.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labs"))
from labkit.runtime.launch import run_lab  # noqa: E402

MICROBATCHES = ",".join(str(m) for m in range(1, 17))
SCHEDULES = ("gpipe", "1f1b")


def compact(run):
    """A lab run's metadata and its bubble points, without the timelines."""
    points = [{"schedule": name, "microbatches": entry["microbatches"],
               "bubble_fraction": entry["schedules"][name]["bubble_fraction"],
               "predicted_bubble_fraction": entry["schedules"][name]["predicted_bubble_fraction"]}
              for entry in run["sweep"] for name in SCHEDULES]
    return {**{k: v for k, v in run.items() if k not in ("schedules", "timeline", "sweep")},
            "points": points}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--stages", default="2,3,4", help="comma-separated p")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    runs, worst = [], 0.0
    for p in (int(s) for s in args.stages.split(",")):
        run = run_lab("pipeline", p, ["--schedule", ",".join(SCHEDULES),
                                      "--microbatches", MICROBATCHES, "--microbatch-size", 2,
                                      "--steps", 2, "--compute-ms", args.compute_ms],
                      echo="command")
        runs.append(compact(run))
        for name in SCHEDULES:
            gaps = [point["bubble_fraction"] - point["predicted_bubble_fraction"]
                    for point in runs[-1]["points"] if point["schedule"] == name]
            inside = sum(abs(g) <= args.tolerance for g in gaps)
            worst = max(worst, *(abs(g) for g in gaps))
            print(f"p={p} {name:5s}: measured - predicted from {min(gaps):+.3f} to "
                  f"{max(gaps):+.3f}; {inside} of {len(gaps)} within ±{args.tolerance:g}",
                  flush=True)
    print(f"largest |gap| {worst:.3f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"compute_ms": args.compute_ms, "runs": runs}, indent=1)
                            + "\n")
    sys.exit(0 if worst <= args.tolerance else 1)


if __name__ == "__main__":
    main()

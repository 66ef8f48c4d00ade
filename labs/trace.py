"""Read torch.profiler traces, one per rank: how long each rank's profiled steps computed,
communicated and waited, and how much of the communication no computation hid. The
command line of labkit.predict.trace_reader (what counts as what is described there); no
torch, so it reads traces from any machine, CPU or GPU.

Launch lines (from the repository root):
  the traces of a lab run:   python labs/scaling.py --profile prof/   (or under torchrun)
                             python labs/trace.py analyze prof/*.json
  as JSON:                   python labs/trace.py analyze prof/*.json --json

--json prints {ranks: {rank: {rank, kind (cuda or cpu), steps, window_s, compute_s,
communication_s, exposed_communication_s, overlap_fraction, memory_copy_s, idle_s,
not_computing_fraction, bubble_fraction (a pipeline stage's, else null), collectives
{kind: count}, exposed_by_group_s {group: s}, per_collective [{name, start_us, dur_s, kind,
group, group_size, bytes, algbw_bytes_per_s, busbw_bytes_per_s}], base_time_us, file}},
stragglers: {matched, by_rank {rank: {last, caused_wait_s, waited_s}}, straggler, worst}}.

The files are read and reduced one at a time, so memory holds one parsed trace (about 3x
its JSON, 5x while parsing) and each rank's figures, not every rank's trace at once.
"""

import argparse
import json

from labkit.predict import trace_reader
from labkit.predict.arguments import ArgumentParser, fail


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=__doc__[__doc__.index("Launch lines"):])
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="per rank: compute, communication, "
                                  "exposed communication, overlap, idle, collectives")
    analyze.add_argument("traces", nargs="+", metavar="TRACE.json",
                         help="Chrome-trace JSON files from torch.profiler, one per rank")
    analyze.add_argument("--json", action="store_true", help="print JSON")
    return parser.parse_args(None if argv is None else [str(a) for a in argv])


def read(paths):
    """trace_reader.analyze_all of the files, or one line saying what is wrong."""
    try:   # a generator: each trace is parsed, reduced and dropped before the next
        return trace_reader.analyze_all((str(path), trace_reader.load_file(path))
                                        for path in paths)
    except trace_reader.TraceError as error:
        fail(str(error))


def main(argv=None):
    args = parse_args(argv)
    result = read(args.traces)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{'rank':>4} {'kind':>4} {'steps':>5} {'window s':>9} {'compute':>8} "
          f"{'comm':>8} {'exposed':>8} {'overlap':>7} {'copies':>8} {'idle':>8}  collectives")
    for rank, r in result["ranks"].items():
        overlap = "-" if r["overlap_fraction"] is None else f"{r['overlap_fraction']:.0%}"
        kinds = ", ".join(f"{kind} {n}" for kind, n in r["collectives"].items()) or "none"
        print(f"{rank:>4} {r['kind']:>4} {r['steps']:>5} {r['window_s']:>9.4f} "
              f"{r['compute_s']:>8.4f} {r['communication_s']:>8.4f} "
              f"{r['exposed_communication_s']:>8.4f} {overlap:>7} {r['memory_copy_s']:>8.4f} "
              f"{r['idle_s']:>8.4f}  {kinds}")
        for group, seconds in r["exposed_by_group_s"].items():
            print(f"{'':>10} exposed in group {group}: {seconds:.4f} s")
    s = result["stragglers"]
    if s["straggler"] is not None:
        print(f"{s['matched']} collectives matched across ranks; the others waited longest "
              f"for rank {s['straggler']}: " + ", ".join(
                  f"rank {rank} last {b['last']}x, others waited {b['caused_wait_s']:.4f} s"
                  for rank, b in s["by_rank"].items()))


if __name__ == "__main__":
    main()

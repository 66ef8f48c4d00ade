"""Ring all-reduce from point-to-point sends and receives, checked and timed against torch's.

The tensor is cut into N chunks (sizes differ by at most one element; some are empty when
it has fewer than N elements). Reduce-scatter: in N-1 steps each rank sends one chunk to
the next rank and adds the chunk it receives from the previous one, until rank r holds the
full sum of chunk r+1. All-gather: N-1 more steps pass the summed chunks around the ring.
Each step is pipelined: a chunk travels as a few segments (at most MAX_SEGMENTS, each of at
least --segment-bytes), and each received segment is added while the next ones are still
on the wire. A world of one has no ring: it checks the result and times the calls, and
reports no bus bandwidth (null), since nothing crosses a link.

  --numel LIST    correctness runs, one per length (e.g. 1,3,1000003), on random float32
                  elements, compared with dist.all_reduce on the same input; bytes sent
                  counted on every rank and predicted
  --sizes LIST    a timing sweep, e.g. 4K,64K,1M,16M (bytes; K/M/G = 2^10/2^20/2^30),
                  ring and dist.all_reduce alternating, --repeats timed samples per size,
                  each sample the operation repeated back to back for about 20 ms
  --sub-worlds LIST  then the same again on the first k ranks alone, for each k below the
                  world's size (e.g. 2), largest first: a world of k inside this launch,
                  on its own process group, while the other ranks wait (asleep in a gloo barrier)

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/ring_allreduce.py --sizes 4K,1M,16M
  N = 4, then N = 2:    torchrun --standalone --nproc_per_node=4 labs/ring_allreduce.py \\
                          --sizes 4K,1M,16M --sub-worlds 2
  one process:          python labs/ring_allreduce.py --numel 1000
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/ring_allreduce.py --sizes 1M,64M,1G
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=ring labs/ring_allreduce.py --sizes 1M,64M,1G --out ring.json

JSON metrics: correctness [{numel, max_abs_err, bytes_sent_per_rank (counted on rank 0),
predicted_bytes_per_rank, bytes_sent_by_rank, predicted_bytes_by_rank}], one per --numel,
and with --sizes: sweep [{bytes, iterations (per sample), ring_time_s, library_time_s (per
operation, median), ring_busbw_gbps, library_busbw_gbps (null in a world of one),
segments_per_step (what the ring sends to its neighbour per step), ...}], alpha_s,
beta_bytes_per_s (fitted to the library), note (what a world of one cannot show, else
absent); sub_worlds [{world_size, correctness, and with --sizes sweep,
alpha_s, beta_bytes_per_s}], one per --sub-worlds size, largest first.
"""

import itertools
import statistics

import torch
import torch.distributed as dist

from labkit.predict import comm_model
from labkit.runtime import distenv, timing

# correctness run
NUMEL = 1_000_003          # does not divide by any small N: unequal chunks by default
# timing sweep
REPEATS = 15               # timed samples per size and implementation; the median is reported
WARMUP = 3                 # untimed runs first: the first collective sets up connections
SAMPLE_S = 0.02            # a sample repeats the operation back to back for about this long,
MAX_ITERATIONS = 20        # ... at most this many times, and reports the time per operation
# implementation
SEGMENT_BYTES = 2 << 20    # pipelining grain: 2 MiB per send/receive (each message pays a latency)
MAX_SEGMENTS = 4           # ... and at most this many per chunk: larger chunks, larger segments
ELEMENT_SIZE = 4           # float32
ONE_RANK = ("a world of one: no other rank, so nothing is sent and no bus bandwidth exists "
            "(its factor 2(N-1)/N is 0); the correctness check and the time of each call "
            "(the ring's Python, the library's call) are all it shows")


def ring_steps(rank, world_size):
    """The 2(N-1) steps of a ring all-reduce on `rank`: (phase, chunk sent, chunk received).

    Reduce-scatter step s sends chunk rank-s and adds the incoming chunk rank-s-1 into its
    own; after N-1 steps rank r holds the full sum of chunk r+1. All-gather step s passes on
    chunk rank+1-s and stores the incoming chunk rank-s. The chunk sent at each step is the
    one received at the step before.
    """
    n = world_size
    reduce_scatter = [("reduce-scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
    all_gather = [("all-gather", (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)]
    return reduce_scatter + all_gather


_buffers = {}


def _receive_buffers(numel, dtype, device):
    """Two reusable buffers for incoming chunks (steps alternate between them). Allocating
    them anew on every call costs a page fault per 4 KiB on first touch: for tens of MB, a
    real share of the all-reduce's time."""
    key = (dtype, device)
    if key not in _buffers or _buffers[key].shape[1] < numel:
        _buffers[key] = torch.empty(2, numel, dtype=dtype, device=device)
    return _buffers[key][:, :numel]


def segment_elements(chunk_numel, element_size, segment_bytes=SEGMENT_BYTES):
    """Elements per segment for chunks of up to `chunk_numel` elements: `segment_bytes`, or
    more where a chunk would need more than MAX_SEGMENTS of them.

    Small segments let a received one be added while the next is on the wire, but every
    segment is a call: on gloo a message with its fixed latency, on NCCL a group call and a
    kernel, run one after another on one stream. At 1 GiB on 8 GPUs, 2 MiB segments would make 64
    per step and about 900 calls per all-reduce, and the time would be the launches', not
    the links'. NCCL's own ring moves a step's chunk in slices inside one kernel; the
    course's ring sends at most MAX_SEGMENTS per step to its neighbour, so a large
    message is a few large transfers, the last segment's addition alone left exposed."""
    return max(1, segment_bytes // element_size, -(-chunk_numel // MAX_SEGMENTS))


def run_ring(flat, steps, segment_bytes=SEGMENT_BYTES, group=None):
    """Run consecutive ring `steps` on the 1-D tensor `flat`, in place, pipelined by segment.

    Segment k of a step is sent as soon as segment k of the step before has arrived (and, in
    the reduce-scatter, been added): the next step's sending overlaps this step's receiving
    and adding, and the link never waits for a whole chunk. Returns elements sent. The ring
    runs over `group`'s ranks (None: the world's).
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    nxt, prev = global_rank((rank + 1) % n), global_rank((rank - 1) % n)
    bounds = comm_model.chunk_bounds(flat.numel(), n)
    largest = bounds[0][1] - bounds[0][0]
    grain = segment_elements(largest, flat.element_size(), segment_bytes)
    scratch = _receive_buffers(largest, flat.dtype, flat.device)

    def segments(chunk):
        start, end = bounds[chunk]
        return [(a, min(a + grain, end)) for a in range(start, end, grain)]

    # Each segment's send and receive go out as one batch (batch_isend_irecv): on NCCL a
    # batch is one group call over the whole group's communicator, so at N = 2 the send to
    # and the receive from the one peer cannot block each other, and no lazily created
    # two-rank communicators wait on each other round the ring. On gloo it is the same
    # isend and irecv as before.
    sends, pending, sent = [], None, 0  # pending: the previous step's receives, not yet done
    for index, (phase, send_chunk, recv_chunk) in enumerate(steps):
        incoming = scratch[index % 2] if phase == "reduce-scatter" else flat
        offset = bounds[recv_chunk][0] if phase == "reduce-scatter" else 0
        finish = _finisher(pending, flat, scratch)
        receives = []
        # the two chunks' segment counts can differ by one (chunks differ by an element)
        for outgoing, arriving in itertools.zip_longest(segments(send_chunk),
                                                        segments(recv_chunk)):
            ops = []
            if outgoing is not None:
                a, b = outgoing
                finish(a, b)  # the step before must have delivered this segment
                ops.append(dist.P2POp(dist.isend, flat[a:b], nxt, group=group))
                sent += b - a
            if arriving is not None:
                a, b = arriving
                ops.append(dist.P2POp(dist.irecv, incoming[a - offset:b - offset], prev,
                                      group=group))
            works = dist.batch_isend_irecv(ops)
            # gloo returns one work per op (the receive's last), NCCL one for the batch
            mine = works[-1:] if len(works) == len(ops) else works
            if arriving is not None:
                receives.append((*arriving, mine))
            if outgoing is not None:
                sends.extend(works[:1] if len(works) == len(ops) else works)
        finish(None, None)  # whatever of the step before is left (a chunk one longer)
        pending = (phase, index, offset, receives)
    _finisher(pending, flat, scratch)(None, None)
    for work in sends:
        work.wait()
    return sent


def _finisher(pending, flat, scratch):
    """finish(a, b): wait for the previous step's received segments up to [a, b) and add them
    in (reduce-scatter); finish(None, None) completes all that remain."""
    if pending is None:
        return lambda a, b: None
    phase, index, offset, receives = pending
    queue = list(receives)

    def finish(a, b):
        while queue and (a is None or queue[0][0] <= a):
            start, end, works = queue.pop(0)
            for work in works:
                work.wait()
            if phase == "reduce-scatter":
                flat[start:end] += scratch[index % 2][start - offset:end - offset]

    return finish


def ring_allreduce(tensor, segment_bytes=SEGMENT_BYTES, group=None):
    """Sum `tensor` over `group`'s ranks (None: the world's), in place. Returns the number
    of bytes this rank sent."""
    flat = tensor.view(-1)  # a view: results land in `tensor`
    steps = ring_steps(dist.get_rank(group), dist.get_world_size(group))
    return run_ring(flat, steps, segment_bytes, group) * tensor.element_size()


def check_correctness(env, numel, seed, segment_bytes, group=None):
    """Ring vs dist.all_reduce on the same random input; bytes counted on every rank."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    gen = distenv.generator(seed, "data", numel, rank)  # different data on every rank
    data = torch.randn(numel, generator=gen, device="cpu").to(env.device)   # host generator
    expected = data.clone()
    dist.all_reduce(expected, group=group)
    sent = ring_allreduce(data, segment_bytes, group)
    max_abs_err = (data - expected).abs().max().item()
    sent_by_rank = torch.tensor([float(sent)], device=env.device)
    gathered = [torch.zeros_like(sent_by_rank) for _ in range(n)]
    dist.all_gather(gathered, sent_by_rank, group=group)
    return {
        "numel": numel,
        "max_abs_err": max_abs_err,
        "bytes_sent_per_rank": sent,
        "predicted_bytes_per_rank": comm_model.ring_allreduce_bytes_sent(
            numel, n, rank, data.element_size()),
        "bytes_sent_by_rank": [int(t.item()) for t in gathered],
        "predicted_bytes_by_rank": [comm_model.ring_allreduce_bytes_sent(
            numel, n, r, data.element_size()) for r in range(n)],
    }


def sweep(env, sizes, repeats, segment_bytes, group=None):
    """Time the ring and dist.all_reduce on each size, alternating, median of the repeats.

    Each timed sample runs the operation `iterations` times back to back and reports the
    time per operation, as nccl-tests averages over iterations: the barrier that starts a
    sample releases the ranks a little apart, and over a sample of about SAMPLE_S that skew
    is a small part of the time instead of most of it for small messages.
    """
    rows, n = [], dist.get_world_size(group)
    for size in sizes:
        numel = size // ELEMENT_SIZE
        source = torch.randn(numel, device=env.device)   # any values: only the time counts
        buffer = torch.empty_like(source)
        implementations = {
            "ring": lambda: ring_allreduce(buffer, segment_bytes, group),
            "library": lambda: dist.all_reduce(buffer, group=group),
        }
        warm = []   # the first runs set up connections and buffers; they also size a sample
        for _ in range(WARMUP):
            for operation in implementations.values():
                buffer.copy_(source)
                warm.append(timing.timed(env.device, operation, group))
        # timed() returns the slowest rank's time, so every rank picks the same count
        iterations = max(1, min(MAX_ITERATIONS, round(SAMPLE_S / statistics.median(warm))))
        times = {name: [] for name in implementations}
        for index in range(repeats):
            for name, operation in implementations.items():
                buffer.copy_(source)  # same input each time, outside the timed region
                elapsed = timing.timed(env.device, lambda: [operation() for _ in range(iterations)],
                                       group)
                times[name].append(elapsed / iterations)
            env.progress(f"{size} bytes: {index + 1}/{repeats}")
        largest = -(-numel // n)   # the first chunk's elements (chunk_bounds)
        segments = -(-largest // segment_elements(largest, ELEMENT_SIZE, segment_bytes))
        row = {"bytes": numel * ELEMENT_SIZE, "iterations": iterations,
               "segments_per_step": segments if n > 1 else 0}
        for name in implementations:
            median, low, high = timing.summary(times[name])
            row[f"{name}_time_s"] = median
            row[f"{name}_time_quartiles_s"] = [low, high]
            # a world of one moves nothing over a link: no bandwidth to report (not 0)
            row[f"{name}_busbw_gbps"] = (comm_model.bus_bandwidth(
                "all_reduce", row["bytes"], median, n) / 1e9 if n > 1 else None)
        row["ring_over_library_busbw"] = (row["library_time_s"] / row["ring_time_s"]
                                          if n > 1 else None)
        rows.append(row)
    env.progress("")
    return rows


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--numel", type=distenv.int_list(1), default=[NUMEL],
                        help="elements of each correctness run (float32), comma-separated")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated message sizes in bytes for the timing sweep, "
                             "K/M/G suffixes accepted (e.g. 4K,64K,1M,16M)")
    parser.add_argument("--repeats", type=distenv.positive_int, default=REPEATS,
                        help="timed runs per size")
    distenv.add_sub_worlds_arg(parser)
    parser.add_argument("--segment-bytes", type=distenv.at_least(ELEMENT_SIZE),
                        default=SEGMENT_BYTES, help="pipelining grain of the ring, in bytes")
    args = parser.parse_args(argv)
    if args.sizes is not None:
        try:
            args.sizes = [comm_model.parse_size(s) for s in args.sizes.split(",")]
        except ValueError as error:
            distenv.fail(f"--sizes: {error}")
        small = [s for s in args.sizes if s < ELEMENT_SIZE]
        if small:
            distenv.fail(f"--sizes: {small[0]} bytes is less than one float32 element")
    return args


def measure(env, args, group=None):
    """The correctness runs and the sweep over `group`'s ranks (None: the world's)."""
    n = dist.get_world_size(group)
    metrics = {"correctness": []}
    env.print0(f"ring all-reduce of float32, world size {n} ({env.backend})")
    if n == 1:
        metrics["note"] = ONE_RANK
        env.print0(ONE_RANK)
    for numel in args.numel:
        check = check_correctness(env, numel, args.seed, args.segment_bytes, group)
        metrics["correctness"].append(check)
        env.print0(f"{numel:>9,} elements: max |ring - library| {check['max_abs_err']:.1e}, "
                   f"rank 0 sent {check['bytes_sent_per_rank']:,} B (predicted "
                   f"{check['predicted_bytes_per_rank']:,})")
    if args.sizes:
        rows = sweep(env, args.sizes, args.repeats, args.segment_bytes, group)
        metrics["sweep"] = rows
        metrics["alpha_s"] = metrics["beta_bytes_per_s"] = None
        if n > 1 and len(rows) > 1:
            try:
                alpha, beta = comm_model.fit_alpha_beta([r["bytes"] for r in rows],
                                                        [r["library_time_s"] for r in rows], n)
            except ValueError as error:
                env.print0(f"no alpha-beta fit: {error}")
            else:
                metrics["alpha_s"], metrics["beta_bytes_per_s"] = alpha, beta
                for row in rows:
                    row["predicted_time_s"] = comm_model.allreduce_time(row["bytes"], n,
                                                                        alpha, beta)
        # a world of one has times and no bandwidths (see ONE_RANK, printed above)
        header = f"{'bytes':>12} {'ring ms':>9} {'library ms':>10}"
        env.print0(header + (f" {'ring busbw':>11} {'lib busbw':>10} {'ratio':>6}   "
                             f"(busbw in GB/s)" if n > 1 else ""))
        for r in rows:
            line = (f"{r['bytes']:>12} {r['ring_time_s'] * 1e3:>9.3f} "
                    f"{r['library_time_s'] * 1e3:>10.3f}")
            env.print0(line + (f" {r['ring_busbw_gbps']:>11.3f} {r['library_busbw_gbps']:>10.3f} "
                               f"{r['ring_over_library_busbw']:>6.2f}" if n > 1 else ""))
        if metrics["alpha_s"] is not None:
            env.print0(f"alpha-beta fit to dist.all_reduce: alpha = "
                       f"{metrics['alpha_s'] * 1e6:.1f} us, "
                       f"beta = {metrics['beta_bytes_per_s'] / 1e9:.3f} GB/s")
    return metrics


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        env.write_result(args, distenv.measure_with_sub_worlds(
            env, args.sub_worlds, lambda world: measure(world, args, world.group)))


if __name__ == "__main__":
    main()

"""Scaling efficiency: a data-parallel training step measured at the world size it runs at,
taken apart into compute and communication, and set against the step-time model.

  --strategy ddp    torch DDP with its default buckets (bucket_cap_mb unset: 1 MiB first,
                    then 25 MiB)
  --strategy fsdp   torch FSDP2: fully_shard on the embedding, each block and the head,
                    then the root (ZeRO-3: parameters gathered for forward and again for
                    backward, gradients reduce-scattered)
  --scaling strong  --batch sequences in all, split over the N ranks (N must divide it)
  --scaling weak    --batch sequences on every rank: the total grows with N
Both options take a comma-separated list (or all): every combination runs in the same
launch, one after another, and the link is fitted once for all of them.
  --sub-worlds LIST  then all of it again on the first k ranks alone, for each k below the
                  world's size (e.g. 2,1), largest first: a world of k inside this launch,
                  on its own process group, while the other ranks wait (asleep in a gloo barrier)

Measured, all ranks at once, each time the slowest rank's:
  step_time_s      median of --steps timed steps after --warmup; its spread is between
                   timing.summary's quartiles, the k-th fastest and slowest step with
                   k = steps // 4 (at least 1): below 8 steps, the fastest and the slowest
  compute_time_s   forward + backward + optimizer step of a plain copy of the model on the
                   same local batch, without any communication, each phase timed apart
  plain_step_time_s  that plain copy's whole step timed at once (median), as the step is:
                   the step minus it is the DDP or FSDP wrapper's own work
  comm_time_s      the step's collectives alone, back to back: DDP's bucket all-reduces,
                   or FSDP's two all-gathers and one reduce-scatter per unit
  alpha_s, beta_bytes_per_s   all-reduces of several sizes, the median of each size's
                   repeats, fitted (comm_model)
predicted_step_time_s is time_model.step_time from the measured compute phases and the
alpha-beta times of the same collectives. DDP's buckets overlap backward on a GPU, where
NCCL has the network to itself; on CPU, gloo adds and copies on the very cores that run
backward, so there the model takes no overlap (`model_overlap` in the JSON says which).
FSDP is modelled without overlap.

Launch lines (from the repository root):
  one process:           python labs/scaling.py --strategy ddp --scaling strong
  N = 3, then 2 and 1:   torchrun --standalone --nproc_per_node=3 labs/scaling.py \\
                           --strategy all --scaling all --sub-worlds 2,1
  laptop, gloo on CPU:   torchrun --standalone --nproc_per_node=2 labs/scaling.py \\
                           --strategy ddp --scaling strong --out s2.json
  GPU box, NCCL:         torchrun --standalone --nproc_per_node=8 labs/scaling.py \\
                           --strategy fsdp --scaling weak --batch 8 --out s8.json
  a trace per rank:      torchrun --standalone --nproc_per_node=2 labs/scaling.py \\
                           --strategy ddp --profile prof/
                         python labs/trace.py analyze prof/*.json
  and a straggler made on purpose: ... --profile prof/ --slow-rank 1 --slow-ms 30
                         (each profiled strategy once more, rank 1 late, into
                         prof/<name>-slow-rank<r>.json: read one set at a time,
                         python labs/trace.py analyze prof/ddp-strong-n2-slow-rank*.json)
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=scaling labs/scaling.py --strategy ddp --scaling weak --out s16.json

JSON: alpha_s, beta_bytes_per_s (null, and link_fit_error says why, when all-reduce times do
not grow with size, as on NVLink at these sizes; predictions are then null), param_count,
`shape`, `flops_per_step` (torch's FlopCounterMode around one forward and backward of --batch
sequences of the model, on one rank), and `runs`, one per (strategy, scaling):
[{strategy, scaling, step_time_s, step_time_spread_s (upper minus lower quartile),
step_time_quartiles_s, samples_per_s, compute_time_s (and forward_, backward_,
optimizer_time_s), plain_step_time_s, comm_time_s, predicted_step_time_s,
predicted_comm_time_s, model_overlap, collectives [{op, bytes}], batch_per_rank,
global_batch, profile (rank 0's trace with --profile, else null), profile_slow (with
--slow-rank, rank 0's trace of the same steps with that rank late, else null)}]; sub_worlds
[{world_size, alpha_s, beta_bytes_per_s, link_fit_error, runs}], one per --sub-worlds size,
largest first.
"""

import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from labkit.predict import comm_model, memory_model, time_model
from labkit.runtime import distenv, profiling, timing
from labkit.parallel.strategies import SCALING_SHAPE as SHAPE
from labkit.parallel.strategies import apply_ddp, apply_fsdp, rank_batch, train_step, world_mesh
from labkit.model.transformer import Transformer, next_token_loss

STRATEGIES = ("ddp", "fsdp")
SCALINGS = ("strong", "weak")
BATCH = 6              # strong: sequences in all (divides by N = 1, 2, 3); weak: per rank
LEARNING_RATE = 0.1
# timing
STEPS = 8              # timed steps (also repeats of the compute and communication timings)
WARMUP = 2             # untimed first steps: allocation, DDP's bucket rebuild, connections
# all-reduce sizes for alpha-beta: up to 16 MiB, so that on gloo the largest takes several
# times the milliseconds a busy 2-core machine adds to a small one (at 4 MiB the slope was
# sometimes lost in that noise)
SWEEP_BYTES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)

def collectives(model, strategy, world_size):
    """[(op, bytes)] one step issues, in order: DDP's bucket all-reduces, last layer first;
    for FSDP, per unit, the forward all-gather, then the backward all-gather and the
    reduce-scatter, both walking the units last to first. FSDP pads every parameter's dim 0
    to a multiple of N, so a unit moves N x (its padded shard) bytes."""
    if strategy == "ddp":
        sizes = [p.numel() * p.element_size() for p in model.parameters()][::-1]
        return [("all_reduce", b) for b in time_model.bucket_bytes(sizes)]
    unit_bytes = [world_size * 4 * sum(memory_model.fsdp2_shard_numel(tuple(p.shape), world_size, 0)
                                       for p in unit.parameters()) for unit in model.units()]
    forward = [("all_gather", b) for b in unit_bytes]
    backward = [(op, b) for b in unit_bytes[::-1] for op in ("all_gather", "reduce_scatter")]
    return forward + backward


def issue(op, buffers, group=None):
    """One collective on preallocated buffers (full size, and a 1/N slice for shards)."""
    full, shard = buffers
    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        distenv.all_gather_single(full, shard, group=group)
    else:
        distenv.reduce_scatter_single(shard, full, group=group)


def time_collectives(plan, env, repeats, warmup, group=None):
    """Median seconds of the step's collectives issued back to back, nothing else running."""
    n = dist.get_world_size(group)
    buffers = [(torch.zeros(b // 4, device=env.device),
                torch.zeros(b // 4 // n, device=env.device)) for _, b in plan]
    times = [timing.timed(env.device, lambda: [issue(op, buf, group) for (op, _), buf in
                                              zip(plan, buffers)], group)
             for _ in range(warmup + repeats)]
    return statistics.median(times[warmup:])


def fit_link(env, repeats, group=None):
    """(alpha, beta, why not): alpha and beta of this machine's all-reduce at this world
    size, or None and None with the reason (None at N = 1, where nothing is sent)."""
    n = env.world_size if group is None else dist.get_world_size(group)
    if n == 1:
        return None, None, None
    times = []
    for size in SWEEP_BYTES:
        buffer = torch.zeros(size // 4, device=env.device)
        runs = [timing.timed(env.device, lambda: dist.all_reduce(buffer, group=group), group)
                for _ in range(WARMUP + repeats)]
        # the median, as the step and comm_time_s are timed: a fit to the fastest repeat
        # would price the link faster than any step sees it, so the model would come out
        # short by construction
        times.append(statistics.median(runs[WARMUP:]))
    try:
        return (*comm_model.fit_alpha_beta(list(SWEEP_BYTES), times, n), None)
    except ValueError as error:
        # On NVLink an all-reduce of these sizes takes about the same few microseconds
        # whatever its size: no bandwidth to fit. The lab still measures; it predicts nothing.
        return None, None, str(error)


def predicted_comm(plan, world_size, alpha, beta, backend="nccl"):
    """Alpha-beta seconds of each collective in `plan` (None when no link was fitted). The
    gloo library has a reduce-scatter (recursive halving-doubling, gloo/reduce_scatter.h),
    but torch's gloo backend does not call it: it all-reduces the whole buffer and keeps
    the rank's part, so there a reduce-scatter is priced as that all-reduce."""
    if world_size == 1:
        return [0.0] * len(plan)
    if alpha is None:
        return None
    as_all_reduce = {"all_reduce"} | ({"reduce_scatter"} if backend == "gloo" else set())
    return [comm_model.allreduce_time(b, world_size, alpha, beta) if op in as_all_reduce else
            time_model.shard_collective_time(b, world_size, alpha, beta) for op, b in plan]


def measure(strategy, scaling, args, env, link, group=None):
    """One (strategy, scaling) at this world size (of `group`; None: the world's): the
    step, its parts, the model."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    batch_per_rank = args.batch // n if scaling == "strong" else args.batch
    torch.manual_seed(args.seed)
    model = Transformer(SHAPE, device=env.device)
    plain = copy.deepcopy(model)
    ids, targets = rank_batch(SHAPE, batch_per_rank, args.seed, 0, rank, env.device)
    plan = collectives(model, strategy, n)

    # 1. the step itself
    wrapped = (apply_ddp(model, env.device, process_group=group) if strategy == "ddp" else
               apply_fsdp(model, env.device, mesh=world_mesh(env.device, group)))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LEARNING_RATE)
    steps = [timing.timed(env.device, lambda: train_step(wrapped, optimizer, ids, targets),
                          group)
             for _ in range(args.warmup + args.steps)][args.warmup:]
    median, low, high = timing.summary(steps)
    trace = slow_trace = None
    if args.profile:   # extra steps, untimed: see labkit.runtime.profiling
        def profiled_step(late_rank=None):
            if rank == late_rank:   # a straggler on purpose: late to every step
                time.sleep(args.slow_ms / 1e3)
            train_step(wrapped, optimizer, ids, targets)
        name = f"{strategy}-{scaling}-n{n}"
        trace = str(profiling.profile_steps(args.profile, name, env.device, profiled_step))
        if args.slow_rank is not None and args.slow_rank < n:
            # the same steps again, one rank late to each (a sub-world without it: none)
            slow_trace = str(profiling.profile_steps(
                args.profile, f"{name}-slow", env.device,
                lambda: profiled_step(args.slow_rank)))
    env.progress(f"{strategy}, {scaling}: compute alone")
    # 2. its parts alone: compute without communication, communication without compute
    compute = timing.compute_times(plain, torch.optim.SGD(plain.parameters(), lr=LEARNING_RATE),
                                   next_token_loss, ids, targets, env.device, args.steps,
                                   group=group)
    # the same plain copy's whole step in one timing, as the step itself is timed: what
    # the wrapped step takes beyond it is the wrapper's own work (DDP's copies into and
    # out of its buckets, FSDP2's DTensors and copies), which no phase above holds
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=LEARNING_RATE)
    plain_steps = [timing.timed(env.device,
                                lambda: train_step(plain, plain_optimizer, ids, targets), group)
                   for _ in range(args.warmup + args.steps)][args.warmup:]
    env.progress(f"{strategy}, {scaling}: communication alone")
    comm = time_collectives(plan, env, args.steps, args.warmup, group) if n > 1 else 0.0
    env.progress("")

    # 3. the model
    overlap = strategy == "ddp" and env.device.type == "cuda"
    comm_each = predicted_comm(plan, n, *link[:2], env.backend)
    predicted = None if comm_each is None else time_model.step_time(
        compute["forward_s"], compute["backward_s"], [b for _, b in plan], comm_each, overlap,
        compute["optimizer_s"])
    return {
        "strategy": strategy, "scaling": scaling,
        "batch_per_rank": batch_per_rank, "global_batch": batch_per_rank * n,
        "step_time_s": median, "step_time_spread_s": high - low,
        "step_time_quartiles_s": [low, high],
        "samples_per_s": batch_per_rank * n / median,
        "compute_time_s": sum(compute.values()),
        **{f"{phase[:-2]}_time_s": seconds for phase, seconds in compute.items()},
        "plain_step_time_s": statistics.median(plain_steps),
        "comm_time_s": comm,
        "predicted_comm_time_s": None if comm_each is None else sum(comm_each),
        "predicted_step_time_s": predicted,
        "model_overlap": overlap,
        "collectives": [{"op": op, "bytes": b} for op, b in plan],
        "profile": trace,
        "profile_slow": slow_trace,
    }


def count_step_flops(args, env):
    """FLOPs of one forward and backward of --batch sequences, as torch's FlopCounterMode
    counts them: its matrix multiplications, what a GPU's quoted FLOP/s are for."""
    from torch.utils.flop_counter import FlopCounterMode   # here: rank 0 alone needs it
    torch.manual_seed(args.seed)
    model = Transformer(SHAPE, device=env.device)
    ids, targets = rank_batch(SHAPE, args.batch, args.seed, 0, 0, env.device)
    with FlopCounterMode(display=False) as counter:
        next_token_loss(model(ids), targets).backward()
    return counter.get_total_flops()


def check_batch(args, world_size):
    """Strong scaling splits the batch evenly over the ranks, or the lab refuses to start."""
    if "strong" in args.scaling and args.batch % world_size:
        distenv.fail(f"strong scaling splits --batch {args.batch} over {world_size} "
                     f"ranks: it must be a multiple of the world size")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--strategy", type=distenv.choice_list(STRATEGIES), default=["ddp"],
                        help="ddp, fsdp, a comma-separated list, or all")
    parser.add_argument("--scaling", type=distenv.choice_list(SCALINGS), default=["strong"],
                        help="strong, weak, a comma-separated list, or all")
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="strong: sequences per step in all; weak: sequences per rank")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS, help="timed steps")
    profiling.add_profile_arg(parser)
    parser.add_argument("--slow-rank", type=int, default=None, metavar="R",
                        help="with --profile: profile the steps once more, rank R starting "
                             "each --slow-ms late (a straggler made on purpose, for "
                             "labs/trace.py to find), into <name>-slow-rank<r>.json")
    parser.add_argument("--slow-ms", type=distenv.number_above(0, inclusive=True), default=0.0,
                        help="how late the --slow-rank starts each profiled step (ms)")
    parser.add_argument("--warmup", type=distenv.at_least(0), default=WARMUP,
                        help="untimed first steps")
    distenv.add_sub_worlds_arg(parser)
    args = parser.parse_args(argv)
    if args.slow_rank is not None and args.profile is None:
        distenv.fail("--slow-rank slows the profiled steps: give --profile DIR too")
    return args


def measure_all(args, env, group=None):
    """The link fit and every (strategy, scaling) at the world size of `group` (None: the
    world's): {alpha_s, beta_bytes_per_s, link_fit_error, runs}."""
    n = dist.get_world_size(group)
    env.print0(f"world size {n} ({env.backend})")
    link = fit_link(env, args.steps, group)
    if link[2] is not None:
        env.print0(f"no alpha-beta fit, so no predicted times: {link[2]}")
    runs = []
    for strategy in args.strategy:
        for scaling in args.scaling:
            if (n == 1 and runs and runs[-1]["strategy"] == strategy
                    and "not_run" not in runs[-1]):
                # one rank: strong and weak scaling are the same run, measured once
                run = dict(runs[-1], scaling=scaling)
            else:
                run = distenv.try_variant(
                    env, f"{strategy}, {scaling} scaling",
                    lambda: measure(strategy, scaling, args, env, link, group), group)
                if "not_run" in run:
                    runs.append({"strategy": strategy, "scaling": scaling, **run})
                    continue
            runs.append(run)
            env.print0(f"{strategy}, {scaling} scaling, {run['batch_per_rank']} sequences "
                       f"per rank:")
            env.print0(f"  step {run['step_time_s'] * 1e3:.2f} ms (spread "
                       f"{run['step_time_spread_s'] * 1e3:.2f}), "
                       f"{run['samples_per_s']:.1f} samples/s"
                       + ("" if run["predicted_step_time_s"] is None else
                          f", predicted {run['predicted_step_time_s'] * 1e3:.2f} ms"))
            env.print0(f"  compute alone {run['compute_time_s'] * 1e3:.2f} ms, "
                       f"communication alone {run['comm_time_s'] * 1e3:.2f} ms")
    return {"alpha_s": link[0], "beta_bytes_per_s": link[1], "link_fit_error": link[2],
            "runs": runs}


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        if args.slow_rank is not None and not 0 <= args.slow_rank < env.world_size:
            distenv.fail(f"--slow-rank {args.slow_rank} is not a rank of a world of "
                         f"{env.world_size}")
        result = distenv.measure_with_sub_worlds(
            env, args.sub_worlds, lambda world: measure_all(args, world, world.group),
            check=lambda size: check_batch(args, size))
        if env.is_rank0:
            env.write_result(args, {
                "param_count": sum(p.numel() for p in Transformer(SHAPE).parameters()),
                "shape": dataclasses.asdict(SHAPE), "flops_per_step": count_step_flops(args, env),
                **result})


if __name__ == "__main__":
    main()

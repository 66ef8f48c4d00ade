"""Gradient averaging: N ranks with batch B each take the step one process takes with batch N*B.

Every variant below trains the same small model on the same synthetic data set over N ranks,
and after every optimizer step its parameters are compared with a single-process reference
that trained on the whole (global) batch. Correct data parallelism matches to fp32 rounding;
the pitfalls do not.

  ddp                torch DDP + DistributedSampler                  ref: batch N*B
  manual_allreduce   no wrapper: all-reduce(SUM) each gradient, / N  ref: batch N*B
  grad_accumulation  DDP, no_sync over --accum micro-steps           ref: batch N*B*accum
  sum_not_mean       pitfall: all-reduce(SUM) without dividing by N  ref: batch N*B
  no_set_epoch       pitfall: sampler.set_epoch never called         ref: batch N*B
  unequal_shards     pitfall: rank r averages over B + r samples     ref: the same samples

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/grad_averaging.py --out ga.json
  one process:          python labs/grad_averaging.py
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/grad_averaging.py --out ga.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=grad_avg labs/grad_averaging.py --out ga.json

JSON metrics: `variants` {name: {max_param_diff, expected_equal}}, `param_diff_by_step`
{name: [float per step]}, `tolerance`, `microbatches_per_epoch`.
"""

import contextlib
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.runtime import distenv
from labkit.parallel.strategies import apply_ddp

# training
STEPS = 30            # optimizer steps per variant
BATCH_PER_RANK = 4    # B: samples per rank per micro-step
ACCUM = 2             # G: micro-steps per optimizer step in grad_accumulation
LEARNING_RATE = 0.1   # plain SGD, so any error in the gradient's scale moves the parameters
# data and model
SAMPLES = 96          # size of the synthetic data set; small, so runs cross epoch boundaries
IN_FEATURES = 8
HIDDEN = 32
# check
TOLERANCE = 1e-5      # fp32: a correct variant differs from the reference only by rounding

VARIANTS = ["ddp", "manual_allreduce", "grad_accumulation",
            "sum_not_mean", "no_set_epoch", "unequal_shards"]


def make_dataset(samples, seed):
    """A fixed regression task made in code: y = sin(x . w) + noise."""
    gen = torch.Generator().manual_seed(seed)   # on the host: a DataLoader's data lives there
    x = torch.randn(samples, IN_FEATURES, generator=gen, device="cpu")
    w = torch.randn(IN_FEATURES, 1, generator=gen, device="cpu")
    y = torch.sin(x @ w) + 0.1 * torch.randn(samples, 1, generator=gen, device="cpu")
    return TensorDataset(x, y)


def make_model(seed, device):
    """The same initial weights on every rank and in the reference."""
    torch.manual_seed(seed)
    with torch.device(device):   # built where it runs
        return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
                                   torch.nn.Linear(HIDDEN, 1))


def shuffled_batches(dataset, batch_size, replicas, rank, seed, device, set_epoch=True):
    """Endless batches, epoch after epoch, as a training loop over a DataLoader sees them.

    With replicas=1 this is the single-process reference: one seeded shuffle per epoch.
    drop_last keeps every rank's shard and every batch the same size (see the chapter).
    """
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        if set_epoch:
            sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        # the loader's seed, the sampler's shuffle and the collation happen on the host,
        # whatever device the process defaults to (under torch.set_default_device, a
        # loader would draw them there)
        with torch.device("cpu"):
            batches = iter(loader)
        while True:
            with torch.device("cpu"):
                batch = next(batches, None)
            if batch is None:
                break
            x, y = batch
            yield x.to(device), y.to(device)


def concatenated(batches, count):
    """Group `count` consecutive batches into one: the reference for accumulation."""
    while True:
        parts = [next(batches) for _ in range(count)]
        yield torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def train(model, batches, steps, lr, accum=1, after_backward=None):
    """SGD for `steps` steps; returns the parameter vector after each step.

    With accum > 1 and a DDP model, the first accum-1 backward passes run under no_sync:
    gradients accumulate locally and are all-reduced once, on the last micro-step.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    trajectory = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accum):
            last = micro == accum - 1
            skip_sync = isinstance(model, DDP) and not last
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                x, y = next(batches)
                # mean over the micro-batch, / accum: the mean over all accum*B samples
                loss = F.mse_loss(model(x), y) / accum
                loss.backward()
        if after_backward is not None:
            after_backward(model)
        optimizer.step()
        trajectory.append(parameters_to_vector(model.parameters()).detach().clone())
    return trajectory


def allreduce_gradients(divide_by_world):
    """What DDP does after backward, written out: sum every gradient over ranks, then / N."""
    def hook(model):
        world = dist.get_world_size()
        for p in model.parameters():
            # SUM then divide: ReduceOp.AVG is not supported by gloo on older torch
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            if divide_by_world:
                p.grad /= world
    return hook


def unequal_sizes(world_size, batch_per_rank):
    """Pitfall: rank r averages its loss over B + r samples per step, as a mean over each
    rank's own count of valid tokens would."""
    return [batch_per_rank + r for r in range(world_size)]


def run_variant(name, env, dataset, args):
    """Train one variant on this rank; returns its parameter trajectory."""
    n, b = env.world_size, args.batch_per_rank
    model = make_model(args.seed, env.device)

    def rank_batches(set_epoch=True):
        return shuffled_batches(dataset, b, n, env.rank, args.seed, env.device, set_epoch)

    if name == "ddp":
        return train(apply_ddp(model, env.device), rank_batches(), args.steps, args.lr)
    if name == "manual_allreduce":
        return train(model, rank_batches(), args.steps, args.lr,
                     after_backward=allreduce_gradients(divide_by_world=True))
    if name == "grad_accumulation":
        return train(apply_ddp(model, env.device), rank_batches(), args.steps, args.lr, accum=args.accum)
    if name == "sum_not_mean":
        return train(model, rank_batches(), args.steps, args.lr,
                     after_backward=allreduce_gradients(divide_by_world=False))
    if name == "no_set_epoch":
        return train(apply_ddp(model, env.device), rank_batches(set_epoch=False), args.steps, args.lr)
    if name == "unequal_shards":
        sizes = unequal_sizes(n, b)
        start = sum(sizes[:env.rank])
        global_batches = shuffled_batches(dataset, sum(sizes), 1, 0, args.seed, env.device)
        my_share = ((x[start:start + sizes[env.rank]], y[start:start + sizes[env.rank]])
                    for x, y in global_batches)
        return train(apply_ddp(model, env.device), my_share, args.steps, args.lr)
    raise ValueError(f"unknown variant {name!r}")


def reference_trajectory(name, env, dataset, args):
    """One process, the whole global batch per step: what every variant should equal."""
    n, b = env.world_size, args.batch_per_rank
    global_batch = sum(unequal_sizes(n, b)) if name == "unequal_shards" else n * b
    batches = shuffled_batches(dataset, global_batch, 1, 0, args.seed, env.device)
    if name == "grad_accumulation":
        # N*B*accum samples per step: accum consecutive global micro-batches
        batches = concatenated(batches, args.accum)
    return train(make_model(args.seed, env.device), batches, args.steps, args.lr)


def expected_equal(name, env, args):
    """Whether a variant should match its reference at this world size and these options."""
    if name == "sum_not_mean" or name == "unequal_shards":
        return env.world_size == 1  # with one rank, sum = mean and shards are equal
    if name == "no_set_epoch":
        # the order only repeats from the second epoch on
        return args.steps <= microbatches_per_epoch(env, args)
    return True


def microbatches_per_epoch(env, args):
    """Global batches of N*B in one epoch; drop_last drops the remainder."""
    return args.samples // (env.world_size * args.batch_per_rank)


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    positive = distenv.positive_int
    parser.add_argument("--steps", type=positive, default=STEPS, help="optimizer steps per variant")
    parser.add_argument("--batch-per-rank", type=positive, default=BATCH_PER_RANK,
                        help="B, samples per rank per micro-step")
    parser.add_argument("--accum", type=positive, default=ACCUM,
                        help="micro-steps per optimizer step for grad_accumulation")
    parser.add_argument("--samples", type=positive, default=SAMPLES, help="size of the data set")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD learning rate")
    args = parser.parse_args(argv)
    if not args.lr > 0:
        distenv.fail(f"--lr must be positive, got {args.lr}")
    return args


def check_sizes(env, args):
    """The data set must hold one global batch of every kind at this world size."""
    largest = sum(unequal_sizes(env.world_size, args.batch_per_rank))  # >= N*B
    if args.samples < largest:
        distenv.fail(f"--samples {args.samples} is smaller than one global batch "
                     f"({largest} samples at world size {env.world_size}); raise --samples")


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        check_sizes(env, args)
        dataset = make_dataset(args.samples, args.seed)
        variants, by_step = {}, {}
        env.print0(f"world size {env.world_size}, backend {env.backend}, B={args.batch_per_rank}, "
                   f"accum={args.accum}, {args.steps} steps")
        env.print0(f"{'variant':<18} {'max |dtheta|':>12}  expected  result")
        for name in VARIANTS:
            trajectory = distenv.try_variant(env, name,
                                             lambda: run_variant(name, env, dataset, args))
            if isinstance(trajectory, dict):   # {"not_run": why}: this box cannot run it
                variants[name] = trajectory
                continue
            if not env.is_rank0:
                continue  # only rank 0 compares, the others just took part in the collectives
            reference = reference_trajectory(name, env, dataset, args)
            diffs = [float((p - r).abs().max()) for p, r in zip(trajectory, reference)]
            expect = expected_equal(name, env, args)
            matched = max(diffs) <= TOLERANCE
            by_step[name] = diffs
            variants[name] = {"max_param_diff": max(diffs), "expected_equal": expect}
            verdict = "as expected" if matched == expect else "UNEXPECTED"
            env.print0(f"{name:<18} {max(diffs):12.3e}  {'equal' if expect else 'differ':<8}  {verdict}")
        env.write_result(args, {
            "variants": variants,
            "param_diff_by_step": by_step,
            "tolerance": TOLERANCE,
            "microbatches_per_epoch": microbatches_per_epoch(env, args),
        })


if __name__ == "__main__":
    main()

"""Surviving a crash: checkpoint every K steps, lose a rank, restart, resume bit-identically.

The lab trains the course's transformer with DDP and SGD with momentum, and saves a
checkpoint with torch.distributed.checkpoint (DCP) after every --every steps: the model,
the optimizer's state and the step, each rank's random-number generator beside them, and
last a `latest` marker, so that a crash during a save leaves the previous checkpoint in
force. Each step's batch is drawn from the global generator, so that a resumed run sees the
same data only if that generator's state was saved too. The gradients are averaged one
parameter at a time (a DDP communication hook): DDP regroups its buckets after its first
iteration, and a resumed run would otherwise add its first step's gradients in another
order than the run it continues, which from 3 ranks on changes the last bits.

With --fail-at-step S --fail-rank R, rank R exits at once (os._exit, as a crash would: no
clean-up, no message to its peers) when it reaches step S on the first attempt. Run under
`torchrun --max-restarts=1`, the agent sees the dead worker, stops the others, and starts
the whole group again; the new attempt finds the checkpoint, loads it, and trains the steps
that are left. On several nodes, the other nodes' agents restart their workers too, as a
membership change that they do not count: TORCHELASTIC_RESTART_COUNT is per agent, so the
lab takes the job's count, the largest of its agents' (distenv's `this_start`), to know
that the crash has happened (an agent counts a restart only when its own workers failed,
so which agents count one is a race between the healthy ranks meeting the dead peer and
their agent seeing the new round). With --survivors-busy-s, the other ranks spend that long
outside any collective at the failing step, so that their agent stops them before they
meet the dead peer: the case where a healthy node counts nothing. At the end the same
processes train the same model again from the start without failing or saving, and the
two results must be equal bit for bit.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=2 --max-restarts=1 \\
                          labs/resilience.py --dir ckpt --fail-at-step 7 --fail-rank 1
  GPU box, NCCL:        the same with --nproc_per_node=8
  two nodes (run on each, HOST = node 0's address; --dir on a shared file system;
  the variable gives each start of the group its own store, which a plain
  init_process_group needs after a restart, pytorch#135712):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --nnodes=2 --nproc_per_node=8 --max-restarts=1 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 --rdzv-id=resilience labs/resilience.py \\
             --dir /shared/ckpt --fail-at-step 7 --fail-rank 9 --survivors-busy-s 5

JSON: `restart_count` (the job's restarts: the largest count of its agents, the same on
every rank), `resumed_from_step` (0 when nothing was loaded), `lost_steps` (the
steps trained after the last checkpoint and trained again),
`max_param_diff_vs_uninterrupted`, `max_param_diff_resumed_without_rng_state` (the same
resume with the generator left as a fresh start seeds it, so that the steps after the
checkpoint see the first steps' data again; null when nothing was resumed),
`max_param_diff_resumed_with_ddp_buckets` (a resume, in memory, with DDP's own bucketed
all-reduce instead of the lab's one gradient at a time: not 0.0 from 3 ranks on),
`checkpoint_save_s` {blocking: one dcp.save of the trained state, async: {staging, total}
of one dcp.async_save, or null and `async_save_error` says why}, `checkpoints` (the steps
this attempt saved), `steps`, `every`.
"""

import copy
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from labkit.runtime import distenv
from labkit.parallel.strategies import TorchDDP
from labkit.model.transformer import (Shape, Transformer, add_shape_args, random_batch,
                                      shape_from_args)

SHAPE = Shape(layers=2, hidden=32, heads=4, seq=16, vocab=64)
BATCH = 4            # sequences per rank per step
STEPS, EVERY = 8, 3  # checkpoints after steps 3 and 6
LEARNING_RATE, MOMENTUM = 0.1, 0.9
LATEST = "latest"    # the marker naming the last complete checkpoint


def each_gradient_on_its_own(group, bucket):
    """DDP's averaging, one parameter's gradient at a time instead of a bucket at once.

    Bit for bit, a resumed run must add the ranks' gradients in the same order as the run
    it continues. A ring adds each element in an order set by where the element sits in
    the tensor it reduces, and DDP's buckets change after its first iteration (it
    regroups the gradients in the order they became ready): the first step after a resume
    would group them as step 0 did. With 2 ranks that changes nothing (a + b = b + a);
    with 3, (a + b) + c and a + (b + c) differ in the last bit. Reduced on its own, each
    gradient is added in an order that depends on its parameter alone."""
    buffer = bucket.buffer()
    for piece in buffer.split([p.numel() for p in bucket.parameters()]):
        dist.all_reduce(piece, group=group)
    buffer.div_(dist.get_world_size(group))
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def make(shape, args, env, per_parameter=True):
    """The model and optimizer, from the seed; the global generator seeded per rank.
    per_parameter=False keeps DDP's own bucketed all-reduce."""
    torch.manual_seed(args.seed)
    hook = each_gradient_on_its_own if per_parameter else None
    model = TorchDDP(Transformer(shape, device=env.device), env.device,
                     lambda params: torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM),
                     comm_hook=hook)
    torch.manual_seed(distenv.derived_seed(args.seed, "batches", env.rank))
    return model


def next_batch(shape, env):
    """This rank's next batch, drawn from the global generator: its state decides the data."""
    return random_batch(shape, BATCH, None, env.device)


def train_state(model):
    """The model's and the optimizer's state, as DCP saves and loads it."""
    model_state, optim_state = get_state_dict(model.model, model.optimizer)
    return {"model": model_state, "optim": optim_state}


def save(model, step, directory, env):
    """A checkpoint of step `step`: DCP's shards, each rank's generator, then the marker."""
    path = directory / f"step-{step:06d}"
    dcp.save(train_state(model), checkpoint_id=str(path))
    torch.save(torch.get_rng_state(), path / f"rng-{env.rank}.pt")
    dist.barrier()   # every rank's part is on disk before the marker says so
    if env.is_rank0:
        marker = directory / f".{LATEST}.tmp"
        marker.write_text(json.dumps({"step": step, "path": path.name}))
        os.replace(marker, directory / LATEST)
    dist.barrier()


def load(model, directory, env, restore_rng=True):
    """Load the last complete checkpoint into `model`; its step, or 0 if there is none.
    restore_rng=False leaves the generator as it is: the pitfall of a resume that saved
    the model and the optimizer but not where the data stream was."""
    marker = directory / LATEST
    if not marker.is_file():
        return 0
    saved = json.loads(marker.read_text())
    path = directory / saved["path"]
    state = train_state(model)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model.model, model.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if restore_rng:
        torch.set_rng_state(torch.load(path / f"rng-{env.rank}.pt"))
    return saved["step"]


def resumed_with_ddp_buckets(shape, args, env, at_step):
    """The pitfall of DDP's own bucketed all-reduce: a run trained straight through, and
    the same run continued from a copy of its state at `at_step` (model, optimizer and
    generator, kept in memory) in a new DDP, as a restart builds one. The largest
    difference between the two, 0.0 only where the order of additions did not matter."""
    straight = make(shape, args, env, per_parameter=False)
    for step in range(args.steps):
        if step == at_step:
            state = copy.deepcopy(train_state(straight))
            rng = torch.get_rng_state()
        straight.train_step(*next_batch(shape, env))
    restarted = make(shape, args, env, per_parameter=False)
    set_state_dict(restarted.model, restarted.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    torch.set_rng_state(rng)
    for step in range(at_step, args.steps):
        restarted.train_step(*next_batch(shape, env))
    return distenv.max_param_diff(restarted.parameters(), straight.parameters(), env.device)


def save_seconds(model, directory):
    """Seconds of one blocking dcp.save of the trained state, and {staging, total} of one
    dcp.async_save: that call returns once the state is copied aside, and training could
    go on while it is written (or an error, if it does not run here)."""
    state = train_state(model)
    started = time.perf_counter()
    dcp.save(state, checkpoint_id=str(directory / "timed-blocking"))
    dist.barrier()
    blocking = time.perf_counter() - started
    try:
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(directory / "timed-async"))
        staged = time.perf_counter() - started
        future.result()
        dist.barrier()
        return blocking, {"staging": staged, "total": time.perf_counter() - started}, None
    except Exception as error:   # noqa: BLE001  (reported in the JSON, not hidden)
        return blocking, None, f"{type(error).__name__}: {error}"


def run(args, env):
    shape = shape_from_args(args)
    directory = Path(args.dir)
    restart = env.restarts   # the job's, the same on every rank (not this node's count)
    model = make(shape, args, env)
    resumed = load(model, directory, env)
    env.print0(f"attempt {restart + 1}: " + (f"resumed from the checkpoint of step {resumed}"
                                             if resumed else "no checkpoint, from the start"))
    saved_steps = []
    for step in range(resumed, args.steps):
        if restart == 0 and step == args.fail_at_step:
            if env.rank == args.fail_rank:
                os._exit(1)   # a crash: no clean-up, no word to the other ranks
            # the others busy outside any collective, a long forward, say: their agent,
            # not a failure of theirs, stops them, and counts no restart
            time.sleep(args.survivors_busy_s)
        model.train_step(*next_batch(shape, env))
        if (step + 1) % args.every == 0 and step + 1 < args.steps:
            save(model, step + 1, directory, env)
            saved_steps.append(step + 1)
    trained = [p.detach().clone() for p in model.parameters()]

    blocking_s, async_s, async_error = save_seconds(model, directory)

    uninterrupted = make(shape, args, env)   # the same run, never failing, never saving
    for step in range(args.steps):
        uninterrupted.train_step(*next_batch(shape, env))
    diff = distenv.max_param_diff(trained, uninterrupted.parameters(), env.device)

    without_rng = None   # the same resume, from the same checkpoint, minus the generator
    if resumed:
        naive = make(shape, args, env)   # seeds the generator as a fresh start does
        load(naive, directory, env, restore_rng=False)
        for step in range(resumed, args.steps):
            naive.train_step(*next_batch(shape, env))
        without_rng = distenv.max_param_diff(naive.parameters(), uninterrupted.parameters(),
                                             env.device)
    # split where the real run resumed, or else at its first checkpoint (a step it trains)
    split = resumed or min(args.every, args.steps - 1)
    with_ddp_buckets = resumed_with_ddp_buckets(shape, args, env, split)
    failed = args.fail_at_step is not None and restart > 0
    return {"restart_count": restart, "resumed_from_step": resumed,
            "lost_steps": args.fail_at_step - resumed if failed else 0,
            "max_param_diff_vs_uninterrupted": diff,
            "max_param_diff_resumed_without_rng_state": without_rng,
            "max_param_diff_resumed_with_ddp_buckets": with_ddp_buckets,
            "checkpoint_save_s": {"blocking": blocking_s, "async": async_s},
            "async_save_error": async_error, "checkpoints": saved_steps,
            "steps": args.steps, "every": args.every}


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by all ranks)")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS)
    parser.add_argument("--every", type=distenv.positive_int, default=EVERY,
                        help="save a checkpoint after every K steps")
    parser.add_argument("--fail-at-step", type=distenv.at_least(0), default=None,
                        help="on the first attempt, kill --fail-rank when it reaches this step")
    parser.add_argument("--fail-rank", type=distenv.at_least(0), default=0)
    parser.add_argument("--survivors-busy-s", type=distenv.number_above(0, inclusive=True),
                        default=0.0,
                        metavar="SECONDS",
                        help="at --fail-at-step, the other ranks first spend this long outside "
                             "any collective, so that on two nodes the healthy node's agent "
                             "restarts them as a membership change")
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    shape_from_args(args)
    if args.fail_at_step is not None and args.fail_at_step >= args.steps:
        distenv.fail(f"--fail-at-step {args.fail_at_step} is past the last step "
                     f"({args.steps - 1})")
    return args


def main():
    args = parse_args()
    # dcp.async_save stages the state in CPU memory and saves it from there, which on NCCL
    # needs a CPU backend in the group too ("cpu:gloo,cuda:nccl")
    with distenv.initialize(args, cpu_group=True) as env:
        if args.fail_rank >= env.world_size:
            distenv.fail(f"--fail-rank {args.fail_rank} is not a rank of a world of "
                         f"{env.world_size}")
        result = env.write_result(args, run(args, env))
        if result is not None:
            env.print0(f"restarts {result['restart_count']}, resumed from step "
                       f"{result['resumed_from_step']}, {result['lost_steps']} "
                       f"step{'s' if result['lost_steps'] != 1 else ''} "
                       f"trained twice; max |parameter - uninterrupted| "
                       f"{result['max_param_diff_vs_uninterrupted']:.1e}")


if __name__ == "__main__":
    main()

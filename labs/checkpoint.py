"""Sharded checkpoints: save an FSDP2 run with torch.distributed.checkpoint at one world
size, load it at another, and carry on as if nothing happened.

  save    trains --steps steps with fully_shard (every unit, then the root) and SGD with
          momentum (the FSDP lab's model and optimizer, strategies' FSDP_FAMILY; momentum
          is state the checkpoint must carry), then writes a sharded checkpoint of model and optimizer to --dir:
          each rank writes its own shards, in parallel, and the metadata records how the
          full tensors were cut. Rank 0 also exports a full state dict (plain tensors, on
          CPU) to --dir/full_model.pt for use outside distributed training.
  resume  at any world size: loads the checkpoint into its own shards (DCP reshards on
          load), trains --steps more steps, and compares the result with a run that
          trained all the steps at this world size without stopping. It also loads the
          exported full state dict into a plain, undistributed model.

The data do not depend on the world size: every step uses the same GLOBAL_BATCH
sequences, split evenly over the ranks, so runs at N = 4 and N = 2 see the same data.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/checkpoint.py \\
                          save --dir ckpt --steps 3 --out save.json
                        torchrun --standalone --nproc_per_node=2 labs/checkpoint.py \\
                          resume --dir ckpt --steps 3 --out resume.json
  GPU box, NCCL:        the same with --nproc_per_node=6 (12 sequences split over 6), then 4
  in the FSDP lab's launch: labs/fsdp.py --checkpoint-dir ckpt runs the save phase after
                        its own comparison, in the same processes
  two nodes: run each phase on both nodes with --nnodes=2 --rdzv-backend=c10d
             --rdzv-endpoint=HOST:29500 --rdzv-id=ckpt; --dir must be a shared file system

JSON (both): phase. JSON (save): step, checkpoint_bytes (all files of the sharded checkpoint),
full_export_bytes, param_count.
JSON (resume): saved_world_size, resumed_from_step, total_steps,
max_param_diff_vs_uninterrupted, export_max_diff (the exported full state dict against
the checkpoint as loaded, before training on), param_count.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from labkit import distenv
from labkit.strategies import FSDP_FAMILY as SETUP
from labkit.strategies import apply_fsdp, train_step
from labkit.transformer import Transformer, random_batch

GLOBAL_BATCH = 12      # sequences per step in all: divides by N = 1, 2, 3, 4
STEPS = 3
FULL_EXPORT = "full_model.pt"


def sharded_model(env, seed):
    torch.manual_seed(seed)   # the same initial weights at every world size
    model = apply_fsdp(Transformer(SETUP.shape).to(env.device), env.device)
    return model, SETUP.optimizer(model.parameters())


def train(model, optimizer, steps, env, seed):
    """Train on `steps` (a range of step numbers): each rank takes its slice of the batch."""
    per_rank = GLOBAL_BATCH // env.world_size
    for step in steps:
        ids, targets = random_batch(SETUP.shape, GLOBAL_BATCH,
                                    distenv.generator(seed, "global batch", step), env.device)
        mine = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
        train_step(model, optimizer, ids[mine], targets[mine])


def full_parameters(model):
    """Every parameter as a full tensor (a collective: all ranks call it)."""
    return {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}


def max_diff(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in a)


def save(args, env):
    model, optimizer = sharded_model(env, args.seed)
    train(model, optimizer, range(args.steps), env, args.seed)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state,
              "progress": {"step": torch.tensor(args.steps),
                           "world_size": torch.tensor(env.world_size)}},
             checkpoint_id=args.dir)
    # The full export gathers every tensor; rank 0 alone keeps it, on CPU.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if env.is_rank0:
        torch.save(full, args.dir / FULL_EXPORT)
    dist.barrier()   # every rank's files are written before anyone measures them
    files = [f for f in args.dir.iterdir() if f.name != FULL_EXPORT]
    return {"step": args.steps,
            "checkpoint_bytes": sum(f.stat().st_size for f in files),
            "full_export_bytes": (args.dir / FULL_EXPORT).stat().st_size,
            "param_count": sum(p.numel() for p in model.parameters())}


def resume(args, env):
    if not (args.dir / ".metadata").is_file():
        distenv.fail(f"--dir {args.dir}: no checkpoint there (run the save phase first)")
    model, optimizer = sharded_model(env, args.seed + 1)   # other weights: all must load
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state,
             "progress": {"step": torch.tensor(0), "world_size": torch.tensor(0)}}
    dcp.load(state, checkpoint_id=args.dir)   # into this rank's shards: DCP reshards
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    start = int(state["progress"]["step"])

    loaded = full_parameters(model)
    export_diff = None
    if env.is_rank0:   # the export in an ordinary model, no process group involved
        plain = Transformer(SETUP.shape)
        plain.load_state_dict(torch.load(args.dir / FULL_EXPORT, weights_only=True))
        export_diff = max_diff(dict(plain.named_parameters()), loaded)

    train(model, optimizer, range(start, start + args.steps), env, args.seed)
    uninterrupted, uninterrupted_optimizer = sharded_model(env, args.seed)
    train(uninterrupted, uninterrupted_optimizer, range(start + args.steps), env, args.seed)
    return {"saved_world_size": int(state["progress"]["world_size"]),
            "resumed_from_step": start,
            "total_steps": start + args.steps,
            "max_param_diff_vs_uninterrupted": max_diff(full_parameters(model),
                                                        full_parameters(uninterrupted)),
            "export_max_diff": export_diff,
            "param_count": sum(p.numel() for p in model.parameters())}


def check_world_size(world_size):
    """Every rank takes an equal slice of the global batch, or the lab refuses to start."""
    if GLOBAL_BATCH % world_size:
        distenv.fail(f"the global batch of {GLOBAL_BATCH} sequences does not split over "
                     f"{world_size} ranks; use 1, 2, 3, 4, 6 or 12")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("--dir", type=Path, required=True, help="the checkpoint's folder")
    parser.add_argument("--steps", type=distenv.at_least(0), default=STEPS,
                        help="steps to train before saving, or after resuming")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        check_world_size(env.world_size)
        if args.phase == "save":
            metrics = save(args, env)
            env.print0(f"step {metrics['step']} saved by {env.world_size} ranks: "
                       f"{metrics['checkpoint_bytes']:,} B sharded, "
                       f"{metrics['full_export_bytes']:,} B full export")
        else:
            metrics = resume(args, env)
            env.print0(f"saved by {metrics['saved_world_size']} ranks, resumed by "
                       f"{env.world_size} at step {metrics['resumed_from_step']}, trained to "
                       f"step {metrics['total_steps']}:")
            env.print0(f"  max |resumed - uninterrupted| = "
                       f"{metrics['max_param_diff_vs_uninterrupted']:.2e}")
        env.write_result(args, {"phase": args.phase, **metrics})


if __name__ == "__main__":
    main()

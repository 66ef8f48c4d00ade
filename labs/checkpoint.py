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

from labkit.parallel import sharded_checkpoint
from labkit.runtime import distenv


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("--dir", type=Path, required=True, help="the checkpoint's folder")
    parser.add_argument("--steps", type=distenv.at_least(0), default=sharded_checkpoint.STEPS,
                        help="steps to train before saving, or after resuming")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        sharded_checkpoint.check_world_size(env.world_size)
        if args.phase == "save":
            metrics = sharded_checkpoint.save(args.dir, args.steps, args.seed, env)
            env.print0(f"step {metrics['step']} saved by {env.world_size} ranks: "
                       f"{metrics['checkpoint_bytes']:,} B sharded, "
                       f"{metrics['full_export_bytes']:,} B full export")
        else:
            metrics = sharded_checkpoint.resume(args.dir, args.steps, args.seed, env)
            env.print0(f"saved by {metrics['saved_world_size']} ranks, resumed by "
                       f"{env.world_size} at step {metrics['resumed_from_step']}, trained to "
                       f"step {metrics['total_steps']}:")
            env.print0(f"  max |resumed - uninterrupted| = "
                       f"{metrics['max_param_diff_vs_uninterrupted']:.2e}")
        env.write_result(args, {"phase": args.phase, **metrics})


if __name__ == "__main__":
    main()

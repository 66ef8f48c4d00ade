"""ZeRO through libraries: DeepSpeed's ZeRO-2 and ZeRO-3 engines and Hugging Face
Accelerate, each trained beside torch DDP on the same data and checked against it.

  --library deepspeed-zero2   deepspeed.initialize with "zero_optimization": {"stage": 2}:
                              optimizer state and gradients sharded, parameters whole
  --library deepspeed-zero3   ... "stage": 3: parameters sharded too, gathered per module
  --library accelerate        Accelerator().prepare(model, optimizer): DDP underneath (on
                              CPU Accelerate runs DDP over gloo; its FSDP needs GPUs)

Every run uses the FSDP lab's model, data, SGD with momentum and fp32, so the only thing
that differs from DDP is who moves the bytes: the final parameters must agree to rounding.
Without a GPU, DeepSpeed is pointed at its CPU accelerator (DS_ACCELERATOR=cpu), which
runs its collectives on gloo.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=2 labs/zero_libraries.py \\
                          --library deepspeed-zero3 --out ds3.json
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/zero_libraries.py \\
                          --library deepspeed-zero2 --out ds2.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=zero labs/zero_libraries.py --library accelerate --out acc.json

JSON: library, library_version, max_param_diff_vs_ddp, max_param_change (how far DDP's
weights moved in training), local_param_numel (parameters rank 0 stores: about 1/N of
param_count under ZeRO-3), param_count, steps, deepspeed_config (the DeepSpeed
configuration used; null for Accelerate).
"""

import argparse
import copy
import logging
import os
import warnings

import torch

import distenv
import fsdp
from transformer import Transformer, next_token_loss

LIBRARIES = ("deepspeed-zero2", "deepspeed-zero3", "accelerate")

# DeepSpeed still calls the collectives torch 2.13 renamed: one warning per call otherwise.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|"
                        r"reduce_scatter_tensor)` is deprecated", category=FutureWarning)


def deepspeed_config(stage, world_size):
    """The smallest DeepSpeed configuration that trains like the DDP run beside it."""
    return {
        "train_micro_batch_size_per_gpu": fsdp.BATCH,
        "train_batch_size": fsdp.BATCH * world_size,   # no gradient accumulation
        "optimizer": {"type": "SGD",
                      "params": {"lr": fsdp.LEARNING_RATE, "momentum": fsdp.MOMENTUM}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,   # DeepSpeed vets Adam-like optimizers only
    }


class DeepSpeedRun:
    def __init__(self, model, stage, env):
        if env.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
        import deepspeed
        deepspeed.utils.logger.setLevel(logging.WARNING)
        self.deepspeed, self.stage = deepspeed, stage
        self.config = deepspeed_config(stage, env.world_size)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=self.config)
        self.version = deepspeed.__version__

    def train_step(self, ids, targets):
        loss = next_token_loss(self.engine(ids), targets)
        self.engine.backward(loss)
        self.engine.step()   # the optimizer step and zeroing the gradients

    def local_param_numel(self):
        """Parameters this rank stores: under ZeRO-3 its partitions (`ds_tensor`) only."""
        return sum(p.ds_tensor.numel() if self.stage == 3 else p.numel()
                   for p in self.engine.module.parameters())

    def full_parameters(self):
        params = list(self.engine.module.parameters())
        # ZeRO-3 holds a shard of each parameter: gather them (on every rank) to read them
        with self.deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3):
            return [p.detach().clone() for p in params]


class AccelerateRun:
    def __init__(self, model, env):
        import accelerate
        self.accelerator = accelerate.Accelerator(cpu=env.device.type == "cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=fsdp.LEARNING_RATE,
                                    momentum=fsdp.MOMENTUM)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.config, self.version = None, accelerate.__version__

    def train_step(self, ids, targets):
        self.accelerator.backward(next_token_loss(self.model(ids), targets))
        self.optimizer.step()
        self.optimizer.zero_grad()

    def local_param_numel(self):
        return sum(p.numel() for p in self.model.parameters())

    def full_parameters(self):
        return [p.detach() for p in self.accelerator.unwrap_model(self.model).parameters()]


def run(args, env):
    initial = Transformer(fsdp.SHAPE).to(env.device)
    ddp = fsdp.TorchDDP(copy.deepcopy(initial), env)
    if args.library == "accelerate":
        library = AccelerateRun(copy.deepcopy(initial), env)
    else:
        library = DeepSpeedRun(copy.deepcopy(initial), int(args.library[-1]), env)
    for step in range(args.steps):
        ids, targets = fsdp.batch(args, step, env.rank, env.device)
        ddp.train_step(ids, targets)
        library.train_step(ids, targets)
    trained = list(ddp.model.module.parameters())
    return {"library": args.library,
            "library_version": library.version,
            "max_param_diff_vs_ddp": distenv.max_param_diff(library.full_parameters(), trained,
                                                            env.device),
            # how far training moved the weights: the difference above is small beside it
            "max_param_change": distenv.max_param_diff(trained, list(initial.parameters()),
                                                       env.device),
            "local_param_numel": library.local_param_numel(),
            "param_count": sum(p.numel() for p in initial.parameters()),
            "steps": args.steps,
            "deepspeed_config": library.config}


def parse_args(argv=None):
    parser = distenv.ArgumentParser(description=__doc__.split("\n\n")[0],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", choices=LIBRARIES, required=True)
    parser.add_argument("--steps", type=int, default=fsdp.STEPS, help="training steps")
    distenv.add_common_args(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        distenv.fail(f"--steps must be at least 1, got {args.steps}")
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        metrics = run(args, env)
        env.print0(f"{args.library} {metrics['library_version']} at world size "
                   f"{env.world_size} ({env.backend}), {args.steps} steps: max |p - DDP| = "
                   f"{metrics['max_param_diff_vs_ddp']:.2e}")
        env.write_result("zero_libraries", args, metrics)


if __name__ == "__main__":
    main()

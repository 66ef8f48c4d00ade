"""ZeRO through libraries: DeepSpeed's ZeRO-2 and ZeRO-3 engines and Hugging Face
Accelerate, each trained beside torch DDP on the same data and checked against it.

  --library deepspeed-zero2   deepspeed.initialize with "zero_optimization": {"stage": 2}:
                              optimizer state and gradients sharded, parameters whole
  --library deepspeed-zero3   ... "stage": 3: parameters sharded too, gathered per module
  --library accelerate        Accelerator().prepare(model, optimizer): DDP underneath (on
                              CPU Accelerate runs DDP over gloo; its FSDP needs GPUs)

Every run uses the FSDP lab's model, data, SGD with momentum and fp32 (strategies'
FSDP_FAMILY), so the only thing that differs from DDP is who moves the bytes: the final
parameters must agree to rounding. `--library all` (or a comma-separated list) trains each
in turn in the same launch. Without a GPU, DeepSpeed is pointed at its CPU accelerator
(DS_ACCELERATOR=cpu) and its collectives go through torch.distributed on gloo.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=2 labs/zero_libraries.py \\
                          --library deepspeed-zero3 --out ds3.json
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/zero_libraries.py \\
                          --library deepspeed-zero2 --out ds2.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=zero labs/zero_libraries.py --library accelerate --out acc.json

JSON: param_count, steps, max_param_change (how far DDP's weights moved in training), and
`libraries` {name: {library_version, max_param_diff_vs_ddp, local_param_numel (parameters
rank 0 stores: about 1/N of param_count under ZeRO-3), deepspeed_config (the DeepSpeed
configuration used; null for Accelerate)}}.
"""

import copy
import logging
import os
import warnings

from labkit.runtime import distenv
from labkit.parallel.strategies import FSDP_FAMILY as SETUP
from labkit.parallel.strategies import TorchDDP, rank_batch
from labkit.model.transformer import Transformer, next_token_loss

LIBRARIES = ("deepspeed-zero2", "deepspeed-zero3", "accelerate")

# DeepSpeed still calls the collectives torch 2.13 renamed: one warning per call otherwise.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|"
                        r"reduce_scatter_tensor)` is deprecated", category=FutureWarning)


def deepspeed_config(stage, world_size):
    """The smallest DeepSpeed configuration that trains like the DDP run beside it."""
    return {
        "train_micro_batch_size_per_gpu": SETUP.batch,
        "train_batch_size": SETUP.batch * world_size,   # no gradient accumulation
        "optimizer": {"type": "SGD",
                      "params": {"lr": SETUP.learning_rate, "momentum": SETUP.momentum}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,   # DeepSpeed vets Adam-like optimizers only
    }


class DeepSpeedRun:
    def __init__(self, model, stage, env):
        if env.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
        import deepspeed
        deepspeed.utils.logger.setLevel(logging.WARNING)
        if env.device.type == "cpu":
            # On CPU DeepSpeed would compile a shared-memory all-reduce of its own (a C++
            # extension, half a minute of g++ on first use). Without it, its collectives go
            # through torch.distributed on gloo, as on GPUs they go through it on NCCL.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
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
        optimizer = SETUP.optimizer(model.parameters())
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


def run_library(name, initial, batches, trained, env):
    """Train a copy of `initial` with one library on `batches`; what it holds and how far
    its parameters are from DDP's (`trained`). A library this box lacks (DeepSpeed or
    Accelerate not installed, or built for another torch) raises, and is recorded."""
    if name == "accelerate":
        library = AccelerateRun(copy.deepcopy(initial), env)
    else:
        library = DeepSpeedRun(copy.deepcopy(initial), int(name[-1]), env)
    for ids, targets in batches:
        library.train_step(ids, targets)
    return {"library_version": library.version,
            "max_param_diff_vs_ddp": distenv.max_param_diff(library.full_parameters(),
                                                            trained, env.device),
            "local_param_numel": library.local_param_numel(),
            "deepspeed_config": library.config}


def run(args, env):
    initial = Transformer(SETUP.shape, device=env.device)
    batches = [rank_batch(SETUP.shape, SETUP.batch, args.seed, step, env.rank, env.device)
               for step in range(args.steps)]
    # the reference: torch DDP on the same batches
    ddp = TorchDDP(copy.deepcopy(initial), env.device, SETUP.optimizer)
    for ids, targets in batches:
        ddp.train_step(ids, targets)
    trained = ddp.parameters()
    results = {}
    for name in args.library:
        result = results[name] = distenv.try_variant(
            env, name, lambda: run_library(name, initial, batches, trained, env))
        if "not_run" not in result:
            env.print0(f"{name} {result['library_version']} at world size {env.world_size} "
                       f"({env.backend}), {args.steps} steps: max |p - DDP| = "
                       f"{result['max_param_diff_vs_ddp']:.2e}")
    return {"param_count": sum(p.numel() for p in initial.parameters()),
            "steps": args.steps,
            # how far training moved the weights: the differences above are small beside it
            "max_param_change": distenv.max_param_diff(trained, list(initial.parameters()),
                                                       env.device),
            "libraries": results}


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--library", type=distenv.choice_list(LIBRARIES), required=True,
                        help=f"comma-separated, from {', '.join(LIBRARIES)}; or all")
    parser.add_argument("--steps", type=distenv.positive_int, default=SETUP.steps,
                        help="training steps")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        env.write_result(args, run(args, env))


if __name__ == "__main__":
    main()

"""ZeRO through libraries: DeepSpeed's ZeRO-2 and ZeRO-3 engines and Hugging Face
Accelerate, each trained beside torch DDP on the same data and checked against it.

  --library deepspeed-zero2   deepspeed.initialize with "zero_optimization": {"stage": 2}:
                              optimizer state and gradients sharded, parameters whole
  --library deepspeed-zero3   ... "stage": 3: parameters sharded too, gathered per module,
                              except those under stage3_param_persistence_threshold (1e5
                              elements by default: every tensor of this model), which stay
                              whole on every rank beside their partition
  --library deepspeed-zero3-threshold-0
                              ... with "stage3_param_persistence_threshold": 0: every
                              parameter partitioned, each gathered when its module runs
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
`libraries` {name: {library_version, max_param_diff_vs_ddp, deepspeed_config (the DeepSpeed
configuration used; null for Accelerate), and what rank 0 holds between two steps:
  local_param_numel      parameter elements: its partitions plus every whole tensor
  partition_param_numel  ZeRO-3's partitions alone (`ds_tensor`, about param_count / N)
  whole_param_numel, whole_param_tensors   parameters whose data is whole outside a gather
                         (ZeRO-3: the persistent ones; ZeRO-2, Accelerate: all)
  param_storage_bytes    bytes of the distinct storages behind the parameters and their
                         partitions (measured from the tensors, padding included)
  master_param_bytes     DeepSpeed's fp32 partition of the parameters that the optimizer
                         steps on, counted only where it is a copy beside them (it is, at
                         both stages, even in fp32; 0 for Accelerate)
  persistence_threshold  the engine's stage3_param_persistence_threshold (null below stage 3)
  gathers_per_step       DeepSpeed's own count of its parameter all-gathers in the last step
                         (its comms logger), and gather_bytes_per_step their bytes as it
                         logs them (null for Accelerate)}}.
"""

import copy
import logging
import os
import warnings

from labkit.runtime import distenv
from labkit.parallel.strategies import FSDP_FAMILY as SETUP
from labkit.parallel.strategies import TorchDDP, rank_batch
from labkit.model.transformer import Transformer, next_token_loss

# name: (ZeRO stage, stage3_param_persistence_threshold; None keeps DeepSpeed's default)
DEEPSPEED = {"deepspeed-zero2": (2, None), "deepspeed-zero3": (3, None),
             "deepspeed-zero3-threshold-0": (3, 0)}
LIBRARIES = (*DEEPSPEED, "accelerate")

# DeepSpeed still calls the collectives torch 2.13 renamed: one warning per call otherwise.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|"
                        r"reduce_scatter_tensor)` is deprecated", category=FutureWarning)


def deepspeed_config(stage, world_size, persistence_threshold=None):
    """The smallest DeepSpeed configuration that trains like the DDP run beside it."""
    zero = {"stage": stage}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": SETUP.batch,
        "train_batch_size": SETUP.batch * world_size,   # no gradient accumulation
        "optimizer": {"type": "SGD",
                      "params": {"lr": SETUP.learning_rate, "momentum": SETUP.momentum}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,   # DeepSpeed vets Adam-like optimizers only
    }


def storage_bytes(tensors, besides=()):
    """Bytes of the distinct storages behind `tensors` that are not behind `besides`: views
    of one buffer count once (DeepSpeed keeps its partitions as views of one flat buffer),
    empty ones nothing."""
    storages, skip = {}, {t.untyped_storage().data_ptr() for t in besides}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class DeepSpeedRun:
    def __init__(self, model, stage, env, persistence_threshold=None):
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
        self.config = deepspeed_config(stage, env.world_size, persistence_threshold)
        # DeepSpeed reads LOCAL_RANK to choose its device, which torchrun sets and a plain
        # `python` world of one does not; this rank's own GPU, not torchrun's local rank
        # (two agents on one host number their ranks from 0 each)
        os.environ.setdefault("LOCAL_RANK", str(env.device.index or 0))
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=self.config)
        self.version = deepspeed.__version__

    def train_step(self, ids, targets):
        loss = next_token_loss(self.engine(ids), targets)
        self.engine.backward(loss)
        self.engine.step()   # the optimizer step and zeroing the gradients

    def train_counting(self, batches):
        """Train on `batches`; DeepSpeed's comms logger counts the last step's all-gathers
        (only the parameters' are all-gathers here: the gradients are reduce-scattered)."""
        comm = self.deepspeed.comm
        for index, (ids, targets) in enumerate(batches):
            if index == len(batches) - 1:
                comm.comms_logger.enabled, comm.comms_logger.prof_all = True, True
                comm.comms_logger.comms_dict = {}
            try:
                self.train_step(ids, targets)
            finally:
                comm.comms_logger.enabled = False
        # {op: {message bytes as DeepSpeed logs them: [count, latencies, ...]}}
        logged = comm.comms_logger.comms_dict
        return {"collectives_per_step": {op: sum(record[0] for record in sizes.values())
                                         for op, sizes in logged.items()},
                "collective_bytes_per_step": {op: sum(size * record[0]
                                                      for size, record in sizes.items())
                                              for op, sizes in logged.items()}}

    def held(self):
        """What this rank holds between steps. Under ZeRO-3 a parameter's `.data` is empty
        (shape [0]) outside a gather, unless it is persistent: then it is whole, and its
        partition (`ds_tensor`) is kept beside it."""
        params = list(self.engine.module.parameters())
        partitions = [p.ds_tensor for p in params] if self.stage == 3 else []
        whole = [p for p in params if p.data.numel() > 0]
        optimizer = self.engine.optimizer
        master = (optimizer.fp32_partitioned_groups_flat if self.stage == 3
                  else optimizer.single_partition_of_fp32_groups)
        return {"local_param_numel": sum(p.numel() for p in whole)
                                     + sum(t.numel() for t in partitions),
                "partition_param_numel": sum(t.numel() for t in partitions),
                "whole_param_numel": sum(p.numel() for p in whole),
                "whole_param_tensors": len(whole),
                "param_storage_bytes": storage_bytes([p.data for p in params] + partitions),
                "master_param_bytes": storage_bytes(master, besides=[p.data for p in params]
                                                    + partitions),
                "persistence_threshold": (self.engine.zero_param_persistence_threshold()
                                          if self.stage == 3 else None)}

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

    def train_counting(self, batches):
        for ids, targets in batches:
            self.train_step(ids, targets)
        return {"collectives_per_step": None, "collective_bytes_per_step": None}

    def held(self):
        params = list(self.model.parameters())
        numel = sum(p.numel() for p in params)
        return {"local_param_numel": numel, "partition_param_numel": 0,
                "whole_param_numel": numel, "whole_param_tensors": len(params),
                "param_storage_bytes": storage_bytes(params), "master_param_bytes": 0,
                "persistence_threshold": None}

    def full_parameters(self):
        return [p.detach() for p in self.accelerator.unwrap_model(self.model).parameters()]


def run_library(name, initial, batches, trained, env):
    """Train a copy of `initial` with one library on `batches`; what it holds and how far
    its parameters are from DDP's (`trained`). A library this box lacks (DeepSpeed or
    Accelerate not installed, or built for another torch) raises, and is recorded."""
    if name == "accelerate":
        library = AccelerateRun(copy.deepcopy(initial), env)
    else:
        stage, threshold = DEEPSPEED[name]
        library = DeepSpeedRun(copy.deepcopy(initial), stage, env, threshold)
    gathers = library.train_counting(batches)
    held = library.held()   # before full_parameters(), which gathers everything
    return {"library_version": library.version,
            "max_param_diff_vs_ddp": distenv.max_param_diff(library.full_parameters(),
                                                            trained, env.device),
            **held, **gathers, "deepspeed_config": library.config}


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
                       f"{result['max_param_diff_vs_ddp']:.2e}; rank 0 holds "
                       f"{result['local_param_numel']:,} parameter elements "
                       f"({result['whole_param_tensors']} tensors whole)")
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

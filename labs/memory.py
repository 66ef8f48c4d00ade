"""Memory per GPU: predict it with the formulas, then measure it in torch's DDP, ZeRO-1 and FSDP2.

  predict  bytes per GPU of parameters, gradients and optimizer state for ddp, zero1, zero2
           and zero3 (memory_model's formulas); from a model shape, activations too.
  measure  trains a few steps of a small transformer with torch's own implementation and
           counts the bytes of the tensors rank 0 holds (its local shards only):
             ddp    DistributedDataParallel
             zero1  DDP + ZeroRedundancyOptimizer (optimizer state sharded)
             zero2  FSDP2 fully_shard(reshard_after_forward=False)
             zero3  FSDP2 fully_shard(reshard_after_forward=True)
           Parameters are counted after the forward pass (what it left gathered), gradients
           after backward, optimizer state after the step. Beside the counts, the bytes
           the allocator itself holds for the strategy at the same points, and at the
           step's peak: on a GPU from the CUDA caching allocator, on a CPU from c10's
           allocator through torch.profiler's memory events, in a simulated world only
           (allocator_source: gloo's threads free tensors where the profiler does not
           hear it).

  Several strategies (a comma-separated list, or all) run one after another in the same
  processes, and --simulate-world-size takes a list: one process measures rank 0 of each
  simulated world in turn (1 in the list too: in a real world of one, DDP and ZeRO-1
  would still hand their tensors to gloo's threads).

Launch lines (from the repository root):
  the ZeRO paper's example:  python labs/memory.py predict --params 7.5B --gpus 64
  from a model shape:        python labs/memory.py predict --layers 32 --hidden 4096 \\
                               --heads 32 --seq 2048 --batch 1 --vocab 32000 --gpus 8
  GPT-2 (tied head):         python labs/memory.py predict --layers 12 --hidden 768 \\
                               --heads 12 --seq 1024 --vocab 50257 --tie-embeddings
  3-D, 70B on 8 x 4 x 8:     python labs/memory.py predict --layers 80 --hidden 8192 \\
                               --heads 64 --seq 4096 --vocab 128256 --gpus 8 --pp 4 --tp 8 \\
                               --microbatches 16 --sequence-parallel
  laptop, gloo on CPU:       torchrun --standalone --nproc_per_node=4 labs/memory.py \\
                               measure --strategy all --out mem.json
  rank 0 of 1024, simulated: python labs/memory.py measure --strategy zero3 \\
                               --simulate-world-size 1024 --out mem.json
  GPU box, NCCL:             torchrun --standalone --nproc_per_node=8 labs/memory.py \\
                               measure --strategy zero3 --out mem.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=memory labs/memory.py measure --strategy zero3 --out mem.json

predict --json prints {strategy: {params, grads, optimizer, total}} in bytes (from a model
shape also activations and activations_checkpointed, their peaks, and per_gpu and
per_gpu_checkpointed, states and activations together, for each strategy). With --tp and
--pp the figures are those of the fullest GPU of dp (--gpus) x pp x tp: a pipeline stage's
share of the layers split tp ways, with the micro-batches its schedule holds at once.
measure's JSON: `measurements`, one per (world size, strategy): [{world_size, simulated,
strategy, measured_bytes (counted from the registered parameters, their gradients and the
optimizer's state) and predicted_bytes {params, grads, optimizer, total}, held_bytes (the
same, with the parameters counted from every storage the library keeps: FSDP2's sharded
parameters beside the gathered ones),
layout_bytes (the same predicted from the exact shard layout: FSDP2's row chunks, ZeRO-1's
whole-tensor partition), step_counter_bytes (Adam's step counters, not in the formulas),
peak_cuda_bytes (the peak of CUDA memory allocated above what was allocated before the
strategy built its model, cuBLAS's workspaces included in neither) and predicted_peak_bytes
(states + the larger of activations and Adam's step temporaries); both on a GPU, null on
CPU}, held_after_step_bytes (held_bytes after the optimizer step, when FSDP2 has
resharded every unit), allocated_bytes {after_forward, after_backward, after_step,
accumulating_forward, step_peak} (the allocator's bytes above what it held before the
strategy built its model, in the last step; accumulating_forward after one more forward
pass that kept the step's gradients, as gradient accumulation does; null where not
measured) and buffer_bytes (the model's buffers)}]; `allocator` (where allocated_bytes
come from, or why not); `cuda_workspace_bytes` (cuBLAS's workspaces, allocated by a
warm-up before anything is measured; null on CPU); `activation_bytes` {measured_per_layer, predicted_per_layer,
measured, predicted}; `param_count`, `shape`, `optimizer`, `precision`. With several
simulated worlds the top-level world_size is 1 (one process) and `simulated_world_sizes`
lists them.
"""

import dataclasses
import gc
import json
import os

import torch

from labkit.runtime import distenv
from labkit.predict import memory_model
from labkit.runtime.activations import count_activation_bytes
from labkit.runtime.profiling import allocator_walk
from labkit.parallel.strategies import apply_ddp, apply_fsdp, rank_batch
from labkit.model.transformer import Shape, Transformer, next_token_loss, random_batch

# The measured model: every sharded dimension (192, 384, 576, 768) divides by 1, 2, 3,
# 4 and 64, so FSDP2's shards are exactly 1/N there; at N = 128 and beyond they are not.
SHAPE = Shape(layers=2, hidden=192, heads=4, seq=192, vocab=384)
BATCH = 2      # sequences per rank per step
STEPS = 2      # Adam allocates its state in the first step; the second is the steady state
LEARNING_RATE = 1e-3
PRECISION = "fp32"  # torch's DDP, ZeRO-1 and FSDP2 keep fp32 states (see the chapter)
GB = 1e9
SHAPE_FIELDS = [field.name for field in dataclasses.fields(Shape)]

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": LEARNING_RATE}),
    "sgd": (torch.optim.SGD, {"lr": LEARNING_RATE}),
    "momentum": (torch.optim.SGD, {"lr": LEARNING_RATE, "momentum": 0.9}),
}


def wrap(model, strategy, env, optimizer_name):
    """(module to call, optimizer) for one strategy, built with torch's own implementation."""
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    if strategy in ("ddp", "zero1"):
        # gradient_as_bucket_view: gradients live in DDP's buckets instead of beside them
        wrapped = apply_ddp(model, env.device, gradient_as_bucket_view=True,
                            comm_hook=skip_allreduce if env.simulated else None)
        if strategy == "ddp":
            return wrapped, optimizer_class(wrapped.parameters(), **options)
        # imported here: torch.distributed.optim warns about torch.jit when imported
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(),
                                                optimizer_class=optimizer_class, **options)
    # FSDP2, one unit per embedding, block and head
    model = apply_fsdp(model, env.device, reshard_after_forward=strategy == "zero3")
    return model, optimizer_class(model.parameters(), **options)


def skip_allreduce(state, bucket):
    """DDP communication hook for the fake process group: its all-reduce returns no tensor."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def train_and_count(wrapped, optimizer, shape, args, env, probe, one_more_forward):
    """Train `args.steps` steps; count what rank 0 holds in the last one, and mark its
    points and its peak on the allocator `probe`. With `one_more_forward` (on every rank:
    a forward may communicate), one more forward pass, keeping the step's gradients, as the
    second micro-batch of gradient accumulation does: at its end every state the formulas
    count is alive at once, beside the activations."""
    counted = {}
    for step in range(args.steps):
        last = step == args.steps - 1
        if last:
            probe.begin_peak()
        optimizer.zero_grad(set_to_none=True)
        ids, targets = rank_batch(shape, args.batch, args.seed, step, env.rank, env.device)
        loss = next_token_loss(wrapped(ids), targets)
        if last:
            probe.mark("after_forward")
        counted["params"] = distenv.local_bytes(wrapped.parameters())
        held_params = held_param_bytes(wrapped)
        loss.backward()
        if last:
            probe.mark("after_backward")
        counted["grads"] = distenv.local_bytes(p.grad for p in wrapped.parameters()
                                               if p.grad is not None)
        optimizer.step()
        if last:
            probe.mark("after_step")
            probe.end_peak()
    held_params_after_step = held_param_bytes(wrapped)   # FSDP2 has resharded every unit
    if one_more_forward:
        loss = next_token_loss(wrapped(ids), targets)   # its backward never runs: the run ends
        probe.mark("accumulating_forward")
        del loss
    # ZeroRedundancyOptimizer keeps this rank's partition in an inner optimizer, `.optim`
    local_optimizer = getattr(optimizer, "optim", optimizer)
    state = [t for per_param in local_optimizer.state.values() for t in per_param.values()
             if torch.is_tensor(t)]
    counted["optimizer"] = distenv.local_bytes(t for t in state if t.dim() > 0)
    counted["total"] = counted["params"] + counted["grads"] + counted["optimizer"]
    step_counters = distenv.local_bytes(t for t in state if t.dim() == 0)
    held = {**counted, "params": held_params}
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    after_step = {**counted, "params": held_params_after_step}
    after_step["total"] = after_step["params"] + after_step["grads"] + after_step["optimizer"]
    return counted, held, after_step, step_counters


class AllocatorProbe:
    """Bytes the allocator holds for one strategy, above what it held when the probe was
    opened (before the strategy built its model): at named points, and the most between
    begin_peak() and end_peak(). Not counted from tensors: the allocator's own figures.

    On a GPU, the CUDA caching allocator's counters (memory_allocated; max_memory_allocated
    after reset_peak_memory_stats), its blocks rounded up to 512 bytes. On a CPU c10's
    allocator keeps no counter, but with profile_memory=True torch.profiler receives every
    allocation and free it makes, with its size (c10/core/CPUAllocator.cpp,
    ProfiledCPUMemoryReporter): the probe keeps a profiler open on this thread, marks each
    point with a record_function, and afterwards adds up the sizes in the order they came.
    The reporter knows the size only of what was allocated while profiling (a block from
    before, freed meanwhile, goes uncounted), which is why the probe opens before the model
    exists. Closed (`enabled` False: not rank 0, or not measured here, allocator_source),
    it measures nothing and its figures are None.
    """

    MARK = "memory.py: "

    def __init__(self, device, enabled=True):
        self.device, self.enabled = device, enabled
        self.cuda = device.type == "cuda"
        self.marks, self.peak, self.run_peak = {}, None, None

    def __enter__(self):
        if not self.enabled:
            return self
        if self.cuda:
            # the previous strategy's kernels done, so the blocks their streams held (a
            # collective's buffers, recorded on NCCL's stream) are back before the baseline
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile
        # Kineto prints a line as each profiler starts and stops; here it is an instrument
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def mark(self, name):
        if not self.enabled:
            return
        if self.cuda:
            self.marks[name] = torch.cuda.memory_allocated(self.device) - self.baseline
        else:
            with torch.profiler.record_function(self.MARK + name):
                pass

    def begin_peak(self):
        if self.enabled and self.cuda:   # the peak so far is kept for run_peak
            self.run_peak = torch.cuda.max_memory_allocated(self.device) - self.baseline
            torch.cuda.reset_peak_memory_stats(self.device)
        self.mark("begin_peak")

    def end_peak(self):
        if self.enabled and self.cuda:
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.baseline
            self.run_peak = max(self.run_peak, self.peak)
        self.mark("end_peak")

    def __exit__(self, *failure):
        if self.enabled and self.cuda and self.run_peak is not None:
            # the accumulating forward runs after end_peak: the run's peak includes it
            self.run_peak = max(self.run_peak,
                                torch.cuda.max_memory_allocated(self.device) - self.baseline)
        if not self.enabled or self.cuda:
            return
        self.profiler.__exit__(*failure)
        if failure[0] is not None:
            return
        # every allocation and free of c10's CPU allocator on this thread, and the marks
        in_window = False
        for _, event, held in allocator_walk(self.profiler, self.MARK):
            if event.name() == "[memory]":
                if in_window:
                    self.peak = max(self.peak, held)
                continue
            name = event.name()[len(self.MARK):]
            self.marks[name] = held
            if name == "begin_peak":
                in_window, self.peak = True, held
            elif name == "end_peak":
                in_window = False


def held_param_bytes(model):
    """Bytes of parameters this rank holds, from the storages the library keeps rather than
    from the parameters registered on the module. FSDP2 registers either the sharded or the
    gathered parameters, but keeps each FSDPParam's sharded data all along (torch 2.13,
    _fsdp_param.py: `_sharded_param_data`, and to_unsharded only swaps which one the module
    sees): while a unit is gathered, it holds both."""
    from torch.distributed.fsdp import FSDPModule
    storages = {}
    tensors = [distenv.local_tensor(p) for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            # torch 2.11 holds a list of groups; 2.6-2.10 one group, or None for the root
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g]
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    tensors += [fsdp_param._sharded_param_data,
                                *getattr(fsdp_param, "all_gather_outputs", [])]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():   # a freed all-gather output is resized to 0 bytes
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def layout_bytes(model, strategy, world_size, rank, optimizer_name):
    """What rank `rank` holds under the real shard layout, from the parameter shapes alone."""
    p, g, k = memory_model.bytes_per_parameter(optimizer_name, PRECISION)
    numels = [param.numel() for param in model.parameters()]
    full = sum(numels)
    if strategy in ("ddp", "zero1"):
        owners = memory_model.zero1_partition(numels, world_size)
        mine = sum(n for n, owner in zip(numels, owners) if owner == rank)
        held = (full, full, full if strategy == "ddp" else mine)
    else:
        shard = sum(memory_model.fsdp2_shard_numel(tuple(param.shape), world_size, rank)
                    for param in model.parameters())
        held = (full if strategy == "zero2" else shard, shard, shard)
    result = {"params": p * held[0], "grads": g * held[1], "optimizer": k * held[2]}
    result["total"] = sum(result.values())
    return result


def measure(args):
    """Every strategy at this world size, or at each simulated one; rank 0 writes them all."""
    worlds = args.simulate_world_size or [None]
    measurements, shared, sources = [], None, []
    for index, simulated in enumerate(worlds):
        with distenv.initialize(args, simulate_world_size=simulated) as env:
            if shared is None:
                shared = model_facts(args, env)
                activations = shared["activation_bytes"]
                env.print0(f"{shared['param_count']:,} parameters, {args.optimizer}, fp32")
                if shared["cuda_workspace_bytes"] is not None:
                    env.print0(f"cuBLAS workspaces: {shared['cuda_workspace_bytes']:,} bytes, "
                               f"in no peak below")
                env.print0(f"activations per layer: measured "
                           f"{activations['measured_per_layer']:,} bytes, formula "
                           f"{activations['predicted_per_layer']:,}")
            sources.append(allocator_source(args, env))
            for strategy in args.strategy:
                # Each strategy measured in a function of its own, so its wrapped model and
                # optimizer are gone before the next one, and before the group is destroyed.
                row = measure_strategy(strategy, args, env)
                report(row, env)
                measurements.append(row)
                gc.collect()
                gc.freeze()   # what survived (the optimizer's first step imports the
                              # compiler) is not scanned again: see distenv.initialize
            if index == len(worlds) - 1:
                extra = {}
                if len(worlds) > 1:   # one process stood for several worlds
                    env = dataclasses.replace(env, world_size=1)
                    extra = {"simulated_world_sizes": worlds}
                # where the allocator's bytes come from, or why no world has them
                read = [source for measured, source in sources if measured]
                env.write_result(args, {**shared, **extra, "measurements": measurements,
                                        "allocator": (read or [sources[-1][1]])[0]})


def model_facts(args, env):
    """What does not depend on the strategy: the model's size, and its activations, counted
    in one forward of the bare model."""
    shape = shape_of(args)
    # first, before any matrix product has made a workspace
    workspace = warm_up_cublas(env.device) if env.device.type == "cuda" else None
    torch.manual_seed(args.seed)
    with torch.device(env.device):   # built where it lives (see measure_strategy)
        model = Transformer(shape)
    ids, targets = random_batch(shape, args.batch, distenv.generator(args.seed, "activations"),
                                env.device)
    kept = count_activation_bytes(model, lambda: next_token_loss(model(ids), targets))
    value_bytes = 4  # fp32 activations, no dropout in this model
    return {
        "optimizer": args.optimizer, "precision": PRECISION,
        "cuda_workspace_bytes": workspace,
        "shape": dataclasses.asdict(shape) | {"batch": args.batch},
        "param_count": sum(p.numel() for p in model.parameters()),
        "activation_bytes": {
            "measured_per_layer": kept[0],
            "predicted_per_layer": memory_model.activation_bytes_per_layer(
                shape.seq, args.batch, shape.hidden, shape.heads, value_bytes, dropout=False),
            "measured": sum(kept.values()),
            "predicted": memory_model.activation_bytes(
                shape.layers, shape.seq, args.batch, shape.hidden, shape.heads, shape.vocab,
                value_bytes, dropout=False)[0]},
    }


def warm_up_cublas(device):
    """Bytes of cuBLAS workspace that a forward and backward leave allocated on a GPU.

    torch 2.13 (aten/src/ATen/cuda/CublasHandlePool.cpp, setWorkspaceForHandle) gives each
    pair of cuBLAS handle and stream a workspace of torch.backends.cuda.cublas_workspace_size()
    bytes (CUBLAS_WORKSPACE_CONFIG; by default 32 MiB on sm90, 8 MiB + 128 KiB on sm80),
    from the caching allocator, kept until the process ends: memory_allocated counts it.
    Handles are per thread, and autograd runs a GPU's backward on a thread of its own: a
    forward and a backward leave two. Made here, before anything is measured, they are part
    of every strategy's baseline and of no peak. A linear layer takes the path the model's
    do (cuBLASLt, which shares the workspace unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0)."""
    before = torch.cuda.memory_allocated(device)   # the allocator counts on the host
    weight = torch.ones(64, 64, device=device, requires_grad=True)
    bias = torch.zeros(64, device=device, requires_grad=True)
    torch.nn.functional.linear(weight, weight, bias).sum().backward()
    del weight, bias   # and their gradients: only the workspaces stay
    return torch.cuda.memory_allocated(device) - before


def measure_strategy(strategy, args, env):
    """Build, wrap and train the model under one strategy; what rank 0 holds, measured and
    predicted."""
    shape = shape_of(args)
    # The allocator's figures are taken above what it holds now (on a GPU, cuBLAS's
    # workspaces, see warm_up_cublas), so that they hold what this strategy allocates.
    measured_here = allocator_source(args, env)[0]
    with AllocatorProbe(env.device, env.is_rank0 and measured_here) as probe:
        torch.manual_seed(args.seed)   # the same initial weights for every strategy
        # Built on its device, not moved there: a GPU holds no CPU copy first, and under
        # LABS_DEVICE_GUARD a model built without a device would be meta, with nothing to copy.
        with torch.device(env.device):
            model = Transformer(shape)
        param_count = sum(p.numel() for p in model.parameters())
        buffer_bytes = distenv.local_bytes(model.buffers())
        layout = layout_bytes(model, strategy, env.world_size, env.rank, args.optimizer)
        wrapped, optimizer = wrap(model, strategy, env, args.optimizer)
        measured, held, held_after_step, step_counters = train_and_count(
            wrapped, optimizer, shape, args, env, probe, one_more_forward=measured_here)
    predicted = memory_model.state_bytes_per_gpu(param_count, env.world_size, strategy,
                                                 args.optimizer, PRECISION)
    predicted_peak = None
    if env.device.type == "cuda":
        activations = memory_model.activation_bytes(
            shape.layers, shape.seq, args.batch, shape.hidden, shape.heads, shape.vocab,
            4, dropout=False)[1]
        # On CUDA, Adam steps with foreach kernels, whose temporary list lives during the
        # step, when the activations are gone: the peak holds the larger of the two.
        state_bytes = memory_model.bytes_per_parameter(args.optimizer, PRECISION)[2]
        temporaries = memory_model.optimizer_step_temporary_bytes(
            predicted["optimizer"] / state_bytes if state_bytes else 0, args.optimizer)
        predicted_peak = predicted["total"] + max(activations, temporaries)
    allocated = None
    if probe.marks:
        allocated = {point: probe.marks[point] for point in (
            "after_forward", "after_backward", "after_step", "accumulating_forward")}
        allocated["step_peak"] = probe.peak
    return {"world_size": env.world_size, "simulated": env.simulated, "strategy": strategy,
            "measured_bytes": measured, "held_bytes": held,
            "held_after_step_bytes": held_after_step,
            "predicted_bytes": predicted, "layout_bytes": layout,
            "step_counter_bytes": step_counters,
            "peak_cuda_bytes": probe.run_peak, "predicted_peak_bytes": predicted_peak,
            "allocated_bytes": allocated, "buffer_bytes": buffer_bytes}


def allocator_source(args, env):
    """(whether the allocator's bytes are measured here, where they come from or why not)."""
    if env.device.type == "cuda":
        return True, "the CUDA caching allocator (torch.cuda.memory_allocated)"
    if args.allocator_max_world is not None and env.world_size > args.allocator_max_world:
        return False, f"not measured above --allocator-max-world {args.allocator_max_world}"
    if env.simulated:
        return True, "c10's CPU allocator, through torch.profiler's memory events"
    # gloo runs a collective on threads of its own (a world of one too, for DDP and
    # ZeRO-1), carrying the profiling thread's state while the collective runs; once it
    # has run, such a thread can drop the last reference to a tensor the collective held,
    # and that free goes unheard, so the sum would keep bytes already freed
    return False, ("not measured: gloo frees some tensors on its own threads after a "
                   "collective, where the profiler does not see it; --simulate-world-size "
                   "measures them")


def report(row, env):
    """Rank 0 prints measured, formula and layout bytes side by side."""
    measured, predicted, layout = row["measured_bytes"], row["predicted_bytes"], row["layout_bytes"]
    where = "simulated " if env.simulated else ""
    env.print0(f"{row['strategy']}: rank 0 of a {where}world of {env.world_size} on "
               f"{env.device}")
    env.print0(f"{'bytes':>10} {'measured':>12} {'formula':>12} {'layout':>12}")
    for key in ("params", "grads", "optimizer", "total"):
        env.print0(f"{key:>10} {measured[key]:>12,} {predicted[key]:>12,.0f} {layout[key]:>12,}")
    allocated = row["allocated_bytes"]
    if allocated is not None:
        env.print0(f"allocator: {allocated['after_step']:,} B after the step, "
                   f"{allocated['step_peak']:,} B at its peak, "
                   f"{allocated['accumulating_forward']:,} B after one more forward")
    if row["peak_cuda_bytes"] is not None:
        env.print0(f"peak CUDA memory above the baseline {row['peak_cuda_bytes']:,} bytes; "
                   f"predicted {row['predicted_peak_bytes']:,.0f} (states + the larger of "
                   f"activations and Adam's step temporaries)")


def predict(args):
    if args.params is not None:
        params, shape = args.params, None
    else:
        shape = shape_of(args)
        params = memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab,
                                                 shape.seq, tied_head=args.tie_embeddings)
    table = {}
    for strategy in memory_model.STRATEGIES:
        if shape is None:
            table[strategy] = memory_model.state_bytes_per_gpu(params, args.gpus, strategy,
                                                               args.optimizer, args.precision)
            continue
        # the fullest GPU of the configuration, without and with checkpointing
        full, checkpointed = (memory_model.config_bytes_per_gpu(
            shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab, args.gpus,
            args.pp, args.tp, strategy, args.batch, args.microbatches, args.schedule,
            args.sequence_parallel, checkpointing, args.optimizer, args.precision,
            args.dropout, args.tie_embeddings, args.stage_layers)
            for checkpointing in (False, True))
        table[strategy] = {"params": full["params"], "grads": full["grads"],
                           "optimizer": full["optimizer"], "total": full["states"],
                           "activations": full["activations"],
                           "activations_checkpointed": checkpointed["activations"],
                           "per_gpu": full["total"],
                           "per_gpu_checkpointed": checkpointed["total"]}
    activations = None if shape is None else table["ddp"]
    if args.json:
        print(json.dumps(table, indent=1))
        return
    p, g, k = memory_model.bytes_per_parameter(args.optimizer, args.precision)
    layout = (f" x pp {args.pp} x tp {args.tp}" if (args.pp, args.tp) != (1, 1) else "")
    print(f"{params:,} parameters ({params / 1e9:.3f} B) on {args.gpus} GPUs{layout}, "
          f"{args.optimizer}, {args.precision}: {p} + {g} + {k} bytes per parameter "
          f"(GB = 1e9 bytes per GPU)")
    columns = ("params", "grads", "optimizer", "total")
    print(f"{'strategy':<9}" + "".join(f"{key:>11}" for key in columns))
    for strategy, row in table.items():
        print(f"{strategy:<9}" + "".join(f"{row[key] / GB:>11.2f}" for key in columns))
    if activations:
        print(f"activations per GPU at batch {args.batch}: {activations['activations'] / GB:.2f} GB, "
              f"with full checkpointing {activations['activations_checkpointed'] / GB:.2f} GB "
              f"(peak, {'with' if args.dropout else 'no'} dropout"
              + (f"; {args.microbatches} micro-batches, {args.schedule}, the fullest stage"
                 if args.pp > 1 else "") + ")")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__, common=False)
    commands = parser.add_subparsers(dest="command", required=True)
    pred = commands.add_parser("predict", help="bytes per GPU from the formulas")
    pred.add_argument("--params", help="parameter count, e.g. 7.5B, 350M, 1.3e9")
    pred.add_argument("--gpus", type=distenv.positive_int, default=1,
                      help="data-parallel ranks N")
    pred.add_argument("--optimizer", choices=memory_model.OPTIMIZERS, default="adam")
    pred.add_argument("--precision", choices=memory_model.PRECISIONS, default="mixed")
    pred.add_argument("--batch", type=distenv.positive_int, default=1,
                      help="sequences per GPU (activations)")
    pred.add_argument("--no-dropout", dest="dropout", action="store_false",
                      help="activations of a model trained without dropout")
    pred.add_argument("--tie-embeddings", action="store_true",
                      help="the output head shares the token embedding's weights "
                           "(GPT-2, GPT-3): V x h parameters fewer")
    pred.add_argument("--tp", type=distenv.positive_int, default=1,
                      help="tensor-parallel degree (needs a model shape)")
    pred.add_argument("--pp", type=distenv.positive_int, default=1,
                      help="pipeline stages (needs a model shape); --gpus stays the "
                           "data-parallel degree, the world is gpus x pp x tp")
    pred.add_argument("--stage-layers", type=distenv.int_list(1), default=None,
                      metavar="L0,L1,...", help="layers of each of the --pp stages "
                      "(default: as even as they go); they must add up to --layers")
    pred.add_argument("--microbatches", type=distenv.positive_int, default=1,
                      help="micro-batches per step, m, of --batch sequences each")
    pred.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                      help="pipeline schedule: how many micro-batches a stage holds at once")
    pred.add_argument("--sequence-parallel", action="store_true",
                      help="with --tp: the LayerNorms and dropouts hold 1/t of the tokens")
    pred.add_argument("--json", action="store_true", help="print JSON, bytes per GPU")
    meas = commands.add_parser("measure", help="count what rank 0 holds in torch's own")
    meas.add_argument("--strategy", required=True,
                      type=distenv.choice_list(memory_model.STRATEGIES),
                      help=f"comma-separated, from {', '.join(memory_model.STRATEGIES)}; or all")
    meas.add_argument("--optimizer", choices=memory_model.OPTIMIZERS, default="adam")
    meas.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                      help="sequences per rank per step")
    meas.add_argument("--steps", type=distenv.positive_int, default=STEPS, help="training steps")
    meas.add_argument("--allocator-max-world", type=distenv.at_least(0), default=None,
                      metavar="N", help="on a CPU, read the allocator's bytes "
                      "(allocated_bytes) only in worlds of at most N ranks (0: none; default: "
                      "every world): it needs torch.profiler through each strategy, whose "
                      "cost grows with N as FSDP2 cuts every tensor N ways")
    meas.add_argument("--simulate-world-size", type=distenv.int_list(1), default=None,
                      metavar="N[,N...]",
                      help="be rank 0 of a world of N in this one process (fake process "
                           "group), for each N in turn")
    distenv.add_common_args(meas)
    for sub, default in ((pred, None), (meas, SHAPE)):
        group = sub.add_argument_group("model shape (GPT-style transformer)")
        for field in SHAPE_FIELDS:
            group.add_argument(f"--{field}", type=int,
                               default=getattr(default, field) if default else None)
    args = parser.parse_args(argv)
    return check_args(args)


def shape_of(args):
    return Shape(*(getattr(args, field) for field in SHAPE_FIELDS))


def check_args(args):
    given = [f for f in SHAPE_FIELDS if getattr(args, f) is not None]
    if args.command == "predict":
        if args.params is not None:
            if given:
                distenv.fail("give --params or a model shape (--layers ...), not both")
            if args.tie_embeddings:
                distenv.fail("--tie-embeddings needs a model shape (--layers ...), not --params")
            if (args.tp, args.pp) != (1, 1):
                distenv.fail("--tp and --pp need a model shape (--layers ...), not --params")
            try:
                args.params = memory_model.parse_count(args.params)
            except ValueError as error:
                distenv.fail(f"--params: {error}")
            return args
        if not given:
            distenv.fail("give --params P, or a model shape: --layers --hidden --heads --seq --vocab")
        missing = [f"--{f}" for f in SHAPE_FIELDS if f not in given]
        if missing:
            distenv.fail(f"a model shape needs {' '.join(missing)} as well")
        if args.layers < args.pp:
            distenv.fail(f"--layers {args.layers} cannot give each of --pp {args.pp} stages a layer")
        if args.stage_layers and (len(args.stage_layers) != args.pp
                                  or sum(args.stage_layers) != args.layers):
            distenv.fail(f"--stage-layers {','.join(map(str, args.stage_layers))} must give "
                         f"each of --pp {args.pp} stages its layers, {args.layers} in all")
        if args.heads % args.tp:
            distenv.fail(f"--heads {args.heads} do not split over --tp {args.tp}")
    problem = shape_of(args).check()
    if problem:
        distenv.fail(problem)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.command == "predict":
        predict(args)
    else:
        measure(args)


if __name__ == "__main__":
    main()

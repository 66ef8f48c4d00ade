"""FSDP / ZeRO-3 built from scratch, trained beside torch's DDP and FSDP2 on the same data.

The scratch ZeRO-3 keeps each unit (the embedding, every block, the head) as one flat fp32
buffer, padded to a multiple of N and split into N equal shards; rank r owns shard r and
the optimizer state for it. For each unit, on every rank:
  forward   all-gather the shards into the flat buffer, run the unit, free the buffer
  backward  all-gather again (the pre-backward hook on the unit's output), let autograd
            accumulate the unit's gradients into a flat buffer, reduce-scatter it so each
            rank keeps the summed gradient of its own shard, free both buffers
  step      SGD with momentum on the shard alone
The same model is trained with torch DDP (gradient_as_bucket_view, so the gradients live
in DDP's buckets and nothing is held twice) and with FSDP2 (fully_shard on every unit,
then the root).

Counted on one step (from the tensors each implementation issues and holds, with the
same chunk bounds as the prediction: a check of the schedule, not of the wire) and reported
beside the prediction; the trained weights are the independent result:
  max_param_diff        scratch and fully_shard against DDP after --steps, all ranks
  comm_bytes_per_rank   bytes each rank sends, summed over the collectives each
                        implementation issued in one step (ring algorithms' volumes,
                        comm_model); predicted: 2(N-1)/N x 4 psi for DDP, 3(N-1)/N x 4 psi'
                        for ZeRO-3, psi' being the padded parameter count
  memory_timeline       rank 0's live parameter and gradient bytes at the start and end
                        of every unit's forward and backward (the gather/free sawtooth)
                        and the peak, with the timeline the schedule predicts
  state_bytes_per_rank  parameters, gradients and momentum one rank holds after the step
  fsdp2_step            torch's FSDP2 once more, on rank 0 as rank 0 of a fake process
                        group of N (its collectives move nothing, on the calling thread):
                        in its second step, the collectives it issues in order, with their
                        sizes, and the bytes the allocator holds after every allocation and
                        free (torch.profiler's memory events: c10's CPU allocator, or the
                        CUDA caching allocator), beside its layout's prediction

Launch lines (from the repository root):
  one process:           python labs/fsdp.py
  laptop, gloo on CPU:   torchrun --standalone --nproc_per_node=3 labs/fsdp.py --out f3.json
  N = 3, then 2 and 1:   torchrun --standalone --nproc_per_node=3 labs/fsdp.py --sub-worlds 2,1
  GPU box, NCCL:         torchrun --standalone --nproc_per_node=8 labs/fsdp.py --out f8.json
  FSDP2's trace per rank: torchrun --standalone --nproc_per_node=2 labs/fsdp.py --profile prof/
                         python labs/trace.py analyze prof/fsdp2-n2-rank*.json
  and a checkpoint:      torchrun --standalone --nproc_per_node=4 labs/fsdp.py \\
                           --checkpoint-dir ckpt --out f4.json
                         python labs/checkpoint.py resume --dir ckpt --out resume.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=fsdp labs/fsdp.py --out f16.json

JSON: max_param_diff {scratch_vs_ddp, fully_shard_vs_ddp}; comm_bytes_per_rank and
predicted_comm_bytes_per_rank {ddp, zero3}; memory_timeline {ddp, zero3: {events [{phase,
unit, point, param_bytes, grad_bytes}], peak_bytes, predicted_events, predicted_peak_bytes}};
state_bytes_per_rank and predicted_state_bytes_per_rank {ddp, zero3: {params, grads,
optimizer, total}}; param_count, padded_param_count, unit_param_counts, unit_padded_counts;
profile (rank 0's trace of torch's FSDP2 with --profile, in the whole world, else null);
fsdp2_step {process_group, world_size, allocator, allocated_bytes {start, forward_end, end,
peak}, timeline [[ms, bytes]], collectives [{op, kind, numel [output, input], ms, event
(its place in timeline)}], predicted_collectives [{phase, kind, unit, numel}], state_bytes
(parameter shards and momentum, counted), activation_bytes (counted),
predicted_activation_bytes, largest_unit_gathered_bytes, predicted_peak_bytes} (bytes
above what the allocator held before the model was built; null on ranks but 0);
with --checkpoint-dir, checkpoint: what `checkpoint.py save` reports (its step,
checkpoint_bytes, full_export_bytes, param_count); `sub_worlds`, a result like this one
(without the checkpoint, with its `world_size`) for each --sub-worlds size, largest first.
"""

import copy
import math
import os
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from labkit.predict import comm_model, memory_model, trace_reader
from labkit.runtime import distenv, profiling
from labkit.runtime.profiling import allocator_walk
from labkit.runtime.activations import count_activation_bytes
from labkit.parallel.strategies import FSDP_FAMILY as SETUP
from labkit.parallel.strategies import TorchDDP, apply_fsdp, rank_batch, train_step, world_mesh
from labkit.model.transformer import Transformer, next_token_loss

BYTES = 4              # fp32 everywhere: parameters, gradients, momentum, communication


def live_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: views of one buffer count once,
    and a freed buffer (storage resized to 0) counts nothing."""
    storages = {}
    for tensor in tensors:
        if tensor is not None and tensor.untyped_storage().nbytes():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class FlatUnit:
    """One unit's parameters as views of one flat buffer that exists only while gathered."""

    def __init__(self, module, env):
        self.params = list(module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.padded = memory_model.padded_numel(self.numel, env.world_size)
        self.group = env.group
        shard_numel = self.padded // env.world_size
        self.full = torch.zeros(self.padded, device=env.device)
        torch.cat([p.detach().flatten() for p in self.params], out=self.full[:self.numel])
        start = env.rank * shard_numel
        self.shard = torch.nn.Parameter(self.full[start:start + shard_numel].clone())
        self.shard.grad = torch.zeros_like(self.shard)   # the reduce-scatter writes here
        for p, view in zip(self.params, self._views(self.full)):
            p.data = view    # the module now reads its weights from the flat buffer
        self.flat_grad = None
        self.grads_pending = 0
        self.free()

    def _views(self, flat):
        offset = 0
        for p in self.params:
            yield flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def gather(self, counter=None):
        self.full.untyped_storage().resize_(self.padded * BYTES)
        distenv.all_gather_single(self.full, self.shard.detach(), group=self.group)
        if counter is not None:
            counter.add("all_gather", self.full)

    def free(self):
        # The storage keeps its identity, so the views (and autograd's saved copies of
        # them) see the data again after the next gather.
        self.full.untyped_storage().resize_(0)

    def prepare_grads(self):
        """Point every gradient at a zeroed flat buffer: autograd accumulates into it."""
        self.flat_grad = torch.zeros(self.padded, device=self.full.device)
        for p, view in zip(self.params, self._views(self.flat_grad)):
            p.grad = view
        self.grads_pending = len(self.params)

    def reduce_grads(self, counter, world_size):
        """Sum the flat gradients over ranks, keep this rank's shard, average, free."""
        distenv.reduce_scatter_single(self.shard.grad, self.flat_grad, group=self.group)
        counter.add("reduce_scatter", self.flat_grad)
        self.shard.grad.div_(world_size)   # SUM then divide: ReduceOp.AVG is not on old gloo
        for p in self.params:
            p.grad = None
        self.flat_grad = None
        self.free()


class ScratchZero3:
    """ZeRO-3 over `model.units()`: gathers and frees through module and autograd hooks."""

    def __init__(self, model, env):
        self.model, self.env = model, env
        self.counter = comm_model.CollectiveCounter(env.world_size)
        self.units = [FlatUnit(unit, env) for unit in model.units()]
        for module, unit in zip(model.units(), self.units):
            module.register_forward_pre_hook(lambda *_, unit=unit: unit.gather(self.counter))
            module.register_forward_hook(self._after_forward(unit))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda _, unit=unit: self._grad_ready(unit))
        self.optimizer = SETUP.optimizer([unit.shard for unit in self.units])

    def _after_forward(self, unit):
        def hook(module, inputs, output):
            unit.free()
            if output.requires_grad:   # backward reaches this unit: gather it again first
                output.register_hook(lambda grad: self._before_backward(unit))
        return hook

    def _before_backward(self, unit):
        unit.gather(self.counter)
        unit.prepare_grads()

    def _grad_ready(self, unit):
        unit.grads_pending -= 1
        if unit.grads_pending == 0:    # the unit's backward is done on this rank
            unit.reduce_grads(self.counter, self.env.world_size)

    def train_step(self, ids, targets):
        next_token_loss(self.model(ids), targets).backward()
        self.optimizer.step()

    def tensors(self):
        """(parameters, gradients) this rank holds now: shards, and whatever is gathered."""
        params = [u.shard for u in self.units] + [p for u in self.units for p in u.params]
        grads = [u.shard.grad for u in self.units] + [p.grad for u in self.units
                                                       for p in u.params]
        return params, grads

    def full_parameters(self):
        """Every parameter gathered (a collective: all ranks call it), in model order."""
        result = []
        for unit in self.units:
            unit.gather()
            result += [p.detach().clone() for p in unit.params]
            unit.free()
        return result


def counting_ddp(model, env):
    """(torch DDP whose gradients are views of its buckets, the counter of the bytes it
    sends): a communication hook counts each bucket, then runs DDP's own all-reduce."""
    counter = comm_model.CollectiveCounter(env.world_size)

    def counting_allreduce(state, bucket):
        counter.add("all_reduce", bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)

    ddp = TorchDDP(model, env.device, SETUP.optimizer, comm_hook=counting_allreduce,
                   hook_state=env.group, process_group=env.group,
                   gradient_as_bucket_view=True, keep_grads=True)
    return ddp, counter


class TorchFSDP2:
    def __init__(self, model, env):
        self.model = apply_fsdp(model, env.device, mesh=world_mesh(env.device, env.group))
        self.optimizer = SETUP.optimizer(self.model.parameters())

    def train_step(self, ids, targets):
        train_step(self.model, self.optimizer, ids, targets)

    def full_parameters(self):
        return [p.full_tensor().detach() for p in self.model.parameters()]


class Timeline:
    """Live parameter and gradient bytes at the start and end of each unit's forward and
    backward. Its hooks go on after the implementation's own, so "start" sees the unit
    gathered and "end" sees it freed."""

    def __init__(self, units, tensors):
        self.tensors, self.events, self.active = tensors, [], False
        self.pending = {}   # unit -> gradients still to arrive in this backward
        for index, module in enumerate(units):
            params = list(module.parameters())
            module.register_forward_pre_hook(
                lambda *_, i=index: self._sample("forward", i, "start"))
            module.register_forward_hook(self._after_forward(index, len(params)))
            for p in params:
                p.register_post_accumulate_grad_hook(lambda _, i=index: self._grad_ready(i))

    def _after_forward(self, index, param_count):
        def hook(module, inputs, output):
            self._sample("forward", index, "end")
            if output.requires_grad:
                output.register_hook(lambda grad: self._before_backward(index, param_count))
        return hook

    def _before_backward(self, index, param_count):
        self.pending[index] = param_count
        self._sample("backward", index, "start")

    def _grad_ready(self, index):
        self.pending[index] -= 1
        if self.pending[index] == 0:
            self._sample("backward", index, "end")

    def _sample(self, phase, unit, point):
        if self.active:
            params, grads = self.tensors()
            self.events.append({"phase": phase, "unit": unit, "point": point,
                                "param_bytes": live_bytes(params),
                                "grad_bytes": live_bytes(grads)})


def record_fsdp2_step(initial, args, env):
    """torch's FSDP2 once more, on rank 0 alone, as rank 0 of a fake process group of this
    world's size, for two steps; the second is recorded by torch.profiler: the collectives
    FSDP2 issues (each c10d operator, with its tensors' shapes) in order, and the bytes
    the allocator holds after every allocation and free, above what it held before the
    model was built. Every rank of the world creates the group; its collectives move
    nothing and return at once, on the calling thread. That is why it is measured here and
    not on gloo: gloo frees some tensors on threads of its own, and the profiler hears of
    an allocation or a free only on the threads it profiles (this one, and autograd's,
    which inherit its state). On a GPU the events come from the CUDA caching allocator.
    Returns the record on rank 0, None elsewhere."""
    import torch.distributed as dist
    # importing it registers the "fake" backend
    from torch.testing._internal.distributed import fake_pg  # noqa: F401
    ranks = (dist.get_process_group_ranks(env.group) if env.group is not None
             else list(range(dist.get_world_size())))
    group = dist.new_group(ranks, backend="fake", use_local_synchronization=True)
    try:
        return _record_fsdp2_step(initial, args, env, group) if env.is_rank0 else None
    finally:
        dist.destroy_process_group(group)


def _record_fsdp2_step(initial, args, env, group):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")   # no line as the profiler starts, stops
    activities = [ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    mark = "fsdp.py: "

    def point(name):   # a mark in the profiler's events, between two allocations
        with record_function(mark + name):
            pass

    with profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        model = apply_fsdp(copy.deepcopy(initial), env.device,
                           mesh=world_mesh(env.device, group))
        optimizer = SETUP.optimizer(model.parameters())
        for step in range(2):   # the first allocates the momentum; the second is recorded
            ids, targets = rank_batch(SETUP.shape, SETUP.batch, args.seed, step, env.rank,
                                      env.device)
            if step:
                states = distenv.local_bytes([*model.parameters(),
                                              *(t for state in optimizer.state.values()
                                                for t in state.values() if torch.is_tensor(t))])
                point("start")
            loss = next_token_loss(model(ids), targets)
            if step:
                point("forward_end")
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:
                point("end")
    device_type = DeviceType.CUDA if env.device.type == "cuda" else DeviceType.CPU
    # the allocations and frees on this device, the marks, and the c10d operators FSDP2
    # called, in the order of the profiler's clock
    points, timeline, collectives, start_ns = {}, [], [], None
    for ns, event, held in allocator_walk(prof, mark, device_type,
                                          also=lambda name: name.startswith("c10d::")):
        name = event.name()
        if name == "[memory]":
            if start_ns is not None:
                timeline.append([round((ns - start_ns) / 1e6, 3), held])
        elif name.startswith(mark):
            points[name[len(mark):]] = held
            if name == mark + "start":
                start_ns = ns
                timeline.append([0.0, held])
            elif name == mark + "end":
                break
        elif start_ns is not None and trace_reader.collective_kind(name) != "other":
            collectives.append({"op": name, "kind": trace_reader.collective_kind(name),
                                "numel": [math.prod(shape) for shape in event.shapes()[:2]],
                                "ms": round((ns - start_ns) / 1e6, 3),
                                "event": len(timeline) - 1})   # the allocation before it
    unit_shapes = [[tuple(p.shape) for p in unit.parameters()] for unit in initial.units()]
    ids, targets = rank_batch(SETUP.shape, SETUP.batch, args.seed, 1, env.rank, env.device)
    activations = sum(count_activation_bytes(
        initial, lambda: next_token_loss(initial(ids), targets)).values())
    shape = SETUP.shape
    predicted_activations = memory_model.activation_bytes(
        shape.layers, shape.seq, SETUP.batch, shape.hidden, shape.heads, shape.vocab,
        BYTES, dropout=False)[1]
    n = env.world_size
    return {
        "process_group": "fake", "world_size": n,
        "allocator": ("the CUDA caching allocator" if env.device.type == "cuda"
                      else "c10's CPU allocator") + ", through torch.profiler's memory events",
        "allocated_bytes": {**points, "peak": max(b for _, b in timeline)},
        "timeline": timeline,
        "collectives": collectives,
        "predicted_collectives": [
            {"phase": phase, "kind": kind, "unit": unit, "numel": [out, inp]}
            for phase, kind, unit, out, inp in memory_model.fsdp2_step_collectives(
                unit_shapes, n)],
        "state_bytes": states,   # parameter shards and momentum, counted at the start
        "activation_bytes": activations,   # counted: what autograd saved, in the bare model
        "predicted_activation_bytes": predicted_activations,
        "largest_unit_gathered_bytes": BYTES * max(
            memory_model.fsdp2_gathered_numel(shapes, n) for shapes in unit_shapes),
        "predicted_peak_bytes": memory_model.fsdp2_step_peak_bytes(
            unit_shapes, n, predicted_activations, optimizer_buffers=1, value_bytes=BYTES),
    }


def state_bytes(implementation):
    params, grads = implementation.tensors()
    optimizer = [t for state in implementation.optimizer.state.values()
                 for t in state.values() if torch.is_tensor(t)]
    result = {"params": live_bytes(params), "grads": live_bytes(grads),
              "optimizer": live_bytes(optimizer)}
    return {**result, "total": sum(result.values())}


def run(args, env):
    initial = Transformer(SETUP.shape, device=env.device)
    ddp, ddp_counter = counting_ddp(copy.deepcopy(initial), env)
    zero3 = ScratchZero3(copy.deepcopy(initial), env)
    fsdp2 = TorchFSDP2(copy.deepcopy(initial), env)
    counters = {"ddp": ddp_counter, "zero3": zero3.counter}
    timelines = {"ddp": Timeline(ddp.model.module.units(), ddp.tensors),
                 "zero3": Timeline(zero3.model.units(), zero3.tensors)}
    for step in range(args.steps):
        last = step == args.steps - 1
        for name in ("ddp", "zero3"):
            counters[name].reset()   # count the last step only
            timelines[name].active = last
        ids, targets = rank_batch(SETUP.shape, SETUP.batch, args.seed, step, env.rank,
                                  env.device)
        for implementation in (ddp, zero3, fsdp2):
            implementation.train_step(ids, targets)
        env.progress(f"step {step + 1}/{args.steps}")
    env.progress("")

    reference = ddp.parameters()
    unit_numels = [unit.numel for unit in zero3.units]
    unit_padded = [unit.padded for unit in zero3.units]
    psi, padded, n = sum(unit_numels), sum(unit_padded), env.world_size
    timeline = {}
    for name in ("ddp", "zero3"):
        events = timelines[name].events
        predicted = memory_model.step_timeline(name, unit_numels, n, BYTES)
        timeline[name] = {
            "events": events,
            "peak_bytes": memory_model.timeline_peak(events) if events else None,
            "predicted_events": predicted,
            "predicted_peak_bytes": memory_model.timeline_peak(predicted)}
    result = {
        "max_param_diff": {
            "scratch_vs_ddp": distenv.max_param_diff(zero3.full_parameters(), reference,
                                                     env.device, env.group),
            "fully_shard_vs_ddp": distenv.max_param_diff(fsdp2.full_parameters(), reference,
                                                         env.device, env.group)},
        "comm_bytes_per_rank": {name: round(counter.sent) for name, counter in counters.items()},
        "predicted_comm_bytes_per_rank": {
            "ddp": round(comm_model.data_parallel_bytes_per_rank("ddp", psi, n, BYTES)),
            "zero3": round(comm_model.data_parallel_bytes_per_rank("zero3", padded, n, BYTES))},
        "memory_timeline": timeline,   # rank 0's is the one written
        "state_bytes_per_rank": {"ddp": state_bytes(ddp), "zero3": state_bytes(zero3)},
        "predicted_state_bytes_per_rank": {
            "ddp": memory_model.state_bytes_per_gpu(psi, n, "ddp", "momentum", "fp32"),
            "zero3": memory_model.state_bytes_per_gpu(padded, n, "zero3", "momentum", "fp32")},
        "param_count": psi,
        "padded_param_count": padded,
        "unit_param_counts": unit_numels,
        "unit_padded_counts": unit_padded,
        "profile": None,
        "fsdp2_step": None,
    }
    result["fsdp2_step"] = record_fsdp2_step(initial, args, env)
    # torch's FSDP2: extra steps on the last batch, after the comparison; the launch's
    # whole world only, not its --sub-worlds
    if args.profile and n == torch.distributed.get_world_size():
        result["profile"] = str(profiling.profile_steps(
            args.profile, f"fsdp2-n{n}", env.device, lambda: fsdp2.train_step(ids, targets)))
    return result


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    profiling.add_profile_arg(parser)
    parser.add_argument("--steps", type=distenv.positive_int, default=SETUP.steps,
                        help="training steps of each implementation (the last one is measured)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                        help="then run labs/checkpoint.py's save phase into DIR, in the same "
                             "processes (a launch fewer before `checkpoint.py resume`)")
    distenv.add_sub_worlds_arg(parser)
    return parser.parse_args(argv)


def run_and_report(args, env):
    metrics = run(args, env)
    report(env, metrics, args.steps)
    return metrics


def report(env, metrics, steps):
    diff, sent = metrics["max_param_diff"], metrics["comm_bytes_per_rank"]
    predicted = metrics["predicted_comm_bytes_per_rank"]
    env.print0(f"world size {env.world_size} ({env.backend}), {metrics['param_count']:,} "
               f"parameters ({metrics['padded_param_count']:,} padded), {steps} steps")
    env.print0(f"max |p - DDP|: scratch ZeRO-3 {diff['scratch_vs_ddp']:.2e}, "
               f"fully_shard {diff['fully_shard_vs_ddp']:.2e}")
    for name in ("ddp", "zero3"):
        timeline, state = metrics["memory_timeline"][name], metrics["state_bytes_per_rank"]
        env.print0(f"{name:>5}: sent {sent[name]:,} B/step (predicted {predicted[name]:,})")
        env.print0(f"       peak params+grads {timeline['peak_bytes']:,} B (predicted "
                   f"{timeline['predicted_peak_bytes']:,}), state {state[name]['total']:,} B")


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        if args.checkpoint_dir:
            # DCP, imported with it, only when asked for; the size checked before the comparison
            from labkit.parallel import sharded_checkpoint
            sharded_checkpoint.check_world_size(env.world_size)
        metrics = distenv.measure_with_sub_worlds(env, args.sub_worlds,
                                                  lambda world: run_and_report(args, world))
        if args.checkpoint_dir:
            metrics["checkpoint"] = sharded_checkpoint.save(
                args.checkpoint_dir, sharded_checkpoint.STEPS, args.seed, env)
            env.print0(f"checkpoint.py save: step {metrics['checkpoint']['step']} in "
                       f"{args.checkpoint_dir} ({metrics['checkpoint']['checkpoint_bytes']:,} B)")
        env.write_result(args, metrics)


if __name__ == "__main__":
    main()

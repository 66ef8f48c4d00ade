"""How a model is wrapped and trained: each way written once, composed by the labs (the
pattern of torchtitan's parallelize_* functions).

  apply_ddp       DistributedDataParallel, on the rank's own GPU when there is one
  world_mesh      the 1-D device mesh of the whole world (or of one group), on the lab's
                  device type
  apply_fsdp      FSDP2: fully_shard on every unit (embedding, each block, head), then the root
  apply_fsdp_unit FSDP2 on one module as one unit, over a given mesh (a pipeline stage)
  apply_tp        torch's tensor parallelism (DTensor) on every block, with or without
                  sequence parallelism; qkv_rows_of_rank says which rows hold a rank's heads
  apply_pp        torch's pipeline schedules (torch.distributed.pipelining) over the pieces
                  a rank holds: GPipe, 1F1B, interleaved 1F1B
  allreduce_gradients   the gradients of some parameters summed (or averaged) over a
                  process group, in one flat buffer: data parallelism by hand, after all
                  of a step's micro-batches (as Megatron-LM's DDP does under a pipeline)
  train_step      forward, next-token loss, backward, optimizer step, gradients zeroed
  TorchDDP        torch's DDP with its optimizer, stepped as one: the reference that the
                  labs' own data-parallel implementations are checked and timed against
  TrainingSetup   a model shape, batch and optimizer that several labs train alike;
                  FSDP_FAMILY is the one the FSDP chapter's labs share, SCALING_SHAPE
                  the model of the scaling chapter's
  rank_batch      the batch rank r trains on at step t: the same in every run
"""

import dataclasses

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime import distenv
from ..model.transformer import Shape, next_token_loss, random_batch


def apply_ddp(model, device, comm_hook=None, hook_state=None, **options):
    """Wrap `model` (already on `device`) in DDP. On a GPU DDP must be told which one the
    rank owns (device_ids); on CPU it must not be. `comm_hook(hook_state, bucket)`, if
    given, replaces DDP's all-reduce of each bucket (to count it, slow it down, or skip
    it). `options` go to DDP as they are (bucket_cap_mb, gradient_as_bucket_view, ...)."""
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids, **options)
    if comm_hook is not None:
        wrapped.register_comm_hook(hook_state, comm_hook)
    return wrapped


def world_mesh(device, group=None):
    """A 1-D DeviceMesh of the whole world (or of `group`'s ranks) on `device`'s type.
    FSDP2 and DTensor need one named explicitly: without it they build theirs on CUDA
    whenever CUDA is available, which on a GPU box that fell back to gloo puts every shard
    on cuda:0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    if group is not None:
        return DeviceMesh.from_group(group, device.type)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def apply_fsdp(model, device, reshard_after_forward=True, mesh=None, **options):
    """FSDP2 on each of `model.units()`, then on the root, which then holds no parameters
    of its own, over `mesh` (default: world_mesh(device)). reshard_after_forward=True frees
    a unit's gathered parameters after its forward (ZeRO-3); False keeps them until its
    backward (ZeRO-2's memory). Returns the model, whose parameters are now DTensor
    shards: build the optimizer after this."""
    from torch.distributed.fsdp import fully_shard   # here: importing it costs ~1 s a process
    mesh = mesh if mesh is not None else world_mesh(device)
    for unit in model.units():
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    return model


def apply_fsdp_unit(module, mesh, reshard_after_forward=True):
    """FSDP2 on `module` as one unit, over `mesh` (a 1-D DeviceMesh: the data-parallel
    dimension of a larger mesh, or world_mesh(device)): one all-gather of all its
    parameters before its forward and its backward, one reduce-scatter after. A pipeline
    stage, whose layers run together, is such a unit. Build the optimizer after this."""
    from torch.distributed.fsdp import fully_shard
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return module


def qkv_rows_of_rank(hidden, heads, rank, tp, device=None):
    """Rows of the fused [Q; K; V] weight (3h x h) that hold rank `rank`'s heads: the same
    heads' rows of Q, of K and of V. Cutting the fused weight into t blocks of contiguous
    rows instead puts the wrong matrices where a rank expects its K and V (at t = 2, rank
    0 gets all of Q and half of K; from t = 3 on, rows of Q alone)."""
    if heads % tp:
        raise ValueError(f"{heads} heads do not split over {tp} ranks")
    width = hidden // tp   # heads / tp heads, hidden / heads rows each
    return torch.cat([part * hidden + torch.arange(rank * width, (rank + 1) * width,
                                                    device=device) for part in range(3)])


def group_qkv_by_rank(model, tp):
    """Reorder every block's fused QKV rows to [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...], so that
    torch's split into t contiguous blocks gives each rank whole heads. Returns the order
    (new row i is old row order[i]), to put a trained weight back."""
    h, heads = model.shape.hidden, model.shape.heads
    device = model.blocks[0].qkv.weight.device
    order = torch.cat([qkv_rows_of_rank(h, heads, r, tp, device) for r in range(tp)])
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.weight.copy_(block.qkv.weight[order])
            block.qkv.bias.copy_(block.qkv.bias[order])
    return order


def apply_tp(model, mesh, sequence_parallel=False):
    """torch's tensor parallelism on each block (torchtitan's plan for a transformer block,
    on this model): QKV and fc1 column-parallel, proj and fc2 row-parallel, on a 1-D device
    mesh; group_qkv_by_rank must have run first. With sequence_parallel the LayerNorms and
    the residual stream hold 1/t of the tokens: the first block's input is split, the
    head's input gathered. Embedding and head stay replicated. Returns the model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    for block in model.blocks:
        if sequence_parallel:
            plan = {"norm1": SequenceParallel(use_local_output=True),
                    "qkv": ColwiseParallel(input_layouts=Shard(1)),
                    "proj": RowwiseParallel(output_layouts=Shard(1)),
                    "norm2": SequenceParallel(use_local_output=True),
                    "fc1": ColwiseParallel(input_layouts=Shard(1)),
                    "fc2": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                    "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                           use_local_output=True),
            "head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                       use_local_output=True)})
    return model


TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   # Qi et al.'s zero bubble (torch 2.6+) and DeepSeek's DualPipeV (2.8+)
                   "zb1p": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}
# the schedules that take one rank's pieces as a list (several per rank), the others one stage
MULTI_STAGE_SCHEDULES = ("interleaved", "zb1p", "zbv", "dualpipev")


def apply_pp(pieces, piece_indices, num_pieces, schedule, microbatches, loss_fn, device,
             input_example, output_example, group=None, stage_class=None):
    """torch's `schedule` over the pipeline pieces this rank holds (pieces[k] is model piece
    piece_indices[k] of num_pieces; one piece for GPipe and 1F1B, several for the
    interleaved schedule). Each micro-batch's loss is loss_fn(output, target) / m, so the
    gradients are the whole batch's: torch >= 2.7 would divide them by m itself
    (scale_grads), torch 2.6 does not, so that is turned off where it exists.
    `input_example(k)` and `output_example(k)` give tensors shaped like piece k's input and
    output for one micro-batch: with them torch skips its shape-inference pass.
    `stage_class` replaces PipelineStage (a subclass that times each op, say).
    A schedule this torch lacks raises distenv.VariantNotRun, saying so.
    Call the result's step(ids) on the first stage, step(target=...) on the last."""
    import inspect

    from torch.distributed.pipelining import PipelineStage, schedules

    from ..runtime.distenv import VariantNotRun
    schedule_class = getattr(schedules, TORCH_SCHEDULES[schedule], None)
    if schedule_class is None:
        raise VariantNotRun(f"torch {torch.__version__} has no {TORCH_SCHEDULES[schedule]}")
    stage_class = stage_class or PipelineStage
    stages = [stage_class(piece, index, num_pieces, device, input_args=input_example(index),
                          output_args=output_example(index), group=group)
              for piece, index in zip(pieces, piece_indices)]
    options = {}
    if "scale_grads" in inspect.signature(schedule_class.__init__).parameters:
        options["scale_grads"] = False
    scaled_loss = lambda output, target: loss_fn(output, target) / microbatches  # noqa: E731
    return schedule_class(stages if schedule in MULTI_STAGE_SCHEDULES else stages[0],
                          microbatches, loss_fn=scaled_loss, **options)


def allreduce_gradients(params, group=None, average=False):
    """Sum the gradients of `params` over the ranks of `group` (average=True: their mean),
    as one all-reduce of one flat buffer. Parameters without a gradient are skipped."""
    import torch.distributed as dist
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def train_step(model, optimizer, ids, targets, after_backward=None, set_to_none=True):
    """One step: forward, next-token loss, backward, `after_backward()` (a hand-written
    gradient exchange, if any), optimizer step, gradients zeroed. Returns the loss.

    set_to_none=False keeps the gradient tensors (zeroed) for the next step: DDP's
    gradients are then views of its buckets, which exist either way."""
    loss = next_token_loss(model(ids), targets)
    loss.backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return loss.detach()


class TorchDDP:
    """torch's DDP and its optimizer, trained one step at a time.

    keep_grads=True zeroes the gradients instead of freeing them after each step: with
    gradient_as_bucket_view=True they are views of DDP's buckets, which exist either way,
    so a memory count sees what DDP really holds."""

    def __init__(self, model, device, make_optimizer, comm_hook=None, hook_state=None,
                 keep_grads=False, **options):
        self.model = apply_ddp(model, device, comm_hook, hook_state, **options)
        self.optimizer = make_optimizer(self.model.parameters())
        self.keep_grads = keep_grads

    def train_step(self, ids, targets):
        return train_step(self.model, self.optimizer, ids, targets,
                          set_to_none=not self.keep_grads)

    def parameters(self):
        """The trained parameters, as the unwrapped module holds them."""
        return list(self.model.module.parameters())

    def tensors(self):
        """(parameters, gradients) this rank holds now: all of both, DDP shards nothing."""
        params = self.parameters()
        return params, [p.grad for p in params]


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """A model shape, a batch per rank and SGD with momentum: what labs that must train
    identically share, so that their results can be compared."""
    shape: Shape
    batch: int            # sequences per rank per step
    learning_rate: float
    momentum: float
    steps: int            # training steps by default

    def optimizer(self, params):
        """SGD with momentum: one fp32 state per parameter, sharded like the parameters."""
        return torch.optim.SGD(params, lr=self.learning_rate, momentum=self.momentum)


# The FSDP chapter's labs (fsdp, zero_libraries, checkpoint). Hidden size 50 and
# vocab + seq = 113 make every unit's size indivisible by 3 or 4 somewhere, so sharding's
# padding is exercised at the world sizes the tests run.
FSDP_FAMILY = TrainingSetup(shape=Shape(layers=3, hidden=50, heads=5, seq=16, vocab=97),
                            batch=4, learning_rate=0.1, momentum=0.9, steps=4)


# The scaling chapter's labs (mini_ddp, scaling): 536,064 parameters, 2.14 MB of fp32
# gradients, two DDP buckets at a 1 MiB cap.
SCALING_SHAPE = Shape(layers=2, hidden=128, heads=4, seq=64, vocab=512)


def rank_batch(shape, batch, seed, step, rank, device):
    """The batch rank `rank` trains on at `step`: the same in every run and every
    implementation, whatever N is, so runs can be compared step by step."""
    return random_batch(shape, batch, distenv.generator(seed, "batch", step, rank), device)

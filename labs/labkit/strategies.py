"""How a model is wrapped and trained: each way written once, composed by the labs (the
pattern of torchtitan's parallelize_* functions).

  apply_ddp       DistributedDataParallel, on the rank's own GPU when there is one
  apply_fsdp      FSDP2: fully_shard on every unit (embedding, each block, head), then the root
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
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from . import distenv
from .transformer import Shape, next_token_loss, random_batch


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


def apply_fsdp(model, reshard_after_forward=True, **options):
    """FSDP2 on each of `model.units()`, then on the root, which then holds no parameters
    of its own. reshard_after_forward=True frees a unit's gathered parameters after its
    forward (ZeRO-3); False keeps them until its backward (ZeRO-2's memory). Returns the
    model, whose parameters are now DTensor shards: build the optimizer after this."""
    for unit in model.units():
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    return model


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


# The scaling chapter's labs (mini_ddp, scaling): about 0.93 M parameters, 3.7 MB of fp32
# gradients, enough for several DDP buckets.
SCALING_SHAPE = Shape(layers=2, hidden=128, heads=4, seq=64, vocab=512)


def rank_batch(shape, batch, seed, step, rank, device):
    """The batch rank `rank` trains on at `step`: the same in every run and every
    implementation, whatever N is, so runs can be compared step by step."""
    return random_batch(shape, batch, distenv.generator(seed, "batch", step, rank), device)

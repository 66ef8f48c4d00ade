"""Pipeline parallelism from scratch: a model cut into contiguous pieces, each piece timed,
and the GPipe and 1F1B schedules run with point-to-point sends.

  split_pieces     the course's transformer cut into n contiguous pieces (embedding with
                   the first, head with the last), copies of the model's own modules
  OpClock          records when each forward and backward of a micro-batch starts and
                   ends, and with `compute_s` makes it last exactly that long forward and
                   twice that backward (by sleeping after the real work)
  timed_torch_stage   torch's PipelineStage, timed by the same clock
  schedule_order   the (op, micro-batch) order a stage runs: GPipe or 1F1B
  run_schedule     one training step of one stage, in that order, sending activations
                   forward and gradients back with isend/recv

Both are timed over the same span: the work of one op (the loss included, on the last
stage), not the wait for its input nor the sending of its output.
"""

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .memory_model import stage_layers


def split_pieces(model, pieces):
    """The model's units cut into `pieces` contiguous nn.Sequential pieces, the blocks as
    evenly as they go (memory_model.stage_layers: the later pieces get one more when they
    do not divide); the embedding goes with the first piece and the head with the last.
    The pieces share the model's modules: deep-copy the model first to keep it."""
    result, start = [], 0
    for piece, count in enumerate(stage_layers(len(model.blocks), pieces)):
        units = list(model.blocks[start:start + count])
        start += count
        if piece == 0:
            units.insert(0, model.embed)
        if piece == pieces - 1:
            units.append(model.head)
        result.append(nn.Sequential(*units))
    return result


class OpClock:
    """Records each forward and backward a rank runs, as events (op, micro-batch, piece,
    start, end), op "F" or "B". `compute_s`, if given, pads each forward to last exactly
    that long and each backward twice as long (the real work, then a sleep): a
    controlled-time experiment, in which the schedule alone sets the timeline.
    `over_budget` counts the ops whose real work took longer than that.

    An op's work runs outside any dispatch mode (the lab's collective counter): a pipeline
    op holds no communication, and a mode's Python call on every tensor op would slow the
    very work being timed. hide_modes=False keeps them, for ops that do communicate (a
    tensor-parallel stage's all-reduces)."""

    def __init__(self, compute_s=None, hide_modes=True):
        self.compute_s, self.hide_modes = compute_s, hide_modes
        self.reset()

    def reset(self):
        self.events, self.over_budget = [], 0

    @contextlib.contextmanager
    def op(self, kind, microbatch, piece=0):
        start = time.perf_counter()
        with _disable_current_modes() if self.hide_modes else contextlib.nullcontext():
            yield
        if self.compute_s is not None:
            left = start + self.compute_s * (1 if kind == "F" else 2) - time.perf_counter()
            if left > 0:
                time.sleep(left)
            else:
                self.over_budget += 1
        self.events.append((kind, microbatch, piece, start, time.perf_counter()))


def timed_torch_stage(clock):
    """torch's PipelineStage, with every forward and backward of a micro-batch timed (and
    padded) by `clock`: the same span as run_schedule times, the work of one op without
    the wait for its input or the sending of its output."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        def forward_one_chunk(self, chunk_id, *args, **kwargs):
            with clock.op("F", chunk_id, self.stage_index):
                return super().forward_one_chunk(chunk_id, *args, **kwargs)

        def backward_one_chunk(self, chunk_id, *args, **kwargs):
            with clock.op("B", chunk_id, self.stage_index):
                return super().backward_one_chunk(chunk_id, *args, **kwargs)

    return TimedStage


def schedule_order(schedule, stages, stage, microbatches):
    """[(op, micro-batch)] stage `stage` of `stages` runs in one step.

      gpipe  all m forwards, then all m backwards (Huang et al., 2019)
      1f1b   p-1-s forwards to fill the pipeline, then one forward and one backward in
             turn, then the backwards left (Narayanan et al., 2021): a micro-batch's
             activations are freed p-s slots after they were made, not m
    """
    m = microbatches
    forwards, backwards = [("F", i) for i in range(m)], [("B", i) for i in range(m)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule == "1f1b":
        warmup = min(stages - 1 - stage, m)
        steady = [op for i in range(m - warmup) for op in (forwards[warmup + i], backwards[i])]
        return forwards[:warmup] + steady + backwards[m - warmup:]
    raise ValueError(f"unknown schedule {schedule!r}")


def _recv(shape, source, device, what, stage, timeout_s, group=None):
    buffer = torch.empty(shape, device=device)
    try:
        dist.recv(buffer, src=source, group=group)
    except RuntimeError as error:   # gloo and NCCL raise on the group's timeout
        raise TimeoutError(f"stage {stage} waited {timeout_s:g} s for {what} from rank "
                           f"{source} and gave up: the schedule is deadlocked") from error
    return buffer


def run_schedule(piece, order, stage, stages, inputs, targets, loss_fn, *, clock,
                 prev_rank=None, next_rank=None, activation_shape, device, scale_loss=True,
                 recv_before_send=False, timeout_s=0.0, group=None):
    """One step of stage `stage`, each op timed by `clock`: the forwards and backwards of `order` on micro-batches
    `inputs` (used by the first stage) and `targets` (by the last), activations sent to
    `next_rank` and gradients to `prev_rank` (global ranks). The loss of each micro-batch
    is divided by m, so that the gradients are those of the whole batch's mean loss
    (scale_loss=False is a pitfall: m times too large). recv_before_send is another: each
    stage waits for a micro-batch's gradient before sending the activation it needs, and
    the pipeline deadlocks until the group's timeout. `group` is the process group the
    sends go over (None: the world; ranks stay global either way). Returns the last
    stage's losses."""
    first, last = stage == 0, stage == stages - 1
    m = len(inputs)
    kept, sends, losses = {}, [], []
    for op, i in order:
        if op == "F":
            x = inputs[i] if first else _recv(activation_shape, prev_rank, device,
                                              f"micro-batch {i}'s activations", stage,
                                              timeout_s, group).requires_grad_()
            with clock.op("F", i, stage):
                y = piece(x)
                if last:
                    loss = loss_fn(y, targets[i])
                    losses.append(loss.detach())
                    y = loss / m if scale_loss else loss
            if not last:
                if recv_before_send:
                    _recv(activation_shape, next_rank, device, f"micro-batch {i}'s gradient",
                          stage, timeout_s, group)
                out = y.detach()
                sends.append((dist.isend(out, dst=next_rank, group=group), out))
            kept[i] = (x, y)
        else:
            x, y = kept.pop(i)
            grad = None if last else _recv(y.shape, next_rank, device,
                                           f"micro-batch {i}'s gradient", stage, timeout_s,
                                           group)
            with clock.op("B", i, stage):
                torch.autograd.backward(y, grad)
            if not first:
                sends.append((dist.isend(x.grad, dst=prev_rank, group=group), x.grad))
    for handle, _ in sends:
        handle.wait()
    return losses

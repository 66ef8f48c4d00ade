"""Pipeline parallelism from scratch: a model cut into contiguous pieces, each piece timed,
and the GPipe and 1F1B schedules run with point-to-point sends.

  split_pieces     the course's transformer cut into n contiguous pieces (embedding with
                   the first, head with the last), copies of the model's own modules
  OpClock          records when each forward and backward of a micro-batch starts and
                   ends, and with `compute_s` makes it last exactly that long forward and
                   twice that backward (by sleeping after the real work)
  timed_torch_stage   torch's PipelineStage, timed by the same clock
  schedule_order   the (op, micro-batch) order a stage runs: GPipe or 1F1B (from
                   labkit.predict.time_model, where the step-time model reads it too)
  run_schedule     one training step of one stage, in that order, sending activations
                   forward and gradients back with isend/recv

Both are timed over the same span: the work of one op (the loss included, on the last
stage), not the wait for its input nor the sending of its output. Every wait for a
message, in run_schedule, in torch's schedules and in the handoff probe, is made by
labkit.runtime.timing.wait_for_work, which returns when the message is in on gloo and
NCCL alike.
"""

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ..predict.memory_model import stage_layers
from ..predict.time_model import schedule_order   # written once, where the model reads it too
from ..runtime.timing import NCCL_GIVE_UP_FRACTION, wait_for_work


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
    start, end, wait), op "F" or "B" (or a split backward's "I" and "W"); `wait` (start,
    end) is when the rank waited for the op's input, where the caller says so (run_schedule
    does; torch's stages do not). `compute_s`, if given, pads each op to last exactly
    OP_LENGTHS[op] times that long (the real work, then a sleep): a controlled-time
    experiment, in which the schedule alone sets the timeline.
    `over_budget` counts the ops whose real work took longer than that.

    An op's work runs outside any dispatch mode (the lab's collective counter): a pipeline
    op holds no communication, and a mode's Python call on every tensor op would slow the
    very work being timed. hide_modes=False keeps them, for ops that do communicate (a
    tensor-parallel stage's all-reduces)."""

    # an op's length under controlled time, in forwards: a backward twice a forward's
    # (two products per weight); its halves, the input's gradient I and the weights' W, one
    # each, the equal F, I and W of Qi et al.'s counts
    OP_LENGTHS = {"F": 1, "B": 2, "I": 1, "W": 1}

    def __init__(self, compute_s=None, hide_modes=True, device=None):
        self.compute_s, self.hide_modes = compute_s, hide_modes
        # On a GPU the work is queued, not done, when the Python call returns: the clock
        # is read after the device has finished what came before (the input's arrival
        # included) and what the op queued.
        # Only this stream's work: a device-wide synchronize would also wait for a pending
        # NCCL send, which ends when the neighbour receives it.
        self.device = torch.device("cpu" if device is None else device)
        cuda = self.device.type == "cuda"
        self.synchronize = ((lambda: torch.cuda.current_stream(device).synchronize()) if cuda
                            else (lambda: None))
        self.reset()

    def reset(self):
        self.events, self.over_budget = [], 0
        self.last_wait = None   # (start, end) of the latest wait for input, if told

    def waited(self, start, end):
        """Note a wait for input that the next op's caller cannot pass (torch's stages)."""
        self.last_wait = (start, end)

    @contextlib.contextmanager
    def op(self, kind, microbatch, piece=0, wait=None):
        wait, self.last_wait = wait or self.last_wait, None
        self.synchronize()
        start = time.perf_counter()
        with _disable_current_modes() if self.hide_modes else contextlib.nullcontext():
            yield
        self.synchronize()
        if self.compute_s is not None:
            left = start + self.compute_s * self.OP_LENGTHS[kind] - time.perf_counter()
            if left > 0:
                time.sleep(left)
            else:
                self.over_budget += 1
        self.events.append((kind, microbatch, piece, start, time.perf_counter(), wait))


def timed_torch_stage(clock, timeout_s=0.0):
    """torch's PipelineStage, with every forward and backward of a micro-batch timed (and
    padded) by `clock`: the same span as run_schedule times, the work of one op without
    the wait for its input or the sending of its output. The schedules' waits for their
    messages are timed too (the clock's last wait before an op; patched into torch's
    schedules module, in the lab's own process), made as run_schedule makes its own
    (wait_for_work, each within `timeout_s`; 0: no limit)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    # torch's schedules wait for their sends and receives in one function, a work.wait()
    # each: on NCCL that only makes the stream wait, and the time spent waiting would fall
    # into the next op's synchronize, where the prediction counts it as the op's own.
    # Waiting as run_schedule does tells the clock when a stage waited for its next op's
    # input, on every backend.
    def timed_wait(works):
        start = time.perf_counter()
        for work in works:
            wait_for_work(work, clock.device, timeout_s)
        clock.waited(start, time.perf_counter())

    if not hasattr(schedules, "_wait_batch_p2p"):
        # torch 2.6 and 2.7 wait inside _batch_p2p itself (and on gloo on one work of
        # several, pytorch#132644): there is no one place to time the waits
        from ..runtime.distenv import VariantNotRun
        raise VariantNotRun(f"torch {torch.__version__} has no schedules._wait_batch_p2p "
                            f"(torch 2.8 and newer): its waits cannot be timed")
    schedules._wait_batch_p2p = timed_wait

    class TimedStage(PipelineStage):
        def forward_one_chunk(self, chunk_id, *args, **kwargs):
            with clock.op("F", chunk_id, self.stage_index):
                return super().forward_one_chunk(chunk_id, *args, **kwargs)

        def backward_one_chunk(self, chunk_id, *args, **kwargs):
            with clock.op("B", chunk_id, self.stage_index):
                return super().backward_one_chunk(chunk_id, *args, **kwargs)

    return TimedStage


def _wait_for(handle, what, source, stage, timeout_s, device):
    """Wait for a receive (wait_for_work); a peer that never sends fails it after
    timeout_s with one line."""
    try:
        wait_for_work(handle, device, timeout_s)
    except RuntimeError as error:   # gloo and NCCL raise when the wait times out
        # on CUDA the wait gives up before NCCL's watchdog would (wait_for_work)
        waited = timeout_s * (NCCL_GIVE_UP_FRACTION if torch.device(device).type == "cuda" else 1)
        # a wait that times out cannot tell a peer that waits on this stage from one that
        # is only slow: the lines of all stages together can (waits that form a cycle)
        raise TimeoutError(f"stage {stage} waited {waited:g} s for {what} from rank "
                           f"{source} and gave up (--p2p-timeout): nothing came; if the "
                           f"stages' waits form a cycle, the schedule is deadlocked") from error


def _exchange(sends, recv=None, group=None):
    """Post `sends` [(tensor, rank)] and the receive `recv` (buffer, rank) as one
    batch_isend_irecv: a stage's send to a neighbour and its receive from the same one go
    out together, as Megatron-LM's send_forward_recv_backward does. On NCCL a send waits
    for its peer's matching receive, and separate calls over one pair's stream can wait on
    each other. NCCL coalesces the batch into one work (batch_isend_irecv returns it
    alone): the receive's handle is then the batch's, done once the sends have been
    received too, so there a stage's wait for its input also holds its neighbour's posting
    of the matching receive, as in Megatron-LM. Returns (the send handles, the receive's
    handle or None)."""
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv[0], recv[1], group))
    handles = dist.batch_isend_irecv(ops) if ops else []
    if recv is None:
        return handles, None
    return handles[:-1], handles[-1]


def run_schedule(piece, order, stage, stages, inputs, targets, loss_fn, *, clock,
                 prev_rank=None, next_rank=None, activation_shape, device, scale_loss=True,
                 recv_before_send=False, timeout_s=0.0, group=None):
    """One step of stage `stage`, each op timed by `clock`: the forwards and backwards of
    `order` on micro-batches `inputs` (used by the first stage) and `targets` (by the
    last), activations sent to `next_rank` and gradients to `prev_rank` (global ranks). The
    loss of each micro-batch is divided by m, so that the gradients are those of the whole
    batch's mean loss (scale_loss=False is a pitfall: m times too large). recv_before_send
    is another: each stage waits for a micro-batch's gradient before sending the
    activation it needs, and the pipeline deadlocks until each stage's wait gives up
    (`timeout_s`, wait_for_work). `group` is
    the process group the sends go over (None: the world; ranks stay global either way).

    What an op sends goes out together with the next op's receive (_exchange), so a stage
    never waits on a receive while its own send to that neighbour is still unposted.
    Returns the last stage's losses."""
    first, last = stage == 0, stage == stages - 1
    m = len(inputs)
    kept, posted, losses = {}, [], []
    outgoing = []   # [(tensor, rank)] the last op made, not yet posted

    def post(recv=None):
        """Post what the last op made, with the next receive if there is one."""
        nonlocal outgoing
        handles, handle = _exchange(outgoing, recv, group)
        posted.extend(zip(handles, [tensor for tensor, _ in outgoing]))
        outgoing = []
        return handle

    waited = {}   # (op, micro-batch) -> (start, end) of the wait for its input

    def receive(shape, source, what, key=None):
        buffer = torch.empty(shape, device=device)
        handle = post((buffer, source))
        start = time.perf_counter()
        _wait_for(handle, what, source, stage, timeout_s, device)
        if key is not None:
            waited[key] = (start, time.perf_counter())
        return buffer

    for op, i in order:
        if (op == "F" and first) or (op == "B" and last):
            post()   # this op receives nothing: what the last one made goes out now
        if op == "F":
            x = inputs[i] if first else receive(activation_shape, prev_rank,
                                                f"micro-batch {i}'s activations", ("F", i))
            if not first:
                x.requires_grad_()
            with clock.op("F", i, stage, waited.get(("F", i))):
                y = piece(x)
                if last:
                    loss = loss_fn(y, targets[i])
                    losses.append(loss.detach())
                    y = loss / m if scale_loss else loss
            if not last:
                if recv_before_send:
                    receive(activation_shape, next_rank, f"micro-batch {i}'s gradient")
                outgoing.append((y.detach(), next_rank))
            kept[i] = (x, y)
        else:
            x, y = kept.pop(i)
            grad = None if last else receive(y.shape, next_rank, f"micro-batch {i}'s gradient",
                                             ("B", i))
            with clock.op("B", i, stage, waited.get(("B", i))):
                torch.autograd.backward(y, grad)
            if not first:
                outgoing.append((x.grad, prev_rank))
    post()
    for handle, _ in posted:
        handle.wait()
    return losses


class _Scale(nn.Module):
    """A stage that only carries its input on: a handoff probe's piece."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.weight


def handoff_samples(stage, stages, shape, device, rounds, pause_s, group=None, ranks=None,
                    timeout_s=0.0):
    """One-way handoffs between neighbouring stages, in seconds, one sample per round:
    a ping-pong through the whole pipeline, made of the schedule's own calls. Each round
    runs one micro-batch of an activation's `shape` down all the stages and its gradient
    back up (run_schedule with m = 1), every forward lasting `pause_s` and every backward
    twice that, as the ops of a controlled-time schedule do: a rank then waits as long as
    it would in a step, and a process that has waited wakes more slowly than one in a
    tight loop. The round's time less its ops' is 2(p - 1) handoffs: each a message, its
    posting, and the wake-up of the rank waiting for it: its receives wait as the
    schedules' do (wait_for_work, within `timeout_s`), so the samples hold the same
    wake-up. `ranks` [global rank of each stage] (None: stage = rank). Every rank calls
    it and gets every sample."""
    if stages == 1:
        return []
    ranks = ranks or list(range(stages))
    with torch.device(device):   # made where it runs (nothing is moved from the host)
        piece = _Scale()
    clock = OpClock(pause_s, device=device)
    inputs = [torch.zeros(shape, device=device)]
    samples = []
    for round_ in range(rounds + 1):   # the first round sets the pairs up: not kept
        clock.reset()
        dist.barrier(group=group)
        start = time.perf_counter()
        run_schedule(piece, schedule_order("gpipe", stages, stage, 1), stage, stages,
                     inputs, [None], lambda y, _: y.sum(), clock=clock,
                     prev_rank=ranks[stage - 1] if stage else None,
                     next_rank=ranks[stage + 1] if stage < stages - 1 else None,
                     activation_shape=shape, device=device, timeout_s=timeout_s,
                     group=group)
        if device.type == "cuda":   # the round ends when its last send has
            torch.cuda.synchronize(device)
        mine = torch.tensor([time.perf_counter() - start,
                             sum(end - begin for *_, begin, end, _ in clock.events)],
                            dtype=torch.float64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(stages)]
        dist.all_gather(everyone, mine, group=group)
        if round_:
            step = max(t[0].item() for t in everyone)
            ops = sum(t[1].item() for t in everyone)
            samples.append(max(0.0, (step - ops) / (2 * (stages - 1))))
    return samples

"""Pipeline parallelism: GPipe and 1F1B built from scratch beside torch's schedules, the
zero-bubble ones included, the bubble measured from each stage's timeline against its model.

The world's N ranks are p = N pipeline stages. The course's transformer is cut into p
contiguous pieces (embedding with the first, head with the last); each step's batch is cut
into m micro-batches, which flow forward through the stages and their gradients back. Each
schedule trains for --steps steps on the same batches and is compared with one process
that trains the whole model on the whole batch.

  gpipe              from scratch: all m forwards, then all m backwards
  1f1b               from scratch: p-1-s forwards on stage s, then one forward and one
                     backward in turn, then the backwards left
  torch_gpipe        torch.distributed.pipelining's ScheduleGPipe
  torch_1f1b         its Schedule1F1B
  torch_interleaved  its ScheduleInterleaved1F1B, --chunks pieces per rank
  torch_zb1p         its ScheduleInterleavedZeroBubble (Qi et al.'s ZB-H1 over --chunks
                     pieces per rank): the backward split into I (the input's gradient) and
                     W (the weights'), the W's moved into the drain
  torch_zbv          its ScheduleZBVZeroBubble (their ZB-V): two pieces per rank in a V,
                     rank r holding pieces r and 2p-1-r
  torch_dualpipev    its ScheduleDualPipeV (DeepSeek's DualPipe cut in half), the same V;
                     m >= 2p
  no_loss_scale      pitfall: gpipe with each micro-batch's loss not divided by m
  recv_before_send   pitfall: each stage receives before it sends (a gradient its own
                     activations lead to, or, on the last, activations not yet sent): a
                     deadlock, ended by --p2p-timeout with one line

Each forward and backward of a micro-batch on each stage is timed, and where a schedule
splits the backward, its I and its W apart. With --compute-ms T every forward lasts
exactly T ms, every whole backward 2T, and every I and every W T (the real work, then a
sleep; a rank's v pieces each take 1/v of that): a controlled-time experiment, in which
the ops' lengths no longer depend on the CPU, unless an op's real work overruns T (those
ops are counted); the handoffs between stages still add their latency. Without it the
timeline is that of the real computation, which on a shared CPU is not a GPU's.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/pipeline.py \\
                          --microbatches 1,2,4,8 --compute-ms 5 --out pp4.json
  one process:          python labs/pipeline.py --schedule gpipe
  a trace per stage:    torchrun --standalone --nproc_per_node=4 labs/pipeline.py \\
                          --schedule 1f1b --profile prof/
                        python labs/trace.py analyze prof/1f1b-m4-p4-rank*.json
  GPU box, NCCL (m >= p, or torch's 1F1B skips itself):
                        torchrun --standalone --nproc_per_node=8 labs/pipeline.py \\
                          --microbatches 8,16 --layers 16 --hidden 1024 --heads 16 \\
                          --seq 512 --out pp8.json
  two nodes (run on each, HOST = node 0's address; stages 0-7 on node 0, 8-15 on 1):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=pp labs/pipeline.py --layers 16 --out pp16.json

JSON: `pp`, `shape`, `batch`, `compute_ms`, `handoff_latency_samples_s`; `schedules`
{name: {max_param_diff, expected_equal, step_time_s, bubble_fraction (idle time over p x
step time, from the timeline), predicted_bubble_fraction (the textbook formula; for the
zero-bubble schedules the walk of their order at equal F, I and W,
time_model.zero_bubble_bubble_fraction),
handoff_latency_s and handoff_latency_range_s (the median of this launch's handoff
samples; the range's bottom, 0, no handoff at all; its top, the longer of the largest
sample plus the latest wake-up of the step's own ops and the longest handoff the step
itself showed, handoff_latency_step_max_s: None where the ranks ran on several hosts or no
stage was already waiting when its input was sent),
predicted_bubble_fraction_with_handoff (the step's critical path through its ops as they
ran, joined by the median handoff) and predicted_bubble_fraction_with_handoff_range (by
the range's bottom and top), peak_microbatches_in_flight and
predicted_peak_microbatches_in_flight (one per stage; a micro-batch is held from its
forward until its W or whole backward), p2p_bytes_per_rank and
predicted_p2p_bytes_per_rank (one per rank), ops_over_compute_ms (how many ops overran
--compute-ms), profile (rank 0's trace
with --profile, else null)}, or {not_run: why} for a torch schedule that could not run
on this box} for the first
--microbatches value, and `timeline` {name: [{stage, op, microbatch, chunk, piece,
start_s, end_s, wait_s}]} (op F, B, or I and W) of its last step (the one timed: the steps
before it run unpadded), gathered from every rank (wait_s: when the stage waited for the
op's input); `sweep` [{microbatches, batch, schedules, skipped}] for every value,
`skipped` saying why a torch schedule did not run (its 1F1B schedule needs m >= p; its
interleaved ones an m that their m // p rounds divide; DualPipeV m >= 2p). P2P bytes are
counted over the second step (torch's schedules exchange a few bytes of set-up in their first), the
timeline is the last step's.
The handoff between stages (a message and the wake-up of the rank waiting for it) is
measured once per launch: micro-batches sent down the pipeline and back, with ops as long
as the schedules' (labkit.parallel.pipeline_schedules.handoff_samples). Every wait for a
message, there and in every schedule, blocks the rank until the message is in, on NCCL as
on gloo, and is timed where it happens (pipeline_schedules.wait_for_work).
"""

import contextlib
import copy
import dataclasses
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.predict import comm_model, memory_model, time_model
from labkit.runtime import distenv, profiling
from labkit.runtime.collectives import CountCollectives
from labkit.runtime.timing import NCCL_GIVE_UP_FRACTION
from labkit.parallel.pipeline_schedules import (OpClock, handoff_samples, run_schedule,
                                                schedule_order, split_pieces, timed_torch_stage)
from labkit.parallel.strategies import apply_pp, rank_batch
from labkit.model.transformer import (Shape, Transformer, add_shape_args, next_token_loss,
                                      shape_from_args)

# 8 thin layers: every stage of p = 1..4 gets whole layers, and so does every chunk of the
# interleaved schedule with 2 chunks per rank
SHAPE = Shape(layers=8, hidden=16, heads=2, seq=8, vocab=32)
BATCH = 16            # sequences per step: divisible by m = 1, 2, 4, 8, 16
STEPS = 3             # set-up, counted, timed
HANDOFF_ROUNDS = 8    # micro-batches sent down the pipeline and back, to time the handoff
LEARNING_RATE = 0.1   # plain SGD: the result depends on the gradients alone
SCHEDULES = ("gpipe", "1f1b", "torch_gpipe", "torch_1f1b", "torch_interleaved",
             "torch_zb1p", "torch_zbv", "torch_dualpipev")
PITFALLS = ("no_loss_scale", "recv_before_send")
# the zero-bubble schedules: the lab's name, time_model's, and torch's class
# torch's zero-bubble schedules, each by the name time_model prices it under (the class
# each runs: labkit.parallel.strategies.TORCH_SCHEDULES)
ZERO_BUBBLE = {"torch_zb1p": "zb1p", "torch_zbv": "zbv", "torch_dualpipev": "dualpipev"}
# one rank holds several pieces of the model: none of these runs on one stage
MULTI_PIECE = ("torch_interleaved", *ZERO_BUBBLE)
# the controlled length of each op, in forwards: a whole backward two, its halves one each
OP_LENGTH = {"F": 1, "B": 2, "I": 1, "W": 1}


def reference(shape, batch, args, device):
    """One process, the whole model, the whole batch: the trained model."""
    torch.manual_seed(args.seed)
    model = Transformer(shape, device=device)   # built where it trains, not moved there
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(args.steps):
        ids, targets = rank_batch(shape, batch, args.seed, step, 0, device)
        next_token_loss(model(ids), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def chunks_of(name, args):
    """Pieces of the model each rank holds under schedule `name`."""
    if name in ("torch_interleaved", "torch_zb1p"):
        return args.chunks
    return 2 if name in ZERO_BUBBLE else 1   # the V: two pieces per rank


def pieces_of(name, rank, p, v):
    """Model pieces rank `rank` of p holds: r, r + p, ... (interleaved), or r and 2p-1-r (V)."""
    if name in ZERO_BUBBLE:
        return time_model.zero_bubble_pieces(ZERO_BUBBLE[name], p, rank, v)
    return [chunk * p + rank for chunk in range(v)]


def split_backward_stage(clock, timeout_s):
    """timed_torch_stage's stage, with the halves of a split backward timed apart: I
    (backward_one_chunk with full_backward=False, which the timed stage would call B) and
    W (backward_weight_one_chunk)."""
    from torch.distributed.pipelining import PipelineStage
    timed = timed_torch_stage(clock, timeout_s)

    class SplitBackwardStage(timed):
        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                               last_backward=False):
            if full_backward:
                return super().backward_one_chunk(bwd_chunk_id, loss=loss,
                                                  last_backward=last_backward)
            with clock.op("I", bwd_chunk_id, self.stage_index):
                return PipelineStage.backward_one_chunk(self, bwd_chunk_id, loss=loss,
                                                        full_backward=False,
                                                        last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with clock.op("W", bwd_chunk_id, self.stage_index):
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return SplitBackwardStage


class Pipeline:
    """This rank's pieces of one schedule, and how to run one step of it."""

    def __init__(self, name, shape, m, args, env):
        self.name, self.m, self.env = name, m, env
        timeout_s = args.p2p_timeout   # every wait for a message gives up after it
        p, v = env.world_size, chunks_of(name, args)
        self.indices = pieces_of(name, env.rank, p, v)
        self.last_piece = p * v - 1
        torch.manual_seed(args.seed)   # the reference's initial weights, made as it makes them
        all_pieces = split_pieces(Transformer(shape, device=env.device), p * v)
        self.clock = OpClock(
            None if args.compute_ms is None else args.compute_ms / 1e3 / v, device=env.device)
        self.pieces = [all_pieces[k] for k in self.indices]
        micro = args.batch // m
        self.activation_shape = (micro, shape.seq, shape.hidden)
        if name.startswith("torch_"):
            last = p * v - 1
            # examples of a piece's input and output: float ones carry gradients
            activation = lambda *shape: torch.zeros(shape, device=env.device,  # noqa: E731
                                                    requires_grad=True)
            ids = torch.zeros((micro, shape.seq), dtype=torch.long, device=env.device)
            examples = dict(
                input_example=lambda k: ids if k == 0 else activation(*self.activation_shape),
                output_example=lambda k: activation(micro, shape.seq, shape.vocab) if k == last
                else activation(*self.activation_shape))
            # the zero-bubble schedules' stages time the input and weight halves of B apart
            stage_class = (split_backward_stage if name in ZERO_BUBBLE else timed_torch_stage)(
                self.clock, timeout_s)
            self.torch_schedule = apply_pp(
                self.pieces, self.indices, p * v, name.removeprefix("torch_"), m,
                next_token_loss, env.device, stage_class=stage_class, **examples)
        self.scratch_options = dict(scale_loss=name != "no_loss_scale",
                                    recv_before_send=name == "recv_before_send")
        self.optimizer = torch.optim.SGD([q for piece in self.pieces for q in piece.parameters()],
                                         lr=LEARNING_RATE)

    def run_schedule(self, ids, targets, timeout_s):
        """Forward and backward of every micro-batch: the gradients, not yet applied."""
        env, p = self.env, self.env.world_size
        if not self.name.startswith("torch_"):
            first, last = env.rank == 0, env.rank == p - 1
            kind = "gpipe" if self.name in ("no_loss_scale", "recv_before_send") else self.name
            run_schedule(self.pieces[0], schedule_order(kind, p, env.rank, self.m), env.rank,
                         p, ids.chunk(self.m), targets.chunk(self.m), next_token_loss,
                         clock=self.clock, prev_rank=env.rank - 1, next_rank=env.rank + 1,
                         activation_shape=self.activation_shape, device=env.device,
                         timeout_s=timeout_s, **self.scratch_options)
            return
        # torch's schedules take the inputs where the first piece is, the targets where the
        # last is: rank 0 for both in a V
        first, last = 0 in self.indices, self.last_piece in self.indices
        if first and last:
            self.torch_schedule.step(ids, target=targets)
        elif first:
            self.torch_schedule.step(ids)
        elif last:
            self.torch_schedule.step(target=targets)
        else:
            self.torch_schedule.step()


def run_one(name, shape, m, args, env, expected, handoffs, profile=False):
    """Train schedule `name` with m micro-batches: its results (on every rank) and its last
    step's timeline; with `profile`, then its trace per rank (--profile)."""
    pipeline = Pipeline(name, shape, m, args, env)
    # the whole device, NCCL's streams included: the step ends when its last sends have
    synchronize = ((lambda: torch.cuda.synchronize(env.device)) if env.device.type == "cuda"
                   else (lambda: None))
    counter = comm_model.CollectiveCounter(env.world_size)
    # Bytes are counted over the second step: torch's schedules agree on their set-up by
    # sending a few bytes in their first. The timeline is the last step's; the counting
    # does not slow its ops, which run outside the counting mode (OpClock).
    counted = min(1, args.steps - 1)
    # Only the last step is timed: the steps before it (warm-ups, and the counted one) run
    # their ops at the speed of their real work, not padded to --compute-ms.
    padded = pipeline.clock.compute_s
    for step in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, step, 0, env.device)
        pipeline.clock.reset()
        pipeline.clock.compute_s = padded if step == args.steps - 1 else None
        counting = CountCollectives(counter) if step == counted else contextlib.nullcontext()
        synchronize()   # nothing queued before the step is timed as the step's
        dist.barrier()
        start = time.perf_counter()
        with counting:
            pipeline.run_schedule(ids, targets, args.p2p_timeout)
        synchronize()   # the step's last sends, queued on the GPU, are part of it
        elapsed = time.perf_counter() - start
        pipeline.optimizer.step()
        pipeline.optimizer.zero_grad(set_to_none=True)
    events = [{"stage": env.rank, "op": op, "microbatch": i, "chunk": piece // env.world_size,
               "piece": piece, "start_s": t0 - start, "end_s": t1 - start,
               "wait_s": None if wait is None else [wait[0] - start, wait[1] - start]}
              for op, i, piece, t0, t1, wait in pipeline.clock.events]
    # the step's start on this rank's clock, and the host that clock belongs to: on one
    # host every rank reads one monotonic clock, and the step's own handoffs can be timed
    mine = {"elapsed": elapsed, "events": events, "sent": int(counter.sent),
            "over": pipeline.clock.over_budget, "start": start, "clock": clock_owner()}
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, mine)

    references = split_pieces(copy.deepcopy(expected), env.world_size * chunks_of(name, args))
    own = [q for piece in pipeline.pieces for q in piece.parameters()]
    ref = [q for k in pipeline.indices for q in references[k].parameters()]
    p, v = env.world_size, chunks_of(name, args)
    step_time = max(r["elapsed"] for r in ranks)
    busy = sum(e["end_s"] - e["start_s"] for r in ranks for e in r["events"])
    kind = (ZERO_BUBBLE[name] if name in ZERO_BUBBLE else "interleaved" if v > 1
            else "1f1b" if "1f1b" in name else "gpipe")
    # The prediction with the handoff: the ops as they ran on each rank (their order, and
    # each one's time from its input in hand to its end), what each rank spent between
    # ops before it could take the next input (posting what the last one made: measured
    # where a wait for a message was recorded before the op, by run_schedule or in
    # torch's schedules, else the gap before the op),
    # and the handoff this launch measured: its median, and its smallest and largest
    # sample for the range its spread allows.
    orders = {rank: [] for rank in range(p)}
    durations = {rank: [] for rank in range(p)}
    before_input = {rank: [] for rank in range(p)}
    for rank, r in enumerate(ranks):
        previous = 0.0
        for e in sorted(r["events"], key=lambda e: e["start_s"]):
            orders[rank].append((e["op"], e["microbatch"], e["piece"]))
            wait_start, in_hand = e["wait_s"] or (e["start_s"], e["start_s"])
            before_input[rank].append(max(0.0, wait_start - previous))
            durations[rank].append(e["end_s"] - in_hand)
            previous = e["end_s"]
    # A wake-up as late as the latest this step saw (an op that overran its controlled
    # time overran by a late wake-up from its sleep) may hit any handoff: the range's top
    # adds it to the largest sample, so a busy machine widens the range by what it showed.
    late = latest_wakeup(ranks, pipeline.clock.compute_s)
    # and a handoff as long as the longest this step itself showed: load that came after
    # the launch took its samples shows there (None: ranks on several hosts)
    shown = step_handoffs(ranks)
    longest = max(shown or [], default=0.0)
    # The range's bottom is no handoff at all, a floor: walked with the smallest sample
    # instead, torch's interleaved and zero-bubble schedules came out above what they
    # measured (by up to 0.03 of the step at p = 3 and m = 6, two cores), so the walk does
    # not follow their waits closely enough to bound them from below
    handoff = (statistics.median(handoffs) if handoffs else 0.0, 0.0,
               max(max(handoffs, default=0.0) + late, longest))
    with_handoff = [time_model.pipeline_bubble_with_handoff(orders, durations, latency,
                                                            before_input, busy)
                    for latency in handoff]
    numel = args.batch // m * shape.seq * shape.hidden   # one micro-batch's activations
    if name in ZERO_BUBBLE:
        # the step of the schedule's own order at equal F, I and W (only their ratio counts)
        predicted = time_model.zero_bubble_bubble_fraction(kind, p, m, 1, 1, 1, v)
        held = memory_model.zero_bubble_peak_microbatches(kind, p, m, v)
        sent = comm_model.pipeline_p2p_bytes_per_rank(
            p, m, numel, v, layout="interleaved" if kind == "zb1p" else "v")
    else:
        predicted = time_model.pipeline_bubble_fraction(p, m, v)
        held = memory_model.pipeline_peak_microbatches(kind, p, m, v)
        sent = comm_model.pipeline_p2p_bytes_per_rank(p, m, numel, v)
    result = {
        "max_param_diff": distenv.max_param_diff(own, ref, env.device),
        "expected_equal": name != "no_loss_scale" or m == 1,
        "step_time_s": step_time,
        "bubble_fraction": 1 - busy / (p * step_time),
        "predicted_bubble_fraction": predicted,
        "handoff_latency_s": handoff[0],
        "handoff_latency_range_s": list(handoff[1:]),
        "handoff_latency_step_max_s": longest if shown else None,
        "predicted_bubble_fraction_with_handoff": with_handoff[0],
        "predicted_bubble_fraction_with_handoff_range": with_handoff[1:],
        "peak_microbatches_in_flight": [peak_in_flight(r["events"]) for r in ranks],
        "predicted_peak_microbatches_in_flight": held,
        "p2p_bytes_per_rank": [r["sent"] for r in ranks],
        "predicted_p2p_bytes_per_rank": sent,
        "ops_over_compute_ms": sum(r["over"] for r in ranks),
        "profile": None,
    }
    timeline = sorted((e for r in ranks for e in r["events"]),
                      key=lambda e: (e["stage"], e["start_s"]))
    if profile:   # extra steps at the ops' own speed, after the comparison above
        def one_step():
            pipeline.clock.reset()
            pipeline.clock.compute_s = None
            pipeline.run_schedule(ids, targets, args.p2p_timeout)
            pipeline.optimizer.step()
            pipeline.optimizer.zero_grad(set_to_none=True)
        result["profile"] = str(profiling.profile_steps(args.profile, f"{name}-m{m}-p{p}",
                                                        env.device, one_step))
    return result, timeline


# How far the measured bubble may lie from the prediction with the handoff, beyond the range
# this launch's own handoffs give: the ops are timed on each rank's own clock, and
# late wake-ups on the critical path move a short step by about this much. The handoff
# samples average a round's hops, so one hop can outlast the largest of them: at 0.03 a
# 3-stage GPipe step at m = 3 measured 0.004 above its bound, on two cores shared with
# another 3-rank launch.
BUBBLE_MARGIN = 0.05


# How long a stage that gave up on a deadlock stays before exiting (see main)
DEADLOCK_GRACE_S = 1.0


def deadlock_grace_s(args, device):
    """DEADLOCK_GRACE_S, but on NCCL no longer than half the time its watchdog leaves: it
    ends the process once a receive has waited the group's --timeout, and the stage gave
    up at NCCL_GIVE_UP_FRACTION of --p2p-timeout (timing.wait_for_work)."""
    if device.type != "cuda":
        return DEADLOCK_GRACE_S
    left = args.timeout - NCCL_GIVE_UP_FRACTION * args.p2p_timeout
    return max(0.0, min(DEADLOCK_GRACE_S, left / 2))


def bubble_bounds(result):
    """(lowest, highest) bubble a schedule's `result` may measure: the prediction with no
    handoff, and with the longest handoff the step showed (or the largest sample plus the
    step's latest wake-up, if longer), widened by BUBBLE_MARGIN. What a busy machine adds
    shows in those, even load that came after the samples, so the bounds widen with the
    same run's own spread, not with a constant chosen for one machine."""
    low, high = result["predicted_bubble_fraction_with_handoff_range"]
    return low - BUBBLE_MARGIN, high + BUBBLE_MARGIN


def step_handoffs(ranks):
    """Seconds from the end of each op whose output a neighbouring stage waited for to the
    end of that wait: the step's own handoffs (a message, and the wake-up of the stage
    waiting for it), counted only where the stage was already waiting when the op ended
    (otherwise the wait's end says when it asked, not when the message came). A forward
    takes its input from the forward of the piece before; a backward (B, or I when split)
    from the backward of the piece after. None when the ranks read different clocks
    (clock_owner: several hosts); [] when no stage waited so."""
    if len({r["clock"] for r in ranks}) > 1:
        return None
    made = {}   # (F or B, micro-batch, piece) -> (stage, when the op ended on the one clock)
    for stage, r in enumerate(ranks):
        for e in r["events"]:
            if e["op"] != "W":
                made["F" if e["op"] == "F" else "B", e["microbatch"], e["piece"]] = (
                    stage, r["start"] + e["end_s"])
    shown = []
    for stage, r in enumerate(ranks):
        for e in r["events"]:
            if e["wait_s"] is None or e["op"] == "W":
                continue
            source = (("F", e["microbatch"], e["piece"] - 1) if e["op"] == "F" else
                      ("B", e["microbatch"], e["piece"] + 1))
            if source not in made or made[source][0] == stage:
                continue   # the loss's gradient, the first input, or a piece on this rank
            ended = made[source][1]
            asked, in_hand = (r["start"] + t for t in e["wait_s"])
            if asked <= ended:
                shown.append(in_hand - ended)
    return shown


def clock_owner():
    """Whose monotonic clock this process reads (time.perf_counter, CLOCK_MONOTONIC on
    Linux): the host's boot, where Linux names it, whose clock the processes of one machine
    share (a time namespace, which container runtimes do not make by default, would offset
    it); a host name alone can repeat across machines (containers, cluster images)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def latest_wakeup(ranks, compute_s):
    """Seconds the latest op of a controlled-time step overran its set length by (its
    sleep's wake-up, late on a busy machine); 0 without controlled time."""
    if compute_s is None:
        return 0.0
    return max([0.0] + [e["end_s"] - e["start_s"] - compute_s * OP_LENGTH[e["op"]]
                        for r in ranks for e in r["events"]])


def peak_in_flight(events):
    """Most micro-batches (of any chunk) whose forward has run and whose backward has not
    ended: its whole backward (B), or, split, its W (after its I a micro-batch keeps what
    W reads)."""
    held = peak = 0
    for event in sorted(events, key=lambda e: e["start_s"]):
        held += {"F": 1, "I": 0, "W": -1, "B": -1}[event["op"]]
        peak = max(peak, held)
    return peak


def run(args, env):
    shape = shape_from_args(args)
    sweep, timelines = [], {}
    # The handoff between stages, measured once in this launch with ops as long as the
    # schedules' (their forward's time), on the first sweep point's activations.
    batch = args.microbatches[0] * args.microbatch_size if args.microbatch_size else args.batch
    handoffs = handoff_samples(env.rank, env.world_size,
                               (batch // args.microbatches[0], shape.seq, shape.hidden),
                               env.device, HANDOFF_ROUNDS, (args.compute_ms or 0) / 1e3,
                               timeout_s=args.timeout)   # the ranks' first exchange
    for index, m in enumerate(args.microbatches):
        args.batch = m * args.microbatch_size if args.microbatch_size else args.batch
        expected = reference(shape, args.batch, args, env.device)
        schedules, skipped = {}, {}
        for name in args.schedule:
            reason = torch_refuses(name, m, env.world_size)
            if reason:
                skipped[name] = reason
                env.print0(f"{name:>17} m={m:<2}: skipped, {reason}")
                continue
            def measure():
                result, timeline = run_one(name, shape, m, args, env, expected, handoffs,
                                           profile=args.profile is not None and index == 0)
                return {"result": result, "timeline": timeline}

            if name.startswith("torch_"):
                # one of torch's schedules may be missing or refuse on another torch: it is
                # recorded as not run ({"not_run": why}) and the others go on. The lab's own
                # run directly: a deadlock (the pitfall) must end the lab with its one line.
                ran = distenv.try_variant(env, f"{name:>17} m={m:<2}", measure)
                if "not_run" in ran:
                    schedules[name] = ran
                    continue
            else:
                ran = measure()
            schedules[name] = ran["result"]
            if index == 0:
                timelines[name] = ran["timeline"]
            report(env, name, m, ran["result"])
        sweep.append({"microbatches": m, "batch": args.batch, "schedules": schedules,
                      "skipped": skipped})
    return {"pp": env.world_size, "shape": dataclasses.asdict(shape),
            "batch": sweep[0]["batch"], "compute_ms": args.compute_ms,
            "schedules": sweep[0]["schedules"], "timeline": timelines, "sweep": sweep,
            "handoff_latency_samples_s": handoffs}


def torch_refuses(name, m, p):
    """Why torch's schedule `name` will not run m micro-batches on p stages, or None."""
    if name == "torch_1f1b" and m < p:
        return "torch's 1f1b schedule needs at least as many micro-batches as stages"
    if name in ("torch_interleaved", "torch_zb1p") and m % max(1, m // p):
        return (f"torch's interleaved schedules run m // p = {m // p} rounds, which must "
                f"divide m")
    if name == "torch_dualpipev" and m < 2 * p:
        return "torch's DualPipeV needs at least as many micro-batches as stages, 2p"
    return None


def report(env, name, m, r):
    verdict = "as expected" if ((r["max_param_diff"] <= 1e-5)
                                == r["expected_equal"]) else "UNEXPECTED"
    env.print0(f"{name:>17} m={m:<2}: max |p - ref| {r['max_param_diff']:.1e} ({verdict}); "
               f"bubble {r['bubble_fraction']:.3f} (predicted "
               f"{r['predicted_bubble_fraction']:.3f}); in flight "
               f"{r['peak_microbatches_in_flight']} (predicted "
               f"{r['predicted_peak_microbatches_in_flight']})")


def check(args, world_size):
    """Every stage (and chunk) needs a layer, or the lab refuses to start."""
    multi = [name for name in args.schedule if name in MULTI_PIECE]
    if world_size == 1 and multi:
        if args.schedule == list(SCHEDULES):   # all: leave out what one stage cannot run
            args.schedule = [name for name in args.schedule if name not in MULTI_PIECE]
        else:
            distenv.fail(f"{multi[0]} needs at least 2 pipeline stages")
    pieces = max(world_size * chunks_of(name, args) for name in args.schedule)
    if args.layers < pieces:
        distenv.fail(f"--layers {args.layers} cannot give each of {pieces} pipeline pieces "
                     f"a layer ({world_size} stages x {pieces // world_size} pieces each)"
                     if pieces > world_size else
                     f"--layers {args.layers} cannot give each of {world_size} stages a layer")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--schedule", type=distenv.choice_list(SCHEDULES + PITFALLS, SCHEDULES),
                        default=list(SCHEDULES),
                        help=f"comma-separated, from {', '.join(SCHEDULES + PITFALLS)}; all: "
                             "every schedule but the pitfalls")
    parser.add_argument("--microbatches", type=distenv.int_list(), default=[4],
                        help="micro-batches per step, m; a list (1,2,4,8) sweeps them")
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="sequences per step (every m must divide it)")
    parser.add_argument("--microbatch-size", type=distenv.positive_int, default=None,
                        help="sequences per micro-batch instead: the batch is then m times it")
    parser.add_argument("--compute-ms", type=distenv.number_above(0, inclusive=True), default=None,
                        help="controlled time: every forward of a micro-batch lasts this many "
                             "ms on every stage, every backward twice as long")
    parser.add_argument("--chunks", type=distenv.at_least(2), default=2,
                        help="pieces per rank in torch_interleaved (v)")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS, help="training steps")
    # apart from --timeout, which also bounds the ranks' first meeting: a short wait for a
    # stage's message must not also fail a start that a busy machine has spread out
    parser.add_argument("--p2p-timeout", type=distenv.number_above(0), default=None,
                        metavar="SECONDS",
                        help="how long a stage waits for a message of the schedule before it "
                             "gives up (default: --timeout)")
    profiling.add_profile_arg(parser)
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(argv)
    shape_from_args(args)   # refuses a shape the model cannot have
    for m in args.microbatches:
        if args.microbatch_size is None and args.batch % m:
            distenv.fail(f"--microbatches {m} does not divide --batch {args.batch}")
    if args.p2p_timeout is None:
        args.p2p_timeout = args.timeout
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        check(args, env.world_size)
        env.print0(f"{env.world_size} pipeline stages ({env.backend}), {args.layers} layers"
                   + (f", controlled time: forward {args.compute_ms:g} ms, backward "
                      f"{2 * args.compute_ms:g} ms" if args.compute_ms is not None else ""))
        try:
            env.write_result(args, run(args, env))
        except TimeoutError as error:
            # each stage says what it waited for, and stays a moment: a peer whose wait
            # began a little later (a busy machine) must reach its own timeout
            distenv.fail(str(error), every_rank=True,
                         linger_s=deadlock_grace_s(args, env.device))


if __name__ == "__main__":
    main()

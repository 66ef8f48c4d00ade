"""Talking less: the same model trained with DDP, with compressed gradients (bf16, PowerSGD)
and with fewer synchronisations (local SGD, DiLoCo, Streaming DiLoCo), on the same batches;
every byte counted against the cost model, the loss after the same tokens, and the step
time on the plain link and on one slowed on purpose.

  ddp               torch's DDP, AdamW: the reference
  bf16              DDP with a hook that all-reduces the gradients cast to bf16 (torch's own
                    bf16_compress_hook refuses gloo: this one is five lines)
  powersgd          DDP with torch's powerSGD_hook at --powersgd-rank, error feedback on
  local_sgd         AdamW alone on each rank; every --sync-every steps the parameters averaged
  diloco            AdamW alone for --sync-every steps (the inner steps), then the pseudo-
                    gradient averaged and an outer Nesterov SGD step (Douillard et al. 2023)
  streaming_diloco  DiLoCo by --fragments fragments of the layers, each synced every
                    --sync-every steps at its own offset (Douillard et al. 2025)

Then the checks: DiLoCo with one inner step of SGD and an outer SGD of rate 1 without
momentum is DDP with SGD (their parameters differ by fp32 rounding at most); PowerSGD
without error feedback (its loss against the one with it); torchft's own LocalSGD and
DiLoCo (torchft.local_sgd) on the same model and batches as local_sgd, diloco and
streaming_diloco here; the bf16 hook's averaged gradient against DDP's, held to the
precision chapter's model of a bf16 sum (and, on NCCL, against torch's bf16_compress_hook);
and DiLoCo's loss after the same tokens at each H of --h-sweep.

The slowed link (--slow-ns-per-byte): before each collective the issuing thread sleeps that
long for every byte the rank sends (labkit.runtime.collectives.SlowLink), so each byte a
method sends adds the same wait, and nothing overlaps it. The predicted step time is the same run's
step without communication, plus each all-reduce's alpha + bytes / beta, alpha and beta
fitted on the same link in the same launch (labkit/predict/low_communication_model.py).

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=2 labs/low_communication.py \\
                          --out lowcomm.json
  one method:           torchrun --standalone --nproc_per_node=3 labs/low_communication.py \\
                          --method diloco --sync-every 8
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/low_communication.py \\
                          --steps 32 --out lowcomm8.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=lowcomm labs/low_communication.py --steps 64 --out lowcomm16.json

JSON: `methods` {name: {bytes_sent_per_rank_per_step (its all-reduces'),
predicted_bytes_sent_per_rank_per_step, other_bytes_sent_per_rank (DDP's one broadcast of
its bucket order), peak_bytes_per_step (the most one step all-reduced),
predicted_peak_bytes_per_step, predicted_extra_compute_s (PowerSGD's products),
loss_curve, final_loss, step_time_s {plain, slowed}, step_time_spread_s {plain, slowed:
[fastest, slowest] timed step}, predicted_step_time_s {plain, slowed},
forward_time_spread_s {plain, slowed: [fastest, slowest] forward pass of the timed steps},
max_param_diff_vs_ddp; bf16 also grad_error_vs_ddp {relative_rms, max_abs,
max_over_bound}, predicted_grad_error_bound {relative_rms, coefficient, floor},
summation {algorithm, rms_model_applies}, torch_hook_max_grad_diff (a number, or
{not_run}); local_sgd, diloco and streaming_diloco also outer_state_bytes {anchor,
outer_momentum}, predicted_outer_state_bytes, and torchft {steps,
max_param_diff_after_first_sync, max_param_diff_vs_scratch, bytes_sent_per_rank_per_step,
scratch_bytes_sent_per_rank_per_step, outer_state_bytes, anchor_device} or {not_run}} or
{not_run}}; `link` {alpha_s, beta_bytes_per_s, slowed_beta_bytes_per_s};
`compute_step_s`, `compute_step_spread_s`, `compute_forward_s`; `checks`
{diloco_h1_max_param_diff_vs_ddp, powersgd_no_error_feedback_final_loss}; `h_sweep`
[{sync_every, final_loss, predicted_bytes_sent_per_rank_per_step}]; `shape`,
`param_count`, `steps`, `sync_every`, `fragments`, `powersgd_rank`, `inner_lr`,
`outer_lr`, `outer_momentum`. The slowed link times two periods of --sync-every steps, and
torchft runs as many.
"""

import copy
import dataclasses
import inspect
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from labkit.model.transformer import Shape, Transformer, next_token_loss
from labkit.parallel.strategies import apply_ddp
from labkit.predict import comm_model
from labkit.predict import low_communication_model as model
from labkit.runtime import distenv
from labkit.runtime.collectives import SlowLink

SHAPE = Shape(layers=4, hidden=64, heads=4, seq=32, vocab=256)
BATCH = 4                   # sequences per rank per step
STEPS = 16
SYNC_EVERY = 4              # H: inner steps between syncs
FRAGMENTS = 2               # P: streaming DiLoCo's fragments
POWERSGD_RANK = 2
INNER_LR = 3e-3             # AdamW, every method's (DiLoCo's inner) optimizer
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9   # DiLoCo's outer Nesterov SGD (the paper's values)
SLOW_NS_PER_BYTE = 20.0     # the slowed link: 50 MB/s a rank
# bytes all-reduced to fit alpha and beta: up to 4 MiB, where a fast link's time grows with
# the size well past its latency's noise (at 1 MiB and below, loopback gloo can fit no slope)
FIT_SIZES = (2**16, 2**20, 2**22)
CHECK_STEPS = 6             # steps of the check that DiLoCo with H = 1 is DDP
H_SWEEP = (1, 2, 4, 8, 16)  # DiLoCo's H for the loss after the same tokens (those <= --steps)


def pattern_batch(args, step, rank, device):
    """Rank `rank`'s batch at `step`: sequences that count up from a random start by a
    random stride (mod the vocabulary), so the next token follows from the last two and the
    loss falls within a few dozen steps (random tokens would teach nothing to compare)."""
    g = distenv.generator(args.seed, "pattern", step, rank)
    start = torch.randint(SHAPE.vocab, (args.batch, 1), generator=g, device="cpu")
    stride = torch.randint(1, 8, (args.batch, 1), generator=g, device="cpu")
    ids = (start + stride * torch.arange(SHAPE.seq + 1, device="cpu")) % SHAPE.vocab
    ids = ids.to(device)
    return ids[:, :-1], ids[:, 1:]


# DDP's switch for its broadcast of buffers before every forward: forward_sync_buffers from
# torch 2.13, which deprecates broadcast_buffers (the only name before it)
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                  inspect.signature(DistributedDataParallel).parameters else
                  {"broadcast_buffers": False})


class DDPMethod:
    """DDP with AdamW, and an optional communication hook."""

    def __init__(self, initial, env, hook=None, state=None):
        # the model's only buffers are its causal masks, the same on every rank: nothing
        # to broadcast each step (a model with norm statistics would need them synced)
        self.model = apply_ddp(copy.deepcopy(initial), env.device, hook, state,
                               **NO_BUFFER_SYNC)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=INNER_LR)

    def forward(self, ids, targets):
        return next_token_loss(self.model(ids), targets)

    def update(self, step, loss):
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self):
        return list(self.model.module.parameters())


def bf16_hook(group, bucket):
    """The bucket's gradients all-reduced in bf16, then back in fp32: half DDP's bytes."""
    gradients = bucket.buffer()
    compressed = gradients.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return future.then(lambda f: gradients.copy_(f.value()[0]))


class LocalSteps:
    """Each rank steps alone with an inner optimizer; `sync(step)` says which fragments
    (lists of parameters) to synchronise after that step. outer=None averages the
    parameters (local SGD); else the pseudo-gradient is averaged and the outer optimizer
    steps from the parameters of the last sync (DiLoCo)."""

    def __init__(self, initial, inner, fragments, syncs, outer=None):
        self.module = copy.deepcopy(initial)
        self.inner = inner(self.module.parameters())
        self.fragments, self.syncs = fragments(self.module), syncs
        self.outer = outer
        if outer is not None:   # the parameters of the last sync, one outer optimizer each
            self.anchors = [[p.detach().clone() for p in f] for f in self.fragments]
            self.outers = [outer(anchor) for anchor in self.anchors]

    def forward(self, ids, targets):
        return next_token_loss(self.module(ids), targets)

    def update(self, step, loss):
        loss.backward()
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        for f in self.syncs(step):
            self.sync(f)

    @torch.no_grad()
    def sync(self, f):
        world = dist.get_world_size()
        params = self.fragments[f]
        if self.outer is None:   # local SGD: the average of the ranks' parameters
            flat = torch.cat([p.reshape(-1) for p in params]).div_(world)
            dist.all_reduce(flat)
            _unflatten(flat, params)
            return
        anchor = self.anchors[f]
        # the pseudo-gradient: where the rank started minus where its inner steps took it
        flat = torch.cat([(a - p).reshape(-1) for a, p in zip(anchor, params)]).div_(world)
        dist.all_reduce(flat)
        for a, g in zip(anchor, _split(flat, anchor)):
            a.grad = g
        self.outers[f].step()   # moves the anchor: the new shared parameters
        self.outers[f].zero_grad(set_to_none=True)
        for p, a in zip(params, anchor):
            p.copy_(a)

    def parameters(self):
        return list(self.module.parameters())

    def outer_state_bytes(self):
        """{anchor, outer_momentum}: bytes of the tensors this rank keeps to sync less often,
        read from the tensors themselves (the outer optimizers' after their first step)."""
        if self.outer is None:
            return {"anchor": 0, "outer_momentum": 0}
        return {"anchor": tensor_bytes(a for anchor in self.anchors for a in anchor),
                "outer_momentum": optimizer_state_bytes(self.outers)}


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizers):
    """Bytes of every tensor the optimizers keep per parameter (SGD's momentum buffer)."""
    return tensor_bytes(value for optimizer in optimizers for state in optimizer.state.values()
                        for value in state.values() if torch.is_tensor(value))


def _split(flat, like):
    out, start = [], 0
    for t in like:
        out.append(flat[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out


def _unflatten(flat, params):
    for p, part in zip(params, _split(flat, params)):
        p.copy_(part)


def fragment_units(module, count):
    """The model's modules in `count` fragments of its layers (fragments_of): the embedding
    with the first, the head with the last."""
    bounds = model.fragments_of(len(module.blocks), count)
    out = []
    for i, (start, end) in enumerate(bounds):
        units = list(module.blocks[start:end])
        if i == 0:
            units.insert(0, module.embed)
        if i == len(bounds) - 1:
            units.append(module.head)
        out.append(units)
    return out


def layer_fragments(count):
    """The model's parameters in `count` fragments of its layers (fragment_units)."""
    return lambda module: [[p for unit in units for p in unit.parameters()]
                           for units in fragment_units(module, count)]


def build(name, initial, env, args, error_feedback=True):
    """The method's trainer."""
    adamw = lambda params: torch.optim.AdamW(params, lr=INNER_LR)   # noqa: E731
    nesterov = lambda params: torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM,  # noqa: E731
                                              nesterov=True)
    every, h = (lambda step: [0] if (step + 1) % args.sync_every == 0 else []), args.sync_every
    if name == "ddp":
        return DDPMethod(initial, env)
    if name == "bf16":
        return DDPMethod(initial, env, bf16_hook, dist.group.WORLD)
    if name == "powersgd":
        if env.device.type == "cpu" and torch.cuda.is_available():
            # torch's hook synchronizes the bucket's device whenever CUDA is available
            # (powerSGD_hook.py), and a CPU bucket's device is no CUDA device
            raise distenv.VariantNotRun("torch's powerSGD_hook cannot run on CPU tensors "
                                        "where CUDA is available")
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=model.POWERSGD_START_ITER, use_error_feedback=error_feedback,
            warm_start=True, random_seed=args.seed)   # only error feedback is switched off
        return DDPMethod(initial, env, powersgd.powerSGD_hook, state)
    if name == "local_sgd":
        return LocalSteps(initial, adamw, layer_fragments(1), every)
    if name == "diloco":
        return LocalSteps(initial, adamw, layer_fragments(1), every, nesterov)
    if name == "streaming_diloco":
        p = args.fragments
        due = [(model.fragment_sync_step(f, p, h) + h - 1) % h for f in range(p)]
        return LocalSteps(initial, adamw, layer_fragments(p),
                          lambda step: [f for f in range(p) if step % h == due[f]], nesterov)
    raise ValueError(name)


def torchft_manager():
    """A stand-in for torchft's Manager, as torchft's own tests build one (create_autospec,
    torchft/local_sgd_test.py), all-reducing over this launch's process group: a sum, then
    divided by the ranks, as Manager.allreduce does; every sync commits, and the step it
    counts (which fragment syncs next) moves on with each commit. torchft's real Manager
    needs its lighthouse and starts its own server on every interface ([::], manager.py of
    torchft 0.2.0), and the course's labs bind 127.0.0.1 only; what is checked here is
    torchft's algorithm (its schedule, pseudo-gradients and outer steps), not its fault
    tolerance."""
    from unittest import mock

    from torchft.manager import Manager
    from torchft.work import _DummyWork

    commits = [0]

    def allreduce(tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
        return _DummyWork(tensor)

    def should_commit(timeout=None):
        commits[0] += 1
        return True

    manager = mock.create_autospec(Manager)
    manager._use_async_quorum = False
    manager.errored.return_value = None
    manager.allreduce.side_effect = allreduce
    manager.should_commit.side_effect = should_commit
    manager.current_step.side_effect = lambda: commits[0]
    return manager


class TorchftMethod:
    """torchft's LocalSGD or DiLoCo around an AdamW, as the from-scratch methods train."""

    def __init__(self, name, initial, args):
        try:
            from torchft.local_sgd import DiLoCo, LocalSGD
        except ImportError as missing:
            raise distenv.VariantNotRun(f"torchft is not installed ({missing})") from None
        h = args.sync_every
        self.module = copy.deepcopy(initial)
        self.inner = torch.optim.AdamW(self.module.parameters(), lr=INNER_LR)
        if name == "local_sgd":
            self.wrapper = LocalSGD(torchft_manager(), self.module, self.inner, sync_every=h)
        else:
            p = args.fragments if name == "streaming_diloco" else 1
            if h % p:
                raise distenv.VariantNotRun(f"torchft's DiLoCo syncs one fragment every H/P "
                                            f"steps: P = {p} must divide H = {h}")
            # torchft syncs its fragment i after (i + 1) H/P inner steps; the lab's fragment
            # f syncs after f H/P (fragment 0 after H): the same schedule, the list rotated
            units = fragment_units(self.module, p)
            fragments = [nn.ModuleList(units[(i + 1) % p]) for i in range(p)]
            outers = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                      nesterov=True) for f in fragments]
            # bucketized: one all-reduce per sync, as the lab's, not one per parameter
            self.wrapper = DiLoCo(torchft_manager(), fragments, self.inner, outers,
                                  sync_every=h, use_bucketization=True)
        self.wrapper.__enter__()   # hooks on the inner optimizer's step: syncs happen there

    def forward(self, ids, targets):
        return next_token_loss(self.module(ids), targets)

    def outer_state(self):
        """What torchft keeps between syncs: {outer_state_bytes: {anchor, outer_momentum},
        anchor_device}. DiLoCo keeps each fragment's parameters of the last sync as a
        backup (on the CPU unless told otherwise) and an outer optimizer per fragment;
        LocalSGD neither."""
        fragments = getattr(self.wrapper, "_fragments", [])
        anchors = [t for f in fragments for t in f.original_parameters.values()]
        return {"outer_state_bytes": {
                    "anchor": tensor_bytes(anchors),
                    "outer_momentum": optimizer_state_bytes(f._outer_optimizer
                                                            for f in fragments)},
                "anchor_device": str(anchors[0].device) if anchors else None}

    def update(self, step, loss):
        loss.backward()
        self.inner.step()   # torchft's hooks sync here when it is time
        self.inner.zero_grad(set_to_none=True)

    def parameters(self):
        return list(self.module.parameters())


def first_sync(name, args):
    """The steps after which the method first syncs: H, or H/P (rounded down) for the
    second fragment of Streaming DiLoCo, the first to sync."""
    return args.sync_every // args.fragments if name == "streaming_diloco" else args.sync_every


def torchft_check(name, initial, args, env, scratch, scratch_sent, steps):
    """torchft's own method trained `steps` steps from the same start on the same batches
    as `scratch` (the lab's, which sent `scratch_sent` bytes by op, and kept its parameters
    after its first sync): their parameters' largest difference after that first sync and
    after all the steps, and the bytes each all-reduced."""
    trainer = TorchftMethod(name, initial, args)
    sent = train(trainer, args, env, 0.0, steps, keep_at=first_sync(name, args))[2]
    trainer.wrapper.__exit__(None, None, None)
    return {"steps": steps, **trainer.outer_state(),
            "max_param_diff_after_first_sync": distenv.max_param_diff(
                trainer.kept, scratch.kept, env.device),
            "max_param_diff_vs_scratch": distenv.max_param_diff(
                trainer.parameters(), scratch.parameters(), env.device),
            "bytes_sent_per_rank_per_step": float(sent.get("all_reduce", 0) / steps),
            "scratch_bytes_sent_per_rank_per_step":
                float(scratch_sent.get("all_reduce", 0) / steps)}


class SentByOp(comm_model.CollectiveCounter):
    """A CollectiveCounter that keeps the bytes sent by each op apart: the gradients' and
    parameters' all-reduces are what the methods differ in; DDP also broadcasts rank 0's
    bucket order once, after its first step (its bucket rebuild), a few hundred bytes."""

    def reset(self):
        super().reset()
        self.by_op = {}

    def add_bytes(self, op, nbytes):
        before = self.sent
        super().add_bytes(op, nbytes)
        self.by_op[op] = self.by_op.get(op, 0) + (self.sent - before)


def train(trainer, args, env, ns_per_byte, steps=None, keep_at=None):
    """(losses, seconds of each step, bytes this rank sent by op, seconds of each step's
    forward pass) over `steps` steps (default --steps). No method communicates in its
    forward, so its time says how fast the machine ran during these steps. keep_at=k: a
    copy of the parameters after k steps, untimed, in trainer.kept; the bytes each step
    all-reduced, in trainer.all_reduce_bytes_by_step."""
    counter = SentByOp(env.world_size)
    losses, times, forwards = [], [], []
    trainer.all_reduce_bytes_by_step = []
    with SlowLink(counter, ns_per_byte):
        for step in range(steps or args.steps):
            before = counter.by_op.get("all_reduce", 0)
            ids, targets = pattern_batch(args, step, env.rank, env.device)
            dist.barrier()   # every rank starts the step together: times are the step's own
            start = time.perf_counter()
            loss = trainer.forward(ids, targets)
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            forwards.append(time.perf_counter() - start)
            trainer.update(step, loss)
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            times.append(time.perf_counter() - start)
            trainer.all_reduce_bytes_by_step.append(counter.by_op.get("all_reduce", 0) - before)
            losses.append(loss.detach())
            if step + 1 == keep_at:
                trainer.kept = [p.detach().clone() for p in trainer.parameters()]
    mean_loss = torch.stack(losses)
    dist.all_reduce(mean_loss)
    return (mean_loss / env.world_size).tolist(), times, counter.by_op, forwards


def fit_link(env, ns_per_byte):
    """alpha (s) and beta (bytes/s) of an all-reduce on this link: median times at a few
    sizes, least squares of time against the bytes a rank sends."""
    points = []
    with SlowLink(comm_model.CollectiveCounter(env.world_size), ns_per_byte):
        for size in FIT_SIZES:
            tensor = torch.zeros(size // 4, device=env.device)
            samples = []
            for _ in range(7):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                samples.append(time.perf_counter() - start)
            sent = comm_model.bytes_sent_per_rank("all_reduce", size, env.world_size)
            points.append((sent, statistics.median(samples)))
    if env.world_size == 1:
        return 0.0, float("inf")
    # every rank uses rank 0's fit: one link, one model
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fit = torch.tensor([max(my - slope * mx, 0.0), slope], dtype=torch.float64,
                       device=env.device)
    dist.broadcast(fit, 0)
    alpha, per_byte = fit.tolist()
    return alpha, (1 / per_byte if per_byte > 0 else float("inf"))


def run_method(name, initial, args, env, links, compute, reference):
    """The method trained on each link from the same start: its bytes, losses, times, and
    its parameters against DDP's (`reference`, trained on the same batches; None: this is
    DDP), and the trainer of the plain link. `compute`: compute_only's."""
    compute_s = compute["step_s"]
    shapes = [tuple(p.shape) for p in initial.parameters()]
    options = dict(sync_every=args.sync_every, rank=args.powersgd_rank,
                   fragment_values=[sum(p.numel() for p in f)
                                    for f in layer_fragments(args.fragments)(initial)])
    # PowerSGD's products at the rate this run's own training step reaches (6 FLOPs per
    # parameter per token): its thin rank-r products run slower per FLOP, so it is a floor
    flops_per_s = 6 * sum(p.numel() for p in initial.parameters()) * args.batch * SHAPE.seq \
        / compute_s
    extra_compute_s = (model.powersgd_flops(shapes, args.powersgd_rank) / flops_per_s
                       if name == "powersgd" else 0.0)
    result = {"step_time_s": {}, "step_time_spread_s": {}, "predicted_step_time_s": {},
              "forward_time_spread_s": {}, "predicted_extra_compute_s": extra_compute_s}
    trainers = {}
    for link, (ns, alpha, beta) in links.items():
        # the plain link trains all --steps steps (the losses, the bytes, the parameters);
        # the slowed one only times: two periods of H steps, two syncs of every fragment
        steps = args.steps if link == "plain" else min(args.steps, 2 * args.sync_every)
        trainer = build(name, initial, env, args)
        step_losses, times, step_sent, forwards = train(trainer, args, env, ns, steps,
                                                        keep_at=first_sync(name, args))
        trainers[link] = trainer, step_sent, steps
        if link == "plain":   # the link changes when a step ends, not what it computes
            losses, sent = step_losses, step_sent
            result["max_param_diff_vs_ddp"] = (
                distenv.max_param_diff(trainer.parameters(), reference.parameters(),
                                       env.device) if reference is not None
                else 0.0 if name == "ddp" else None)   # None: DDP itself did not run
        # the mean over every step but the first (lazy set-up), syncs included: a median
        # would miss the one step in H that syncs
        result["step_time_s"][link] = statistics.fmean(times[1:])
        result["step_time_spread_s"][link] = [min(times[1:]), max(times[1:])]
        # the forward passes, which no method changes: how fast the machine ran these steps
        result["forward_time_spread_s"][link] = [min(forwards[1:]), max(forwards[1:])]
        result["predicted_step_time_s"][link] = model.step_time(
            name, compute_s, steps, shapes, env.world_size, alpha, beta,
            extra_compute_s=extra_compute_s, first_step=1, **options)
    predicted = model.bytes_sent_per_rank(name, args.steps, shapes, env.world_size, **options)
    result.update({
        "bytes_sent_per_rank_per_step": float(sent.get("all_reduce", 0) / args.steps),
        "other_bytes_sent_per_rank": {op: float(b) for op, b in sent.items()
                                      if op != "all_reduce"},
        "predicted_bytes_sent_per_rank_per_step": float(predicted / args.steps),
        # the most one step all-reduced, counted, against the model's most in any step
        "peak_bytes_per_step": float(max(trainers["plain"][0].all_reduce_bytes_by_step)),
        "predicted_peak_bytes_per_step": float(model.peak_bytes_per_sync(
            name, shapes, env.world_size, **options)),
        "loss_curve": losses, "final_loss": losses[-1]})
    if name in ("local_sgd", "diloco", "streaming_diloco"):
        result["outer_state_bytes"] = trainers["plain"][0].outer_state_bytes()
        result["predicted_outer_state_bytes"] = model.outer_state_bytes(
            name, sum(p.numel() for p in initial.parameters()))
        # against the slowed link's run: as many steps, from the same start, on the same
        # batches (two periods of H, so the outer momentum is used once)
        result["torchft"] = distenv.try_variant(env, f"torchft's {name}", lambda: torchft_check(
            name, initial, args, env, *trainers["slowed"]))
    return result, trainers["plain"][0]


def compute_only(initial, args, env):
    """A step with no communication at all (each rank's AdamW alone): {step_s: its median
    seconds, step_spread_s: [fastest, slowest], forward_s: its forward's median}, and the
    last step's loss: DiLoCo's at H = --steps, whose one sync comes after it."""
    trainer = LocalSteps(initial, lambda p: torch.optim.AdamW(p, lr=INNER_LR),
                         layer_fragments(1), lambda step: [])
    losses, times, _, forwards = train(trainer, args, env, 0.0)
    return ({"step_s": statistics.median(times[1:]),
             "step_spread_s": [min(times[1:]), max(times[1:])],
             "forward_s": statistics.median(forwards[1:])}, losses[-1])


def averaged_gradient(initial, env, ids, targets, hook=None, state=None):
    """The gradient DDP leaves after one backward from `initial` (with `hook`), flat."""
    trainer = DDPMethod(initial, env, hook, state)
    next_token_loss(trainer.model(ids), targets).backward()
    return torch.cat([p.grad.reshape(-1) for p in trainer.parameters()])


def summation_order(env):
    """{algorithm, rms_model_applies}: the order in which the backend's all-reduce adds the
    ranks' values. gloo's is a ring (gloo/allreduce.cc, its default algorithm). NCCL picks
    a ring, a tree or NVLink SHARP (NVLS, the switch adds) by size and topology, and tells
    torch nothing of it: the lab can name only what NCCL_ALGO forces, else "unknown".
    The RMS model (sum_relative_error) is the ring's sum, term after term; it also holds
    for two ranks, one addition in any order. The worst case holds for any order: a term
    passes through at most N - 1 additions in a ring, a tree or a switch."""
    algorithm = "ring" if env.backend == "gloo" else os.environ.get("NCCL_ALGO", "unknown")
    return {"algorithm": algorithm,
            "rms_model_applies": algorithm.lower() == "ring" or env.world_size == 2}


def bf16_gradient_check(initial, args, env):
    """The first step's averaged gradient under the bf16 hook against DDP's fp32 one: the
    RMS of their difference relative to DDP's, the largest difference, and the largest
    over its bound (low_communication_model.bf16_average_error_bound, from each value's
    sum over the ranks of |g_r|), and the summation order the RMS model assumes
    (summation_order); on NCCL, torch's bf16_compress_hook against this one."""
    ids, targets = pattern_batch(args, 0, env.rank, env.device)
    exact = averaged_gradient(initial, env, ids, targets)
    bf16 = averaged_gradient(initial, env, ids, targets, bf16_hook, dist.group.WORLD)
    local = copy.deepcopy(initial)
    next_token_loss(local(ids), targets).backward()
    magnitude = torch.cat([p.grad.abs().reshape(-1) for p in local.parameters()])
    dist.all_reduce(magnitude)   # sum over the ranks of |g_r|, value by value
    coefficient, floor = model.bf16_average_error_bound(env.world_size)
    error = (bf16 - exact).abs()
    bound = coefficient * magnitude / env.world_size + floor
    torch_hook = distenv.try_variant(env, "torch's bf16_compress_hook", lambda: (
        averaged_gradient(initial, env, ids, targets, default_hooks.bf16_compress_hook,
                          dist.group.WORLD) - bf16).abs().max().item())
    return {"grad_error_vs_ddp": {"relative_rms": (error.norm() / exact.norm()).item(),
                                  "max_abs": error.max().item(),
                                  "max_over_bound": (error / bound).max().item()},
            "predicted_grad_error_bound": {
                "relative_rms": model.bf16_average_relative_rms(env.world_size),
                "coefficient": coefficient, "floor": floor},
            "summation": summation_order(env),
            "torch_hook_max_grad_diff": torch_hook}


def h_sweep(initial, args, env, methods, unsynced_loss):
    """DiLoCo's loss after the same tokens at each H of --h-sweep, with the bytes it sends
    a step: this run's diloco at --sync-every, and at H = --steps the ranks' loss alone
    (`unsynced_loss`: its one sync comes after the last loss)."""
    shapes = [tuple(p.shape) for p in initial.parameters()]
    rows = []
    for h in args.h_sweep:
        done = methods.get("diloco", {})
        if h == args.sync_every and "final_loss" in done:
            loss = done["final_loss"]
        elif h == args.steps:
            loss = unsynced_loss
        else:
            swept = copy.copy(args)
            swept.sync_every = h
            loss = train(build("diloco", initial, env, swept), swept, env, 0.0)[0][-1]
        predicted = model.bytes_sent_per_rank("diloco", args.steps, shapes, env.world_size,
                                              sync_every=h)
        rows.append({"sync_every": h, "final_loss": loss,
                     "predicted_bytes_sent_per_rank_per_step": float(predicted / args.steps)})
    return rows


def diloco_h1_check(initial, args, env):
    """DiLoCo with one inner SGD step and an outer SGD of rate 1, no momentum, against DDP
    with the same SGD: the largest parameter difference after CHECK_STEPS steps."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)   # noqa: E731
    outer = lambda params: torch.optim.SGD(params, lr=1.0)   # noqa: E731
    diloco = LocalSteps(initial, sgd, layer_fragments(1), lambda step: [0], outer)
    ddp = DDPMethod(initial, env)
    ddp.optimizer = sgd(ddp.model.parameters())
    for trainer in (diloco, ddp):
        train(trainer, args, env, 0.0, min(args.steps, CHECK_STEPS))
    return distenv.max_param_diff(diloco.parameters(), ddp.parameters(), env.device)


def run(args, env):
    torch.manual_seed(args.seed)
    initial = Transformer(SHAPE, device=env.device)
    plain, slowed = fit_link(env, 0.0), fit_link(env, args.slow_ns_per_byte)
    links = {"plain": (0.0, *plain), "slowed": (args.slow_ns_per_byte, *slowed)}
    compute, unsynced_loss = compute_only(initial, args, env)
    reference = None   # DDP on the plain link: the method's own run where it is asked for
    if "ddp" not in args.method:
        reference = build("ddp", initial, env, args)
        train(reference, args, env, 0.0)
    methods = {}
    for name in sorted(args.method, key=lambda m: m != "ddp"):   # DDP first
        done = distenv.try_variant(
            env, name, lambda: run_method(name, initial, args, env, links, compute, reference))
        if isinstance(done, dict):   # {"not_run": reason}
            methods[name] = done
            continue
        result, trainer = done
        methods[name] = result
        if name == "ddp":
            reference = trainer
        if name == "bf16":
            result.update(bf16_gradient_check(initial, args, env))
        env.print0(f"{name:>17}: {result['bytes_sent_per_rank_per_step']:>12,.0f} B/step "
                   f"(predicted {result['predicted_bytes_sent_per_rank_per_step']:,.0f}), "
                   f"loss {result['final_loss']:.4f}, step "
                   f"{result['step_time_s']['plain'] * 1e3:.1f} / "
                   f"{result['step_time_s']['slowed'] * 1e3:.1f} ms plain / slowed "
                   f"(predicted {result['predicted_step_time_s']['plain'] * 1e3:.1f} / "
                   f"{result['predicted_step_time_s']['slowed'] * 1e3:.1f})")
        if "torchft" in result and "not_run" not in result["torchft"]:
            env.print0(f"{'':>17}  torchft's own, {result['torchft']['steps']} steps: max "
                       f"|p - this one's| {result['torchft']['max_param_diff_vs_scratch']:.1e}")
        if "grad_error_vs_ddp" in result:
            error = result["grad_error_vs_ddp"]
            env.print0(f"{'':>17}  gradient vs DDP's: RMS {error['relative_rms']:.2e} of it "
                       f"(predicted {result['predicted_grad_error_bound']['relative_rms']:.2e}),"
                       f" at most {error['max_over_bound']:.2f} of the worst case")
    no_feedback = distenv.try_variant(   # all --steps: its loss beside powersgd's
        env, "powersgd without error feedback",
        lambda: train(build("powersgd", initial, env, args, error_feedback=False),
                      args, env, 0.0)[0][-1])
    checks = {"diloco_h1_max_param_diff_vs_ddp": diloco_h1_check(initial, args, env),
              "powersgd_no_error_feedback_final_loss": no_feedback}
    env.print0(f"DiLoCo, H = 1, SGD inside and outer SGD of rate 1: max |p - DDP| "
               f"{checks['diloco_h1_max_param_diff_vs_ddp']:.1e}; PowerSGD without error "
               f"feedback ends at loss {no_feedback}")
    sweep = h_sweep(initial, args, env, methods, unsynced_loss)
    env.print0("DiLoCo's loss after the same tokens, by H: " + ", ".join(
        f"{row['sync_every']}: {row['final_loss']:.4f}" for row in sweep))
    return {"methods": methods, "checks": checks, "h_sweep": sweep,
            "compute_step_s": compute["step_s"], "compute_step_spread_s": compute["step_spread_s"],
            "compute_forward_s": compute["forward_s"],
            "link": {"alpha_s": plain[0], "beta_bytes_per_s": finite(plain[1]),
                     "slowed_alpha_s": slowed[0], "slowed_beta_bytes_per_s": finite(slowed[1])},
            "shape": dataclasses.asdict(SHAPE), "batch": args.batch,
            "param_count": sum(p.numel() for p in initial.parameters()),
            "steps": args.steps, "sync_every": args.sync_every, "fragments": args.fragments,
            "powersgd_rank": args.powersgd_rank, "inner_lr": INNER_LR, "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MOMENTUM}


def finite(value):
    """A fitted figure for the JSON: null where the fit found none (a world of one sends
    nothing; on NVLink small all-reduces take the same time whatever their size)."""
    return value if math.isfinite(value) else None


def check(args):
    """Refuse in one line what cannot work, before any process group forms."""
    if args.fragments > SHAPE.layers:
        distenv.fail(f"--fragments {args.fragments} is more than the model's {SHAPE.layers} "
                     f"layers: each fragment needs one")
    smallest = min(SHAPE.hidden, SHAPE.vocab, SHAPE.seq)
    if args.powersgd_rank > smallest:
        distenv.fail(f"--powersgd-rank {args.powersgd_rank} is above the smaller side of "
                     f"the model's matrices ({smallest})")
    if args.steps < 2:
        distenv.fail(f"--steps {args.steps}: at least 2 (the first step's time is set-up)")
    if args.sync_every > args.steps:
        distenv.fail(f"--sync-every {args.sync_every} is more than --steps {args.steps}: "
                     f"nothing would ever sync")
    if args.h_sweep is None:   # the default's values that fit in --steps
        args.h_sweep = [h for h in H_SWEEP if h <= args.steps]
    elif max(args.h_sweep) > args.steps:
        distenv.fail(f"--h-sweep {max(args.h_sweep)} is more than --steps {args.steps}: "
                     f"nothing would ever sync")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--method", type=distenv.choice_list(model.METHODS),
                        default=list(model.METHODS),
                        help=f"comma-separated, from {', '.join(model.METHODS)}; or all")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS)
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="sequences per rank per step")
    parser.add_argument("--sync-every", type=distenv.positive_int, default=SYNC_EVERY,
                        help="H: inner steps between syncs (local SGD, DiLoCo)")
    parser.add_argument("--fragments", type=distenv.positive_int, default=FRAGMENTS,
                        help="P: streaming DiLoCo's fragments of the layers")
    parser.add_argument("--powersgd-rank", type=distenv.positive_int, default=POWERSGD_RANK,
                        help="r: PowerSGD's rank")
    parser.add_argument("--slow-ns-per-byte", type=distenv.number_above(0, inclusive=True),
                        default=SLOW_NS_PER_BYTE,
                        help="the slowed link: a wait of this many ns per byte sent")
    parser.add_argument("--h-sweep", type=distenv.int_list(1), default=None,
                        metavar="H[,H...]",
                        help=f"DiLoCo's H values for its loss after the same tokens (default: "
                             f"those of {','.join(map(str, H_SWEEP))} up to --steps)")
    args = parser.parse_args(argv)
    check(args)
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        env.print0(f"talking less: {env.world_size} ranks ({env.backend}), {args.steps} steps,"
                   f" H = {args.sync_every}, P = {args.fragments}, r = {args.powersgd_rank}")
        env.write_result(args, run(args, env))


if __name__ == "__main__":
    main()

"""Memory on the fullest GPU of a layout: each stage's model states, sharded by the ZeRO
stage over the ranks that hold them, its activations for the micro-batches its schedule
keeps in flight, and the last stage's logits (memory_model's accounting)."""

import functools

from .. import memory_model
from .layout import chunk_split, expert_replicas, rank_layers
from .settings import ALL_TO_ALL_RESERVE_GB, RUNTIME_RESERVE_GB, VALUE_BYTES
from .shapes import largest_layer_params, rank_params


@functools.lru_cache(maxsize=65536)
def state_bytes(params, replicas, zero, states):
    """memory_model.state_bytes_per_gpu, kept: middle ranks often hold as many parameters.
    Read it, never change it."""
    return memory_model.state_bytes_per_gpu(params, replicas, zero, precision=states)


@functools.lru_cache(maxsize=65536)
def stage_activation_values(model, first_layer, layers, tp, flash, fp8_activations=False,
                            etp=None, sequence_parallel=True):
    """(sum, largest) of layer_activation_values over a stage's layers."""
    values = [model.layer_activation_values(i, tp, sequence_parallel, flash, fp8_activations,
                                            etp)
              for i in range(first_layer, first_layer + layers)]
    return sum(values), max(values, default=0)


@functools.lru_cache(maxsize=65536)
def stage_footprints(model, cut, tp, ep, replicas, zero, recompute, flash,
                     fp8_activations=False, states="mixed", chunks=1, etp=None,
                     sequence_parallel=True):
    """Per pipeline stage, what one rank holds whatever the micro-batches: (its model
    states {params, grads, optimizer, total} in mixed-precision Adam, the dense weights
    over `replicas` ranks and each expert's over replicas x tp / (ep x etp), the experts'
    own data parallelism (etp None: tp); the activation values per
    token it keeps for a micro-batch in flight; those of the one layer that full
    recomputation rebuilds at a time), the ranks holding `cut`'s chunks (chunk_split).
    Many layouts share these, so they are kept."""
    footprints = []
    ranks = rank_layers(model, cut, chunks)
    for stage, chunk_spans in ranks:
        first, last = stage == 0, stage == len(ranks) - 1
        count = sum(layers for _, layers in chunk_spans)
        dense, experts = rank_params(model, chunk_spans, tp, ep, first, last, False, etp)
        held = state_bytes(dense, replicas, zero, states)
        if experts:
            e = state_bytes(experts, expert_replicas(replicas, tp, ep, etp), zero, states)
            held = {k: held[k] + e[k] for k in held}
        if zero == "zero3":
            # the layer that runs is gathered whole, its 16-bit weights and its 16-bit
            # gradients before they are reduce-scattered: 4 bytes a parameter of the largest
            # transformer layer, the rate DeepSpeed's stage-3 estimate charges for its
            # largest module (memory_model.zero_offload_gpu_bytes), a lower bound for FSDP,
            # which also prefetches the next layer; of a MoE layer, its dense part and the
            # experts of this rank's ep share
            largest = largest_layer_params(model, chunk_spans, tp, ep, etp)
            whole = {"params": held["params"] + VALUE_BYTES * largest,
                     "grads": held["grads"] + VALUE_BYTES * largest}
            held = {**held, **whole, "total": held["total"] + 2 * VALUE_BYTES * largest}
        if recompute == "full":     # each layer's input, and one layer rebuilt at a time
            kept = count * model.hidden / (tp if sequence_parallel else 1)
            rebuilt = max(stage_activation_values(model, start, layers, tp, flash,
                                                  fp8_activations, etp, sequence_parallel)[1]
                          for start, layers in chunk_spans)
        else:   # selective recomputation rebuilds attention's s x s part: none kept
            kept = sum(stage_activation_values(model, start, layers, tp,
                                               flash or recompute != "none",
                                               fp8_activations, etp, sequence_parallel)[0]
                       for start, layers in chunk_spans)
            rebuilt = 0
        footprints.append((held, kept, rebuilt))
    return tuple(footprints)


@functools.lru_cache(maxsize=4096)
def _peak_microbatches(pp, m, v, zero_bubble):
    """Per stage, the micro-batches in flight at its peak (memory_model's count), kept: a
    search asks for the same schedules over and over."""
    if zero_bubble:
        # ZB-H1's order, walked: a micro-batch past its I but not its W still counts whole,
        # though it keeps only what W reads (an upper bound; Qi et al. 2024, Table 1)
        return tuple(memory_model.zero_bubble_peak_microbatches("zb1p", pp, m, v))
    schedule = "interleaved" if v > 1 else "1f1b"
    return tuple(memory_model.pipeline_peak_microbatches(schedule, pp, m, v))


def memory(model, layout, settings, hw):
    """{params, grads, optimizer, states, activations, logits, total, stage, reserve,
    usable} bytes on the fullest GPU of `layout` (total: its tensors; usable: the nominal
    memory less the runtime's reserve, with_reserve) (dp, tp, pp, cp, ep, v, micro_batch, microbatches, zero,
    recompute; dualpipe). With dualpipe = 1, DualPipe (DeepSeek-V3 §3.2.1): rank r holds
    stages r and pp - 1 - r, two copies of the parameters (the report's Table 2), each with
    its own weights and gradients; a stage's two copies are one parameter set with twice
    the replicas (DualPipe's example sums their gradients), so ZeRO shards over 2 dp cp
    ranks, as memory_model.moe_bytes_per_gpu(param_copies=2) does. The micro-batches are
    memory_model.dualpipe_peak_microbatches'; "stage" is then the rank and "stages" its two
    stages."""
    tp, pp, cp, ep, v = (layout[k] for k in ("tp", "pp", "cp", "ep", "chunks"))
    b, m, zero, recompute = (layout[k] for k in ("micro_batch", "microbatches", "zero",
                                                  "recompute"))
    replicas = layout["dp"] * cp                 # ranks holding the same dense weights
    if layout.get("dualpipe"):                   # and as many again on rank pp - 1 - r
        replicas *= 2
    in_flight = _peak_microbatches(pp, m, v, bool(layout.get("zb")))
    tokens = model.seq // cp * b                  # of one micro-batch, on this rank
    cut = chunk_split(model, pp, v, settings.flash_attention)
    footprints = stage_footprints(model, cut, tp, ep, replicas, zero, recompute,
                                  settings.flash_attention, settings.fp8_activations,
                                  settings.states, v, layout.get("etp", tp),
                                  settings.sequence_parallel)
    # the last stage's head: the final norm's input and output (split by sequence
    # parallelism) and the logits' softmax in fp32, split over the vocabulary, for the
    # micro-batch whose backward comes next (memory_model.stage_activation_bytes)
    norm_split = tp if settings.sequence_parallel else 1
    head_bytes = (VALUE_BYTES * 2 * model.hidden / norm_split + 4 * model.vocab / tp) * tokens
    if not layout.get("dualpipe"):
        # one stage per rank, micro-batches (1F1B) or chunk-micro-batches of 1/v of the
        # layers in flight: the loop below, written out, as the planner runs it most
        worst_total, worst_stage = None, None
        for stage, (states, kept_values, rebuilt_values) in enumerate(footprints):
            head = head_bytes if stage == pp - 1 else 0
            kept = VALUE_BYTES * tokens * in_flight[stage] / v * kept_values
            if recompute == "full":
                activations = kept + max(VALUE_BYTES * tokens * rebuilt_values, head)
            else:
                activations = kept + head
            if worst_total is None or states["total"] + activations > worst_total:
                worst_total = states["total"] + activations
                worst_stage = (stage, states, activations, head)
        stage, states, activations, head = worst_stage
        return with_reserve({"params": states["params"], "grads": states["grads"],
                             "optimizer": states["optimizer"], "states": states["total"],
                             "activations": activations, "logits": head,
                             "total": worst_total, "stage": stage}, model, layout, hw)
    holdings = memory_model.dualpipe_peak_microbatches(pp, m)   # [(stage, held)] per rank
    worst = None
    for rank, held_stages in enumerate(holdings):
        states = footprints[held_stages[0][0]][0]
        for stage, _ in held_stages[1:]:
            states = {k: states[k] + footprints[stage][0][k] for k in states}
        kept = sum(VALUE_BYTES * tokens * held * footprints[stage][1]
                   for stage, held in held_stages)
        rebuilt = max(footprints[stage][2] for stage, _ in held_stages)
        last = any(stage == pp - 1 for stage, _ in held_stages)
        head = head_bytes if last else 0
        if recompute == "full":   # backward starts at the head, then rebuilds layer by layer
            activations = kept + max(VALUE_BYTES * tokens * rebuilt, head)
        else:
            activations = kept + head
        total = states["total"] + activations
        if worst is None or total > worst["total"]:
            worst = {"params": states["params"], "grads": states["grads"],
                     "optimizer": states["optimizer"], "states": states["total"],
                     "activations": activations, "logits": head, "total": total,
                     "stage": rank}
            worst["stages"] = tuple(stage for stage, _ in held_stages)
    return with_reserve(worst, model, layout, hw)


def reserve_bytes(model, layout):
    """What the CUDA context and NCCL's buffers take on a GPU (settings.RUNTIME_RESERVE_GB),
    the all-to-all's buffers too where a mixture of experts dispatches over ep > 1 ranks."""
    all_to_all = model.experts and layout.get("ep", 1) > 1
    return (RUNTIME_RESERVE_GB + (ALL_TO_ALL_RESERVE_GB if all_to_all else 0.0)) * 1e9


def with_reserve(held, model, layout, hw):
    """`held` with "reserve" (reserve_bytes) and "usable": the nominal memory less it, what
    the tensors ("total") must fit in."""
    reserve = reserve_bytes(model, layout)
    return {**held, "reserve": reserve, "usable": hw.gpu_memory_gb * 1e9 - reserve}

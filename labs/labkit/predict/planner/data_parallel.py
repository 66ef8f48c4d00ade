"""Data parallelism's collectives in a step (comm_model.data_parallel_step_collectives) over
the ranks that hold the same weights, the experts' over their own replicas, and what of
them the computation cannot hide; and, for an output head tied to the embedding over
several pipeline stages, the all-reduce of the embedding's gradient between the first and
the last stage."""

import functools
from collections import Counter

from .. import comm_model, precision_model
from .collectives import group_time, priced_counts
from .layout import expert_replicas, members_per_node, rank_layers
from .settings import GRAD_REDUCE_BYTES, VALUE_BYTES
from .shapes import rank_params

_GATHERS = ("all_gather",)


@functools.lru_cache(maxsize=65536)
def data_parallel_time(zero, params, microbatches, units, size, per_node, hw,
                       gather_bytes=VALUE_BYTES, reduce_bytes=VALUE_BYTES):
    """Seconds of a step's data-parallel collectives (comm_model.
    data_parallel_step_collectives) over `size` replicas, `per_node` of them per node, the
    parameters gathered at `gather_bytes` per element, the gradients reduced at
    `reduce_bytes`."""
    return sum(data_parallel_parts(zero, params, microbatches, units, size, per_node, hw,
                                   gather_bytes, reduce_bytes))


@functools.lru_cache(maxsize=65536)
def data_parallel_parts(zero, params, microbatches, units, size, per_node, hw,
                        gather_bytes=VALUE_BYTES, reduce_bytes=VALUE_BYTES):
    """data_parallel_time in two parts: (the gradients' reductions, the parameters'
    all-gathers), which different computation can hide."""
    counted = Counter(comm_model.data_parallel_step_collectives(zero, params, microbatches,
                                                                units))
    return tuple(priced_counts({c: n for c, n in counted.items()
                                if (c[0] in _GATHERS) == gathers},
                               size, per_node, hw, gather_bytes, reduce_bytes)
                 for gathers in (False, True))


@functools.lru_cache(maxsize=65536)
def slowest_data_parallel_time(model, cut, tp, ep, zero, microbatches, replicas, precision,
                               hw, reduce_bytes, chunks=1, etp=None, dualpipe=False):
    """The longest of the ranks' data-parallel times (stage_data_parallel_time): the
    pipeline moves at its slowest stage. Under DualPipe a rank holds stages r and
    pp - 1 - r, each over twice the replicas (as memory() counts them), and reduces both."""
    return max(sum(parts) for parts in rank_data_parallel_parts(
        model, cut, tp, ep, zero, microbatches, replicas, precision, hw, reduce_bytes, chunks,
        etp, dualpipe))


@functools.lru_cache(maxsize=65536)
def rank_data_parallel_parts(model, cut, tp, ep, zero, microbatches, replicas, precision, hw,
                             reduce_bytes, chunks=1, etp=None, dualpipe=False):
    """[(reductions, all-gathers) seconds of each pipeline rank] (stage_data_parallel_time)."""
    ranks = rank_layers(model, cut, chunks)
    copies = 2 if dualpipe else 1
    per_stage = [stage_data_parallel_time(model, chunk_spans, stage == 0,
                                          stage == len(ranks) - 1, tp, ep, zero, microbatches,
                                          copies * replicas, precision, hw, reduce_bytes, etp)
                 for stage, chunk_spans in ranks]
    if dualpipe:
        return tuple((r + per_stage[-1 - i][0], g + per_stage[-1 - i][1])
                     for i, (r, g) in enumerate(per_stage))
    return tuple(per_stage)


@functools.lru_cache(maxsize=65536)
def stage_data_parallel_time(model, spans, first, last, tp, ep, zero, microbatches,
                             replicas, precision, hw, reduce_bytes=GRAD_REDUCE_BYTES["fp32"],
                             etp=None):
    """(reductions, all-gathers) seconds of one rank's data-parallel collectives in a step,
    its chunks holding the layers of `spans` ((first layer, layers), ...): its dense
    parameters over the dp x cp replicas (tp apart), its experts' over their own data
    parallelism (expert_replicas, etp x ep apart), the parameters gathered in the recipe's
    bytes (FP8 for the linear weights under fp8), the gradients reduced in `reduce_bytes`."""
    etp = etp or tp
    dense, experts = rank_params(model, spans, tp, ep, first, last, False, etp)
    matrices = rank_params(model, spans, tp, ep, first, last, True, etp)
    count = sum(layers for _, layers in spans)
    reductions = gathers = 0.0
    for params, fp8_params, size, inner in (
            (dense, matrices[0], replicas, tp),
            (experts, matrices[1], expert_replicas(replicas, tp, ep, etp), etp * ep)):
        if params and size > 1:
            per_node = members_per_node(inner, size, hw)
            gather = precision_model.gather_bytes_per_value(precision, fp8_params / params)
            reduced, gathered = data_parallel_parts(zero, params, microbatches, count, size,
                                                    per_node, hw, gather, reduce_bytes)
            reductions, gathers = reductions + reduced, gathers + gathered
    return reductions, gathers


def tied_embedding_seconds(model, tp, pp, same_node, hw, reduce_bytes):
    """Seconds of the all-reduce that sums a tied embedding's gradient between the first
    stage, which holds the embedding, and the last, which keeps a copy of it for the head
    (Megatron-LM's embedding group, after the data-parallel reductions): V h / tp values of
    each tensor-parallel rank, over two ranks, `same_node` or across the network."""
    if not model.tied or pp == 1:
        return 0.0
    return group_time("all_reduce", reduce_bytes * model.vocab * model.hidden / tp, 2,
                      2 if same_node else 1, hw)


def data_parallel_exposed_seconds(model, cut, tp, ep, zero, microbatches, replicas, settings,
                                  hw, chunks, etp, dualpipe, forward, backward, work):
    """The step's data-parallel term: each stage's collectives over the dp x cp `replicas`
    (experts over expert_replicas), hierarchical, less what they hide behind, the slowest
    stage's. The gradients' reductions hide behind the last micro-batch's backward (DDP,
    ZeRO-1: the gradients are whole until then), every backward (ZeRO-2, which reduces
    each micro-batch's); the parameters' all-gather after the optimizer's step (ZeRO-1,
    ZeRO-2) only behind the next step's first forward, which needs them layer by layer
    (Megatron-Core's --overlap-param-gather); ZeRO-3's gathers and reductions, a layer at a
    time, behind all of the `work`. `forward` and `backward` are a step's."""
    reduce_bytes = GRAD_REDUCE_BYTES[settings.grad_reduce]
    parts = rank_data_parallel_parts(model, cut, tp, ep, zero, microbatches, replicas,
                                     settings.precision, hw, reduce_bytes, chunks, etp,
                                     dualpipe)
    if zero == "zero3":
        return max(max(0.0, reduced + gathered - work) for reduced, gathered in parts)
    reduce_window = backward if zero == "zero2" else backward / microbatches
    gather_window = forward / microbatches
    return max(max(0.0, reduced - reduce_window) + max(0.0, gathered - gather_window)
               for reduced, gathered in parts)

"""Data parallelism's collectives in a step (comm_model.data_parallel_step_collectives) over
the ranks that hold the same weights, the experts' over their own replicas, and what of
them the backward cannot hide."""

import functools

from .. import comm_model, precision_model
from .collectives import priced
from .layout import expert_replicas, members_per_node, rank_layers
from .settings import VALUE_BYTES
from .shapes import rank_params


@functools.lru_cache(maxsize=65536)
def data_parallel_time(zero, params, microbatches, units, size, per_node, hw,
                       gather_bytes=VALUE_BYTES, reduce_bytes=VALUE_BYTES):
    """Seconds of a step's data-parallel collectives (comm_model.
    data_parallel_step_collectives) over `size` replicas, `per_node` of them per node, the
    parameters gathered at `gather_bytes` per element, the gradients reduced at
    `reduce_bytes`."""
    return priced(comm_model.data_parallel_step_collectives(zero, params, microbatches,
                                                            units), size, per_node, hw,
                  gather_bytes, reduce_bytes)


@functools.lru_cache(maxsize=65536)
def slowest_data_parallel_time(model, cut, tp, ep, zero, microbatches, replicas, precision,
                               hw, states, chunks=1, etp=None, dualpipe=False):
    """The longest of the ranks' data-parallel times (stage_data_parallel_time): the
    pipeline moves at its slowest stage. Under DualPipe a rank holds stages r and
    pp - 1 - r, each over twice the replicas (as memory() counts them), and reduces both."""
    ranks = rank_layers(model, cut, chunks)
    copies = 2 if dualpipe else 1
    per_stage = [stage_data_parallel_time(model, chunk_spans, stage == 0,
                                          stage == len(ranks) - 1, tp, ep, zero, microbatches,
                                          copies * replicas, precision, hw, states, etp)
                 for stage, chunk_spans in ranks]
    if dualpipe:
        return max(t + per_stage[-1 - r] for r, t in enumerate(per_stage))
    return max(per_stage)


@functools.lru_cache(maxsize=65536)
def stage_data_parallel_time(model, spans, first, last, tp, ep, zero, microbatches,
                             replicas, precision, hw, states="mixed", etp=None):
    """Seconds of one rank's data-parallel collectives in a step, its chunks holding the
    layers of `spans` ((first layer, layers), ...): its dense parameters over the dp x cp
    replicas (tp apart), its experts' over their own data parallelism (expert_replicas,
    etp x ep apart), the parameters gathered in the recipe's bytes (FP8 for the linear
    weights under fp8)."""
    etp = etp or tp
    dense, experts = rank_params(model, spans, tp, ep, first, last, False, etp)
    matrices = rank_params(model, spans, tp, ep, first, last, True, etp)
    count = sum(layers for _, layers in spans)
    total = 0.0
    for params, fp8_params, size, inner in (
            (dense, matrices[0], replicas, tp),
            (experts, matrices[1], expert_replicas(replicas, tp, ep, etp), etp * ep)):
        if params and size > 1:
            per_node = members_per_node(inner, size, hw)
            gather = precision_model.gather_bytes_per_value(precision, fp8_params / params)
            total += data_parallel_time(zero, params, microbatches, count, size, per_node, hw,
                                        gather, precision_model.RECIPES[states].reduce)
    return total


def data_parallel_exposed_seconds(model, cut, tp, ep, zero, microbatches, replicas, settings,
                                  hw, chunks, etp, dualpipe, forward, work):
    """The step's data-parallel term: the slowest stage's collectives over the dp x cp
    `replicas` (experts over expert_replicas), hierarchical, less what they hide behind:
    the last micro-batch's backward (DDP, ZeRO-1), every backward (ZeRO-2) or all of the
    `work` (ZeRO-3); `forward` is a step's forward compute."""
    seconds = slowest_data_parallel_time(model, cut, tp, ep, zero, microbatches, replicas,
                                         settings.precision, hw, settings.states, chunks, etp,
                                         dualpipe)
    backward = 2 * forward
    window = {"ddp": backward / microbatches, "zero1": backward / microbatches,
              "zero2": backward, "zero3": work}[zero]
    return max(0.0, seconds - window)

"""Where the work sits: the layers cut into pipeline stages and their chunks (chunk_split,
stage_split), what each rank holds of them, the FLOPs of each stage, how a group's ranks
fall on nodes, and a layout read from text (parse_layout)."""

import functools
import itertools
import math

from .. import memory_model
from .shapes import layer_kinds


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def moe_count(model, spans):
    """The mixture-of-experts layers of `spans`, layer_kinds' (a layer of the kind, how
    many) pairs."""
    return sum(count for index, count in spans
               if model.experts and index >= model.dense_layers)


@functools.lru_cache(maxsize=4096)
def rank_layers(model, cut, chunks=1):
    """[(rank, its layers as layer_kinds gives them)] of a cut of pp x chunks virtual
    stages: what each rank holds, not where, so that ranks alike share the caches of what
    is priced from them."""
    return [(rank, tuple(layer_kinds(model, spans))) for rank, spans in stage_spans(cut, chunks)]


@functools.lru_cache(maxsize=4096)
def most_moe_layers(model, cut, chunks=1):
    """The MoE layers of the rank that holds most of them."""
    return max(moe_count(model, spans) for _, spans in rank_layers(model, cut, chunks))


def expert_replicas(replicas, tp, ep, etp=None):
    """The ranks holding the same expert weights, the experts' data parallelism, of
    `replicas` ranks holding the same dense weights: Megatron-Core lays the experts' etp x
    ep x edp over the same tp x cp x dp ranks (memory_model.expert_data_parallel_size of a
    stage's ranks), so edp = tp x cp x dp / (ep x etp)."""
    return memory_model.expert_data_parallel_size(replicas * tp, 1, ep, etp or tp)


def members_per_node(inner, size, hw):
    """Ranks of a group of `size` (its members `inner` ranks apart) on one node: as many
    as the node holds, in whole shares of the group."""
    return math.gcd(size, hw.gpus_per_node // inner) if inner < hw.gpus_per_node else 1


@functools.lru_cache(maxsize=4096)
def layer_flops(model, flash=True):
    """(FLOPs per token of a dense layer, of a mixture-of-experts layer): 6 x its active
    parameters (its top_k routed experts and the shared ones) and attention's products as a
    kernel runs them."""
    attention = model.attention_flops_executed_per_token(flash) / model.layers

    def flops(layer):
        moe = model.experts and layer >= model.dense_layers
        unused = (model.experts - model.top_k) * sum(model.mlp(model.expert_hidden)) \
            if moe else 0
        return 6 * (sum(model.layer_params(layer)) - unused) + attention

    # layer 0 is dense where the model has a dense layer at all; layer dense_layers, the
    # first MoE layer where it has experts
    return flops(0), flops(model.dense_layers)


@functools.lru_cache(maxsize=65536)
def chunk_flops(model, cut, flash=True):
    """(FLOPs per token of each virtual stage (chunk) holding `cut`'s layers, in order): each
    layer 6 x its active parameters and attention's products as a kernel runs them
    (Model.attention_flops_executed_per_token), the head's 6 V h on the last. The input
    embedding is a lookup: no FLOPs, tied to the head or not."""
    dense, moe = layer_flops(model, flash)
    chunks, start = [], 0
    for count in cut:   # a layer's FLOPs depend on its kind alone
        moe_count = max(0, start + count - max(start, model.dense_layers)) \
            if model.experts else 0
        chunks.append((count - moe_count) * dense + moe_count * moe)
        start += count
    chunks[-1] += 6 * model.vocab * model.hidden   # the logits' product, tied weights or not
    return tuple(chunks)


def stage_flops(model, cut, flash=True, chunks=1):
    """[FLOPs per token of each pipeline rank]: the sum of its chunks' (chunk_flops); `cut`
    holds the layers of each of pp x chunks virtual stages, virtual stage j on rank j mod
    pp, as Megatron-LM and torch's interleaved schedules place them."""
    pp = len(cut) // chunks
    per_chunk = chunk_flops(model, cut, flash)
    return [sum(per_chunk[rank::pp]) for rank in range(pp)]


# Layers an end stage may give up to the others (Llama 3 took one off each end; Megatron-LM
# sets the end stages' counts with --decoder-first/last-pipeline-num-layers)
MAX_END_TRIM = 2


def rank_chunks(totals, chunks, size):
    """The layers of each of pp x chunks virtual stages, in order (virtual stage j on rank
    j mod pp), from each rank's total: a middle rank's as even as they go (the later chunks
    one more), an end rank's in chunks of `size`, the end chunk (the embedding's on the
    first rank, the head's on the last) keeping what is left, none or more; None where a
    chunk other than an end one would be empty."""
    pp = len(totals)
    per_rank = []
    for rank, total in enumerate(totals):
        end = chunks > 1 and rank in (0, pp - 1)
        if chunks == 1:
            own = [total]
        elif end and 0 <= total - (chunks - 1) * size <= size:
            own = [total - (chunks - 1) * size] + [size] * (chunks - 1)
        elif total >= chunks:
            own = memory_model.stage_layers(total, chunks)
        elif end and total == chunks - 1:   # the end chunk with none, the others one each
            own = [0] + [1] * (chunks - 1)
        else:
            return None
        if end and rank == pp - 1:
            own.reverse()              # the head's chunk, the smallest, last
        per_rank.append(own)
    return tuple(per_rank[j % pp][j // pp] for j in range(pp * chunks))


@functools.lru_cache(maxsize=4096)
def chunk_split(model, pp, chunks=1, flash=True):
    """The layers of each of the pp x chunks virtual stages (virtual stage j on rank j mod
    pp; one per rank without interleaving), as the planner cuts them, or None where no cut
    can run. From the even cut of the ranks (memory_model.stage_layers), up to MAX_END_TRIM
    layers come off the first and the last rank and spread over the others, as Llama 3
    balanced its pipeline (Dubey et al., 2024, section 3.3.2): the last stage also runs the
    head, and the first holds the most micro-batches in flight. Each rank's layers then go
    to its chunks (rank_chunks), in chunks of L / (pp v) layers rounded up on the end
    ranks, whose end chunk takes what is left, down to no layer at all, only the embedding
    or the head: Llama 3's 126 layers over 16 stages of 8 chunks (§3.3.2), or
    Megatron-Bridge's DeepSeek-V3 layout on H100s (one layer in the first of 32 virtual
    stages, two in each of the next 30, none in the last). The cut whose slowest rank has
    the fewest FLOPs wins; of cuts as fast, the one that takes most off the first rank,
    then least off the last."""
    layers = model.layers
    if layers < pp or pp * chunks > most_virtual_stages(model, chunks):
        return None
    even = memory_model.stage_layers(layers, pp)
    size = -(-layers // (pp * chunks))
    best = None
    for first_trim in range(MAX_END_TRIM + 1):
        for last_trim in range(MAX_END_TRIM + 1):
            first, last = even[0] - first_trim, even[-1] - last_trim
            if pp == 1:
                if first_trim or last_trim:
                    continue
                totals = (layers,)
            elif pp == 2:
                if first_trim:      # two stages: what the last gives up, the first takes
                    continue
                totals = (layers - last, last)
            else:
                rest = layers - first - last
                if first < 0 or last < 0 or rest < pp - 2:
                    continue
                totals = (first, *memory_model.stage_layers(rest, pp - 2), last)
            cut = rank_chunks(totals, chunks, size)
            if cut is None or (chunks == 1 and min(cut) < 1):
                continue
            key = (max(stage_flops(model, cut, flash, chunks)), -first_trim, last_trim)
            if best is None or key < best[0]:
                best = (key, cut)
    return None if best is None else best[1]


def most_virtual_stages(model, chunks):
    """The most virtual stages a cut can have: a layer each, and interleaved, an end chunk
    at either end with none (chunk_split)."""
    return model.layers + (2 if chunks > 1 else 0)


@functools.lru_cache(maxsize=4096)
def stage_split(model, pp, chunks=1, flash=True):
    """The layers each of the pp ranks holds (the sum of its chunks, chunk_split), or None
    where no cut can run."""
    cut = chunk_split(model, pp, chunks, flash)
    return None if cut is None else tuple(sum(cut[rank::pp]) for rank in range(pp))


@functools.lru_cache(maxsize=4096)
def stage_imbalance(model, cut, flash=True, chunks=1):
    """The slowest pipeline rank's FLOPs over the mean rank's (stage_flops)."""
    if len(cut) == chunks:
        return 1.0
    stages = stage_flops(model, cut, flash, chunks)
    return max(stages) * len(stages) / sum(stages)


@functools.lru_cache(maxsize=4096)
def stage_spans(cut, chunks=1):
    """[(rank, ((first layer, layers) of each of its chunks))] of a cut of pp x chunks
    virtual stages."""
    pp = len(cut) // chunks
    starts = (0, *itertools.accumulate(cut))
    return [(rank, tuple((starts[j], cut[j]) for j in range(rank, len(cut), pp)))
            for rank in range(pp)]


def parse_layout(text):
    """'tp=8,pp=16,dp=128[,cp=..,ep=..,etp=..,v=..,dualpipe=1|zb=1]' -> {dp, tp, pp, cp,
    ep, etp[, chunks, dualpipe, zb]}; etp is tp where not given (Megatron-Core's default).
    zb=1: ZB-H1 over the v chunks (torch's ScheduleInterleavedZeroBubble)."""
    names = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "etp": "etp",
             "v": "chunks", "dualpipe": "dualpipe", "zb": "zb"}
    layout = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in names or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"not a layout: {text!r} "
                             f"(tp=8,pp=16,dp=128[,cp=2,ep=8,etp=1,v=2,dualpipe=1|zb=1], "
                             f"each a positive whole number)")
        layout[names[key]] = int(value)
    missing = {"dp", "tp", "pp"} - set(layout)
    if missing:
        raise ValueError(f"the layout {text!r} needs {', '.join(sorted(missing))}")
    return {"cp": 1, "ep": 1, "etp": layout["tp"], **layout}


@functools.lru_cache(maxsize=4096)
def interleavings(model, pp, flash=True):
    """The chunks per rank v the search tries with pp stages: 1, and with pp > 1 every v
    whose pp x v chunks can hold the layers evenly but for the two end chunks: the layers
    a multiple of pp x v, as Megatron-LM's interleaved schedule asks, or up to
    MAX_END_TRIM layers fewer at each end (its first and last stages' own layer counts),
    the end chunks down to none: Llama 3's 126 layers in 16 x 8 chunks, Megatron-Bridge's
    DeepSeek-V3 61 in 8 x 4. chunk_split then cuts them."""
    options = [1]
    if pp == 1:
        return options
    for v in range(2, most_virtual_stages(model, 2) // pp + 1):
        size = -(-model.layers // (pp * v))            # the chunks' layers, rounded up
        short = pp * v * size - model.layers            # what the end chunks give up
        if short <= min(2 * MAX_END_TRIM, 2 * size) and chunk_split(model, pp, v, flash):
            options.append(v)
    return options

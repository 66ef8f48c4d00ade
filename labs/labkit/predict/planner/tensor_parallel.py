"""Tensor parallelism's collectives in a step: Megatron-LM's ten a layer with sequence
parallelism (comm_model.tensor_parallel_collectives), a stated fraction of them hidden, or
each beside a linear layer's product (Transformer Engine's comm-GEMM overlap; torch's eight,
six of them fused under asynchronous tensor parallelism)."""

import functools

from .. import comm_model, precision_model, time_model
from .collectives import priced
from .layout import moe_count, rank_layers
from .settings import VALUE_BYTES


@functools.lru_cache(maxsize=65536)
def tensor_parallel_time(layers, seq, batch, hidden, tp, embedding, microbatches, recompute,
                         hw, fp8=False, moe_layers=0, head=True, sequence_parallel=True):
    """Seconds of one rank's tensor-parallel collectives in a step
    (comm_model.tensor_parallel_collectives: the embedding's where the rank holds it, the
    head's and the loss's where it holds them), each at its ring time on NVLink; with
    sequence parallelism all-gathers and reduce-scatters, without it (as Megatron-LM ran in
    2021) all-reduces. With `fp8` the layers' all-gathers carry one byte a value:
    Transformer Engine casts a linear layer's input, and its output's gradient, to FP8
    before gathering them. Of `layers`, `moe_layers` issue only their attention's half
    (the MLP's half has the same sizes): mixture-of-experts layers without a shared
    expert, whose routed experts' tokens move by the dispatcher's collectives instead
    (dispatch_collective_time)."""
    layer_part, outside, once = tensor_parallel_plan(layers, seq, batch, hidden, tp,
                                                     embedding, recompute, head,
                                                     sequence_parallel)
    gather = 1 if fp8 else VALUE_BYTES
    in_layers = priced(layer_part, tp, tp, hw, gather_bytes=gather) \
        * (1 - moe_layers / layers / 2)
    return (microbatches * (in_layers + priced(outside, tp, tp, hw)) + priced(once, tp, tp, hw))


def tensor_parallel_plan(layers, seq, batch, hidden, tp, embedding, recompute, head=True,
                         sequence_parallel=True):
    """comm_model.tensor_parallel_collectives of one micro-batch in three parts: the
    layers' (with sequence parallelism 10 a layer, 14 recomputing; without, 4 all-reduces,
    6), the embedding's, the head's and the loss's where the rank holds them (every
    micro-batch issues them), and, with sequence parallelism, the replicated gradients'
    all-reduce (once per step)."""
    plan = comm_model.tensor_parallel_collectives(
        layers, seq, batch, hidden, tp, sequence_parallel=sequence_parallel,
        embedding=embedding, head=head, microbatches=1, recompute=recompute)
    per_layer = (14 if recompute else 10) if sequence_parallel else (6 if recompute else 4)
    in_layers = layers * per_layer
    if not sequence_parallel:   # no replicated gradients to reduce
        return plan[:in_layers], plan[in_layers:], []
    return plan[:in_layers], plan[in_layers:-1], plan[-1:]


@functools.lru_cache(maxsize=65536)
def tensor_parallel_overlapped_time(model, spans, seq, batch, tp, embedding,
                                    microbatches, recompute, hw, rate, fp8, style="te",
                                    fused=True, head=True):
    """Seconds of one rank's tensor-parallel collectives in a step when each of a layer's
    sequence-parallel all-gathers and reduce-scatters runs beside a linear layer's product,
    approximated as: only what outlasts that product is exposed.

    style "te": as Transformer Engine's comm-GEMM overlap runs them (Megatron-LM's
    --tp-comm-overlap, NeMo's ub_tp_comm_overlap), ten a layer. Its three methods, per
    layer and micro-batch:
      ring_exchange  the all-gathers before QKV and the MLP's first matrix, and of the
                     gradient before the output projection's and the second matrix's
                     input-gradient products (dgrad): chunks passed between peers while
                     the product runs on the chunks already there;
      pipeline       the reduce-scatters after the output projection and the second
                     matrix: the product cut into chunks, each reduce-scattered as it is
                     produced;
      bulk           for QKV and the first matrix in backward, the input gathered again
                     (for the weight gradient) whole, beside the dgrad product, and the
                     dgrad's reduce-scatter whole, beside the weight-gradient product
                     (wgrad, as many FLOPs as the forward).
    The products run at `rate` FLOP/s, the linear layers'
    precision_model.FP8_MATMUL_RATIO times faster where `fp8`; an FP8 run also moves its
    all-gathers and the pipelined reduce-scatters in one byte a value (Transformer
    Engine's FP8 communication buffers; NeMo's FP8 overlap configuration sets fp8_buf for
    the reduce-scatters), the bulk reduce-scatters in two. Not charged: the SMs the
    transfers take from the products (the pipelined and bulk methods run on some), the
    last chunk of each pipelined reduce-scatter, which nothing hides, and what cutting a
    product into chunks costs it.

    style "torch": torch's tensor parallelism (DTensor's sequence parallelism, as
    torchtitan applies it), which keeps the gathered inputs for the weights' gradients, so
    a layer issues eight: forward, the all-gathers before QKV and the MLP's first matrix
    and the reduce-scatters after the output projection and the second matrix; backward,
    the gradient's all-gathers before the output projection's and the second matrix's
    dgrad and the reduce-scatters after QKV's and the first matrix's dgrad. Under FP8
    (torchao's float8 with its tensor-parallel styles) the all-gathers carry FP8, the
    inputs forward and the gradients backward; the reduce-scatters stay bf16. fused=False:
    plain tensor parallelism, all eight exposed. fused=True: asynchronous tensor
    parallelism (torchtitan's enable_async_tensor_parallel): torch.compile's micro-pipeline
    pass fuses each all-gather with the product that consumes it and each reduce-scatter
    with the product that feeds it, the fused kernels moving the shards by copy engine
    while the product works on those already there; the two backward reduce-scatters
    stay whole, since what they reduce is the sum of several products (QKV's three, the
    gate's and up's), which the pass cannot fuse. Not charged: what cutting a product into
    tp pieces costs it, the partial results' reduction on the SMs, and the local copy and
    barrier that start each fused kernel.

    Full recomputation repeats the forward's four in either style. In a mixture-of-experts
    layer the MLP's collectives are its shared experts' (a tensor-parallel MLP, as in
    Megatron-Core), beside their products; with no shared expert it issues none. The
    routed experts' tokens move by the dispatcher's collectives (dispatch_collective_time),
    priced with expert parallelism. The embedding's, the head's and the loss's collectives
    and the replicated gradients' all-reduce stay exposed, at their plain times."""
    speed = precision_model.FP8_MATMUL_RATIO if fp8 else 1.0
    values = seq * batch * model.hidden

    def transfer(value_bytes):
        return time_model.shard_collective_time(value_bytes * values, tp, *hw.nvlink)

    narrow, wide = transfer(1 if fp8 else VALUE_BYTES), transfer(VALUE_BYTES)
    exposed = 0.0
    layers = sum(count for _, count in spans)   # the rank's, over its chunks ((first, count))
    for layer in (i for start, count in spans for i in range(start, start + count)):
        qkv, proj, fc1, fc2 = (flops * batch * seq / tp / rate / speed
                               for flops in model.linear_flops_per_token(layer))
        moe = model.experts and layer >= model.dense_layers
        if moe:   # the shared experts' products hide their collectives; the routed
            # experts' collectives are the dispatcher's
            share = model.shared_experts / (model.top_k + model.shared_experts)
            fc1, fc2 = fc1 * share, fc2 * share
        if style == "te":
            attention = [(narrow, qkv), (narrow, proj)]
            mlp = [(narrow, fc1), (narrow, fc2)]
            pairs = [(narrow, proj), (narrow, qkv), (wide, qkv)]    # ring_exchange dgrad, bulk
            pairs += [(narrow, fc2), (narrow, fc1), (wide, fc1)]    # the same of the MLP
        else:   # torch: gathers in FP8 under torchao, reduce-scatters bf16
            if not fused:                          # plain: no product hides anything
                qkv = proj = fc1 = fc2 = 0.0
            attention = [(narrow, qkv), (wide, proj)]
            mlp = [(narrow, fc1), (wide, fc2)]
            # dgrad: the gradient's gathers fused; the reduce-scatters of summed products not
            pairs = [(narrow, proj), (wide, 0.0), (narrow, fc2), (wide, 0.0)]
        if moe and not model.shared_experts:   # no MLP collectives of its own
            mlp, pairs = [], pairs[:len(pairs) // 2]
        forward = attention + mlp
        pairs += forward * (2 if recompute else 1)
        exposed += sum(max(0.0, comm - product) for comm, product in pairs)
    _, outside, once = tensor_parallel_plan(layers, seq, batch, model.hidden, tp, embedding,
                                            recompute, head)
    return microbatches * (exposed + priced(outside, tp, tp, hw)) + priced(once, tp, tp, hw)


@functools.lru_cache(maxsize=65536)   # the same for every ZeRO stage the search tries
def tensor_parallel_seconds(model, cut, chunks, seq, batch, tp, microbatches, recompute, hw,
                            rate, settings):
    """The step's tensor-parallel term: the exposed collectives of the rank whose traffic
    is longest, its chunks holding `cut`'s layers, the embedding's collectives on the first
    rank only and the head's and the loss's on the last; a MoE layer's MLP collectives are
    its shared experts' (its routed experts' tokens move by the dispatcher's collectives,
    priced with expert parallelism): without a shared expert it issues only its
    attention's half."""
    if tp == 1:
        return 0.0
    ranks = rank_layers(model, cut, chunks)
    last = len(ranks) - 1
    torch_tp = settings.torch_tp or settings.async_tp
    if settings.sequence_parallel and (settings.tp_comm_overlap or torch_tp):
        style = "torch" if torch_tp else "te"
        seconds = max(tensor_parallel_overlapped_time(
            model, spans, seq, batch, tp, rank == 0, microbatches, recompute == "full", hw,
            rate, settings.precision == "fp8", style,
            settings.tp_comm_overlap or settings.async_tp, rank == last)
            for rank, spans in ranks)
        if not (settings.tp_comm_overlap or settings.async_tp):   # plain torch TP
            seconds *= 1 - settings.tp_overlap
        return seconds
    # a stated fraction hidden (--tp-overlap), or none
    return max(tensor_parallel_time(
        sum(count for _, count in spans), seq, batch, model.hidden, tp, rank == 0,
        microbatches, recompute == "full", hw, settings.precision == "fp8",
        0 if model.shared_experts else moe_count(model, spans), rank == last,
        settings.sequence_parallel)
        for rank, spans in ranks) * (1 - settings.tp_overlap)

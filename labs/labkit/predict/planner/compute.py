"""The computation of a step, priced: at one rate (Settings.rate "flat"), or by its shapes.

The computation is priced at one rate (Settings.rate "flat": Settings.mfu of the peak for
every FLOP), or by its shapes ("shape", shaped_compute): each linear product at its own
rate, tile- and wave-quantised under a ceiling or bound by its operands' traffic at HBM
bandwidth (time_model.gemm_seconds), and the kernels that are not matrix products (norms,
activations, residual adds, an unfused softmax, the optimizer's step) at HBM bandwidth. The
ceiling is the flat rate: large products cost what they cost under "flat", and the shape
rate adds what small ones lose and what the flat rate leaves out. Not the GPU's maximum
achievable matmul rate (MAMF, hardware.A100_MAMF_FLOPS): as the ceiling, it predicts the
published runs 25 to 50 % faster than they ran; the flat fraction also stands for what the
model leaves out (launches, the SMs the collectives take, synchronisation)."""

import functools

from .. import time_model


# Bytes an Adam step moves per parameter (time_model.optimizer_step_s)
ADAM_BYTES = 28


@functools.lru_cache(maxsize=4096)
def linear_rate(model, tokens, tp, hw, ceiling):
    """FLOP/s of a dense layer's four linear products and the head's, forward and backward,
    at `tokens` a micro-batch on a rank (their rows) and the widths tp splits (QKV's and
    the MLP's first outputs, the projection's and the MLP's second inputs, the head's
    vocabulary). Layer 0's shape stands for every layer: a mixture of experts' routed
    products keep their own roofline (expert_parallel.expert_matmul_slowdown)."""
    sms, hbm = hw.sms_and_hbm
    h = model.hidden
    qkv, projection, first, second = model.linear_flops_per_token(0)
    shapes = [(qkv / (2 * h) / tp, h), (h, projection / (2 * h) / tp),
              (first / (2 * h) / tp, h), (h, second / (2 * h) / tp)]
    flops = seconds = 0.0
    for n, k in shapes:   # the layers' products, n x k each, then the head's
        n, k = max(1, round(n)), max(1, round(k))
        flops += model.layers * 6 * tokens * n * k
        seconds += model.layers * time_model.trained_gemm_seconds(
            tokens, n, k, ceiling, hbm, sms)
    vocab = max(1, model.vocab // tp)
    flops += 6 * tokens * vocab * h
    seconds += time_model.trained_gemm_seconds(tokens, vocab, h, ceiling, hbm, sms)
    return flops / seconds


@functools.lru_cache(maxsize=4096)
def unfused_attention_rate(model, batch, seq, tp, hw, ceiling):
    """FLOP/s of attention's products without a fused kernel, per layer of a micro-batch
    of `batch` sequences of `seq` tokens on a rank: per head, the scores Q K^T (s x d_qk by
    d_qk x s) and the weights times V (s x s by s x d_v) forward, and their four gradients,
    batched over the rank's heads; the s x s operands make them memory-bound for small
    heads."""
    sms, hbm = hw.sms_and_hbm
    heads = batch * max(1, model.heads // tp)
    d_qk, d_v = model.qk_dim, model.v_dim
    args = (ceiling, hbm, sms, heads)
    products = [(seq, seq, d_qk),                     # forward: S = Q K^T
                (seq, d_v, seq),                      # O = P V
                (seq, d_qk, seq), (seq, d_qk, seq),   # dQ = dS K, dK = dS^T Q
                (seq, seq, d_v), (seq, d_v, seq)]     # dP = dO V^T, dV = P^T dO
    flops = sum(2 * m * n * k * heads for m, n, k in products)
    return flops / sum(time_model.gemm_seconds(m, n, k, *args) for m, n, k in products)


def elementwise_bytes_per_token(model, tp, sequence_parallel, flash):
    """(forward, backward, the softmax's forward) bytes one layer's kernels other than
    matrix products move per token on one of tp ranks, 16-bit values: two norms (forward:
    read and write h; backward: read the input and the gradient, write a gradient, 3h), two
    residual adds (read 2h, write h, forward), the MLP's activation (GELU: f in and out
    forward, three f backward; SwiGLU: 2f in and f out forward, five f backward), and
    without a fused attention the softmax over the rank's heads x s scores (read and write
    forward, three backward; dropout not modelled). The norms and adds run on 1/tp of the
    tokens under sequence parallelism, on all of them on every tp rank without it."""
    h, f = model.hidden, model.ffn
    per_rank = tp if sequence_parallel else 1
    forward = (2 * 2 * h + 2 * 3 * h) / per_rank
    backward = 2 * 3 * h / per_rank
    if model.gpt:
        forward, backward = forward + 2 * f / tp, backward + 3 * f / tp
    else:
        forward, backward = forward + 3 * f / tp, backward + 5 * f / tp
    softmax = (0, 0) if flash else (2 * model.heads * model.seq / tp,
                                    3 * model.heads * model.seq / tp)
    return 2 * (forward + softmax[0]), 2 * (backward + softmax[1]), 2 * softmax[0]


def optimizer_seconds(model, layout, hw):
    """An Adam step over the parameters one rank updates (time_model.optimizer_step_s):
    its 1/(tp pp) of the dense weights and 1/(etp ep pp) of the experts', over the dp x cp
    replicas that shard the states under ZeRO-1 and above."""
    tp, pp, cp, dp, ep = (layout[k] for k in ("tp", "pp", "cp", "dp", "ep"))
    etp = layout.get("etp", tp)
    experts = model.moe_layers * model.experts * sum(model.mlp(model.expert_hidden)) \
        if model.experts else 0
    params = (model.params() - experts) / (tp * pp) + experts / (etp * ep * pp)
    shards = 1 if layout["zero"] == "ddp" else dp * cp
    return time_model.optimizer_step_s(params / shards, hw.sms_and_hbm[1], ADAM_BYTES)


def shaped_compute(model, layout, settings, hw, matmuls, attention, attention_forward,
                   flat_rate):
    """(compute, its forward, recomputation, the optimizer's step) seconds of a step on the
    mean rank at the rates of Settings.rate == "shape": the layers' and the head's products
    (`matmuls` FLOPs per token, FP8's and the experts' adjustments in them) at linear_rate
    for a micro-batch's tokens on a rank, under `flat_rate` as the ceiling; attention's
    (`attention`, `attention_forward` of them forward) at unfused_attention_rate, or at
    `flat_rate` where a fused kernel runs them (FlashAttention-2 reaches 50 to 73 % of the
    A100's peak, Dao, 2023, the range the flat fraction sits in); the layers' other kernels
    and the optimizer's step at HBM bandwidth."""
    tp, cp, dp, pp = (layout[k] for k in ("tp", "cp", "dp", "pp"))
    b, recompute = layout["micro_batch"], layout["recompute"]
    tokens, n = settings.global_batch_tokens, hw.gpus
    seq = model.seq // cp
    linear = linear_rate(model, b * seq, tp, hw, flat_rate)
    attention_rate = flat_rate if settings.flash_attention else \
        unfused_attention_rate(model, b, seq, tp, hw, flat_rate)
    # bytes per token of the whole model on one of tp ranks; a rank sees tokens x tp / n
    sequence_parallel = tp > 1 and settings.sequence_parallel
    forward_bytes, backward_bytes, softmax_bytes = (
        model.layers * x for x in elementwise_bytes_per_token(
            model, tp, sequence_parallel, settings.flash_attention))
    per_rank = tokens * tp / n / hw.sms_and_hbm[1]
    compute = (matmuls * tokens / n / linear + attention * tokens / n / attention_rate
               + (forward_bytes + backward_bytes) * per_rank)
    forward = ((matmuls / 3) * tokens / n / linear
               + attention_forward * tokens / n / attention_rate + forward_bytes * per_rank)
    extra = {"none": 0.0, "full": forward,
             "selective": attention_forward * tokens / n / attention_rate
             + softmax_bytes * per_rank}[recompute]
    return compute, forward, extra, optimizer_seconds(model, layout, hw)

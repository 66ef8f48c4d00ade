"""A step's time as a sum of terms (compute, recomputation, the pipeline's bubble, and what
each parallelism's traffic leaves exposed), and its model FLOPs utilization. The
computation's price, at one rate or by its shapes, is compute.py's."""

from .. import precision_model, time_model
from .compute import shaped_compute
from .context_parallel import context_parallel_seconds
from .data_parallel import data_parallel_exposed_seconds, tied_embedding_seconds
from .expert_parallel import dispatch_seconds, expert_matmul_slowdown
from .layout import chunk_flops, chunk_split, stage_split
from .pipeline import bubble_seconds, chunk_exposed_seconds, send_seconds, sends_overlapped
from .settings import GRAD_REDUCE_BYTES
from .tensor_parallel import tensor_parallel_seconds


def step_time(model, layout, settings, hw):
    """{compute, recompute, bubble, tp, pp, dp, cp, ep, step} seconds of one step."""
    dp, tp, pp, cp, ep, v = (layout[k] for k in ("dp", "tp", "pp", "cp", "ep", "chunks"))
    etp = layout.get("etp", tp)
    b, m, zero, recompute = (layout[k] for k in ("micro_batch", "microbatches", "zero",
                                                  "recompute"))
    dualpipe = bool(layout.get("dualpipe"))
    n, rate = hw.gpus, hw.peak_tflops * 1e12 * settings.mfu
    tokens = settings.global_batch_tokens
    # The FLOPs a step runs (chunk_flops): the layers' 6 x active parameters, attention's
    # products as a kernel runs them, the head's product; the embedding's lookup none
    executed = sum(chunk_flops(model, (model.layers,), settings.flash_attention))
    attention = model.attention_flops_executed_per_token(settings.flash_attention)
    # attention's forward products: 2 of its 7 (fused) or 2 of 6 (the weights kept)
    attention_forward = model.attention_flops_per_token() / 3 \
        * (0.5 if settings.flash_attention else 1)
    # FP8 runs the layers' linear products at its measured higher rate, the rest stays bf16
    fp8 = 6 * model.active_matrix_params() if settings.precision == "fp8" else 0
    matmuls = executed - attention - fp8 + fp8 / precision_model.FP8_MATMUL_RATIO
    if model.experts:   # the routed experts' products where their operands' traffic bounds them
        routed = 6 * model.top_k * model.moe_layers * model.mlp(model.expert_hidden)[0]
        slowdown = expert_matmul_slowdown(
            model, b * (model.seq // cp) // tp * etp, etp, ep, rate, hw,
            settings.precision == "fp8", precision_model.RECIPES[settings.states].grads)
        matmuls += routed / (precision_model.FP8_MATMUL_RATIO if fp8 else 1) * (slowdown - 1)
    optimizer = 0.0
    if settings.rate == "shape":
        compute, forward, extra, optimizer = shaped_compute(
            model, layout, settings, hw, matmuls, attention, attention_forward, rate)
    else:
        compute = (matmuls + attention) * tokens / n / rate
        # the forward: a third of the matrix products (backward: the inputs' and the
        # weights' gradients), and attention's forward products
        forward = (matmuls / 3 + attention_forward) * tokens / n / rate
        # selective recomputation runs attention's forward products again
        extra = {"none": 0.0, "full": forward,
                 "selective": attention_forward * tokens / n / rate}[recompute]
    work = compute + extra
    cut = chunk_split(model, pp, v, settings.flash_attention)
    split = stage_split(model, pp, v, settings.flash_attention)
    seq = model.seq // cp
    tp_s = tensor_parallel_seconds(model, cut, v, seq, b, tp, m, recompute, hw, rate, settings)
    sends = send_seconds(model, b, seq, tp, cp, dp, pp, m, v, hw)
    # overlapped, the sends wait only in the fill and drain (the bubble's share below), and
    # with chunk_price their latency and what outlasts each chunk's computation
    pp_s = sends
    if sends_overlapped(settings, v):
        pp_s = chunk_exposed_seconds(model, b, seq, tp, cp, dp, pp, m, v, hw, forward,
                                     compute - forward) if settings.chunk_price else 0.0
    dp_exposed = data_parallel_exposed_seconds(model, cut, tp, ep, zero, m, dp * cp, settings,
                                               hw, v, etp, dualpipe, forward,
                                               compute - forward, work)
    # a tied embedding's gradient summed between the first and the last stage, after the
    # reductions: exposed
    dp_exposed += tied_embedding_seconds(model, tp, pp, tp * cp * dp * pp <= hw.gpus_per_node,
                                         hw, GRAD_REDUCE_BYTES[settings.grad_reduce])
    cp_s = context_parallel_seconds(model, b, seq, tp, cp, max(split), m, rate, hw,
                                    settings.cp_scheme, recompute, settings.flash_attention)
    ep_s = dispatch_seconds(model, cut, v, b, seq, tp, ep, etp, m, recompute, hw,
                            settings.dispatch_bytes)
    if dualpipe:   # one micro-batch's all-to-alls run beside another's compute
        exposed = max(0.0, ep_s + pp_s - work)   # what outlasts the computation, as ep
        ep_s, pp_s = exposed, 0.0
    elif settings.ep_overlap:
        ep_s = max(0.0, ep_s - work)
    # the fill and drain wait for each micro-batch's computation and its exposed traffic,
    # the pipeline's sends included, overlapped or not
    bubble = bubble_seconds(model, cut, pp, m, v, work, forward, settings.flash_attention,
                            dualpipe, tp_s + (0.0 if dualpipe else sends) + cp_s + ep_s,
                            zero_bubble=bool(layout.get("zb")))
    # the optimizer's step runs once, after the last micro-batch: outside the bubble's slots
    result = {"compute": compute + optimizer, "recompute": extra, "bubble": bubble,
              "tp": tp_s, "pp": pp_s, "dp": dp_exposed, "cp": cp_s, "ep": ep_s}
    result["step"] = sum(result.values())
    return result


def mfu(model, settings, hw, step_s, with_attention=False):
    """Model FLOPs over the step's peak FLOPs: 6 x (active) parameters per token, plus
    attention's 12 L h s with_attention (Megatron-LM's and PaLM's count, recomputation
    not counted)."""
    flops = 6 * model.active_params() + (model.attention_flops_per_token()
                                         if with_attention else 0)
    return flops * settings.global_batch_tokens / (step_s * hw.gpus * hw.peak_tflops * 1e12)

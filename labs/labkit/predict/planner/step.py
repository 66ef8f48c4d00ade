"""A step's time as a sum of terms (compute, recomputation, the pipeline's bubble, and what
each parallelism's traffic leaves exposed), and its model FLOPs utilization."""

from .. import precision_model
from .context_parallel import ring_seconds
from .data_parallel import data_parallel_exposed_seconds
from .expert_parallel import dispatch_seconds, expert_matmul_slowdown
from .layout import chunk_split, stage_split
from .pipeline import bubble_seconds, send_seconds
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
    # Attention's products as executed: a fused kernel skips the blocks a causal mask hides
    attention = model.attention_flops_per_token() * (0.5 if settings.flash_attention else 1)
    dense = 6 * model.active_params()
    # FP8 runs the layers' linear products at its measured higher rate, the rest stays bf16
    fp8 = 6 * model.active_matrix_params() if settings.precision == "fp8" else 0
    compute = (dense - fp8 + fp8 / precision_model.FP8_MATMUL_RATIO + attention) \
        * tokens / n / rate
    if model.experts:   # the routed experts' products where their operands' traffic bounds them
        routed = 6 * model.top_k * model.moe_layers * model.mlp(model.expert_hidden)[0]
        routed_s = routed / (precision_model.FP8_MATMUL_RATIO if fp8 else 1) * tokens / n / rate
        slowdown = expert_matmul_slowdown(
            model, b * (model.seq // cp) // tp * etp, etp, ep, rate, hw,
            settings.precision == "fp8", precision_model.RECIPES[settings.states].grads)
        compute += routed_s * (slowdown - 1)
    forward = compute / 3
    extra = {"none": 0.0, "full": forward,
             "selective": attention / 3 * tokens / n / rate}[recompute]
    work = compute + extra
    cut = chunk_split(model, pp, v, settings.flash_attention)
    split = stage_split(model, pp, v, settings.flash_attention)
    bubble = bubble_seconds(model, cut, pp, m, v, work, forward, settings.flash_attention,
                            dualpipe)
    seq = model.seq // cp
    tp_s = tensor_parallel_seconds(model, cut, v, seq, b, tp, pp, m, recompute, hw, rate,
                                   settings)
    pp_s = send_seconds(model, b, seq, tp, cp, dp, pp, m, v, hw)
    dp_exposed = data_parallel_exposed_seconds(model, cut, tp, ep, zero, m, dp * cp, settings,
                                               hw, v, etp, dualpipe, forward, work)
    cp_s = ring_seconds(model, b, seq, tp, cp, max(split), m, rate, hw)
    ep_s = dispatch_seconds(model, cut, v, b, seq, tp, ep, etp, m, recompute, hw)
    if dualpipe:   # one micro-batch's all-to-alls run beside another's compute
        exposed = max(0.0, ep_s + pp_s - work)   # what outlasts the computation, as ep
        ep_s, pp_s = exposed, 0.0
    elif settings.ep_overlap:
        ep_s = max(0.0, ep_s - work)
    result = {"compute": compute, "recompute": extra, "bubble": bubble, "tp": tp_s,
              "pp": pp_s, "dp": dp_exposed, "cp": cp_s, "ep": ep_s}
    result["step"] = sum(result.values())
    return result


def mfu(model, settings, hw, step_s, with_attention=False):
    """Model FLOPs over the step's peak FLOPs: 6 x (active) parameters per token, plus
    attention's 12 L h s with_attention (Megatron-LM's and PaLM's count, recomputation
    not counted)."""
    flops = 6 * model.active_params() + (model.attention_flops_per_token()
                                         if with_attention else 0)
    return flops * settings.global_batch_tokens / (step_s * hw.gpus * hw.peak_tflops * 1e12)

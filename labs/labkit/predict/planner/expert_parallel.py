"""Expert parallelism in a step: the routed experts' products where their memory traffic
bounds them (a roofline), and the dispatcher's collectives that bring tokens to their
experts and back."""

import functools

from .. import comm_model, precision_model, time_model
from .collectives import group_time
from .layout import members_per_node, most_moe_layers
from .settings import VALUE_BYTES


def expert_matmul_slowdown(model, tokens, etp, ep, rate, hw, fp8=False,
                           grad_bytes=VALUE_BYTES):
    """How much longer the routed experts' matrix products take than their FLOPs at `rate`
    say (>= 1), by the roofline: a product runs at the slower of its FLOPs and the HBM
    traffic of its operands and result, read and written once (Williams et al., 2009).
    One of a rank's experts sees ep x tokens x top_k / experts tokens per micro-batch
    (`tokens`: a micro-batch's on the etp ranks of an expert tensor-parallel group, whose
    routed copies Megatron-Core's dispatcher gathers for each of them; routing balanced)
    against weights of hidden x expert_hidden / etp: a few hundred tokens bring it near
    the roofline's ridge, where HBM traffic rather than arithmetic can bound it. Each of
    the two matrices runs three products of the same FLOPs: forward, the inputs' gradient, and the weights' gradient,
    which adds into the gradient buffer (`grad_bytes` a value, read and written, as
    Megatron-Core's fused gradient accumulation does). A lower bound on the time: the
    datasheet's bandwidth, and none of the tile and wave quantization small products also
    pay."""
    rows = ep * tokens * model.top_k / model.experts
    width = model.expert_hidden / etp
    first = width * (1 if model.gpt else 2)          # fc1, or SwiGLU's gate and up
    in_bytes = 1 if fp8 else VALUE_BYTES             # FP8 operands, 16-bit results
    speed = rate * (precision_model.FP8_MATMUL_RATIO if fp8 else 1)
    bandwidth = hw.memory_tb_s * 1e12
    compute = slow = 0.0
    for k, n in ((model.hidden, first), (width, model.hidden)):
        seconds = 2 * rows * k * n / speed
        for traffic in (in_bytes * (rows * k + k * n) + VALUE_BYTES * rows * n,   # Y = X W
                        in_bytes * (rows * n + k * n) + VALUE_BYTES * rows * k,   # dX = dY W'
                        in_bytes * (rows * k + rows * n) + 2 * grad_bytes * k * n):  # dW +=
            compute += seconds
            slow += max(seconds, traffic / bandwidth)
    return slow / compute


@functools.lru_cache(maxsize=4096)
def dispatch_collective_time(model, tokens, ep, etp, hw, value_bytes=VALUE_BYTES):
    """Seconds of one of a MoE layer's four dispatcher passes for one micro-batch (the
    dispatch and the combine forward, and their gradients backward), a rank's `tokens`
    (its sequence-parallel share of a micro-batch) reaching the experts of its etp x ep
    ranks (etp innermost). The cheaper of two of Megatron-Core's dispatchers; a run fixes
    one for all its layouts, so for a layout it did not tune this is a lower bound:
      all-to-all  each token to its top_k experts over the ep ranks, which sit etp apart,
                  then each copy a rank receives gathered over the etp ranks that split its
                  expert's matrices (an all-gather on NVLink; the combine reduce-scatters
                  it back). Across nodes, where routing is node-limited (node_limit), one
                  copy per node reached and forwarded inside it, as DeepEP and HybridEP
                  (Megatron-Core's flex dispatcher) send them, not one per expert as
                  NCCL's all-to-all would;
      all-gather  every token gathered over the etp x ep ranks, each rank keeping those
                  routed to its experts (the combine reduce-scatters): Megatron-Core's
                  default, cheaper with few ranks and a large top_k.
    Each token's hidden values travel in `value_bytes` (2, or DeepSeek-V3's FP8
    dispatch, 1). The routing map and probabilities that travel with the tokens, and an
    FP8 dispatch's scales, are left out."""
    all_to_all = 0.0
    if ep > 1:
        per_node = members_per_node(etp, ep, hw)
        nodes = max(1, ep // per_node)
        copies = model.top_k * (ep - 1) / ep
        nv_bytes = value_bytes * tokens * model.hidden * copies
        if nodes > 1:
            # node-limited: one copy per node reached, forwarded inside it; otherwise one
            # copy per routed expert on another node
            off_node = float(comm_model.expected_network_copies(
                model.experts, nodes, model.top_k, model.node_limit or None,
                once_per_node=bool(model.node_limit)))
            net_bytes = value_bytes * tokens * model.hidden * off_node
            all_to_all += max(hw.network[0] + net_bytes / hw.network[1],
                              hw.nvlink[0] + nv_bytes / hw.nvlink[1])
        else:
            all_to_all += hw.nvlink[0] + nv_bytes / hw.nvlink[1]
    if etp > 1:   # the gathered copies of the etp ranks' tokens, top_k of each
        gathered = value_bytes * etp * tokens * model.top_k * model.hidden
        all_to_all += time_model.shard_collective_time(gathered, etp, *hw.nvlink)
    group = etp * ep
    all_gather = group_time("all_gather", value_bytes * tokens * group * model.hidden, group,
                            members_per_node(1, group, hw), hw)
    return min(all_to_all, all_gather)


def dispatch_seconds(model, cut, chunks, batch, seq, tp, ep, etp, microbatches, recompute, hw,
                     dispatch_bytes=VALUE_BYTES):
    """The dispatcher's passes on the rank with most MoE layers, all exposed: forward the
    dispatch (tokens to their experts) and the combine (back), backward their gradients,
    which travel the other way (the combine's gradient as a dispatch does, to the experts;
    the dispatch's as a combine); full recomputation runs the forward's two again, as it
    reruns the tensor-parallel collectives. What goes to the experts travels in
    `dispatch_bytes` a value (Settings.dispatch_bytes: DeepSeek-V3 dispatches in FP8, the
    activations before the up-projections forward and the gradients before the
    down-projections backward, and keeps both combines in bf16; DeepSeek-V3 section
    3.3.3), what comes back in 16 bits."""
    if not (model.experts and (ep > 1 or etp > 1)):
        return 0.0
    each = 3 if recompute == "full" else 2
    tokens = batch * seq / tp
    passes = each * (dispatch_collective_time(model, tokens, ep, etp, hw, dispatch_bytes)
                     + dispatch_collective_time(model, tokens, ep, etp, hw))
    return passes * most_moe_layers(model, cut, chunks) * microbatches

"""Context parallelism in a step, as each source runs it (Settings.cp_scheme):
  ring       Megatron-Core's default (cp_comm_type "p2p", Transformer Engine's
             AttnFuncWithCPAndKVP2P): cp - 1 steps pass a K and V block on in forward while
             the attention of the block already there runs; backward passes the K and V
             block again and the gradients of the one before, two blocks a step (its first
             step sends K and V alone, its last the gradients alone), beside that block's
             backward. Each step exposes what its transfers outlast.
  allgather  Llama 3's (Dubey et al., 2024, section 3.3.2: the all-gather's latency is
             exposed, small beside attention's products under grouped-query attention) and
             Transformer Engine's AttnFuncWithCPAndKVAllGather, which cites it: K and V
             all-gathered before the forward, all-gathered again before the backward and
             their gradients reduce-scattered after it, all three exposed.
Full recomputation runs the forward's transfers again."""

from .. import time_model
from .collectives import group_time
from .layout import members_per_node
from .settings import VALUE_BYTES

CP_SCHEMES = ("ring", "allgather")


def context_parallel_seconds(model, batch, seq, tp, cp, layers, microbatches, rate, hw,
                             scheme="ring", recompute="none", flash=True):
    """Context parallelism's exposed time on a rank of `layers` layers in a step; `seq` is
    the rank's s/cp tokens, its K and V those of its tp share of the key-value heads."""
    if cp == 1:
        return 0.0
    q, k_width, v_width, out = model.attention_widths()
    block = VALUE_BYTES * batch * seq * (k_width + v_width) / tp   # this rank's heads' K, V
    forwards = 2 if recompute == "full" else 1
    if scheme == "allgather":
        # the whole sequence's K and V, gathered over the cp ranks that sit tp apart
        per_node = members_per_node(tp, cp, hw)
        gather = group_time("all_gather", block * cp, cp, per_node, hw)
        scatter = group_time("reduce_scatter", block * cp, cp, per_node, hw)
        return (forwards * gather + gather + scatter) * layers * microbatches
    if scheme != "ring":
        raise ValueError(f"unknown cp_scheme {scheme!r}; choose from {', '.join(CP_SCHEMES)}")
    link = hw.nvlink if tp * cp <= hw.gpus_per_node else hw.network
    send = link[0] + block / link[1]
    # one block's products, scores and weighted values, of which a causal mask leaves half
    # in the load-balanced cut (two chunks a rank, one from each end), forward; the
    # backward's time_model.attention_products_flops' ratio to it
    products = time_model.attention_products_flops(seq, batch, 1, fused=flash)
    forward_block = 2 * batch * seq * seq * (q + out) / tp * 0.5 / rate
    backward_block = forward_block * products["backward"] / products["forward"]
    per_layer = (cp - 1) * (forwards * max(0.0, send - forward_block)
                            + max(0.0, 2 * send - backward_block))
    return per_layer * layers * microbatches

"""Context parallelism in a step: the ring that passes the keys' and values' blocks, exposed
where a block's transfer outlasts the attention it overlaps."""

from .settings import VALUE_BYTES


def ring_seconds(model, batch, seq, tp, cp, layers, microbatches, rate, hw):
    """The ring's exposed time on a rank of `layers` layers: each step passes one K and V
    block while the attention of another runs; `seq` is the rank's s/cp tokens."""
    if cp == 1:
        return 0.0
    link = hw.nvlink if tp * cp <= hw.gpus_per_node else hw.network
    q, k_width, v_width, out = model.attention_widths()
    block = VALUE_BYTES * batch * seq * (k_width + v_width) / tp   # this rank's heads' K, V
    send = link[0] + block / link[1]
    # scores and weighted values of one block, forward and backward, causal
    block_flops = 2 * batch * seq * seq * (q + out) / tp * 0.5 * 3
    per_layer = (cp - 1) * max(0.0, 2 * send - block_flops / rate)
    return per_layer * layers * microbatches

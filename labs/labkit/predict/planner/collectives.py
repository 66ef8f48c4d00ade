"""One collective over a group of ranks placed on nodes, priced: a ring on NVLink inside a
node, NCCL's algorithms across nodes (time_model)."""

from collections import Counter

from .. import comm_model, time_model
from .settings import VALUE_BYTES


def group_time(op, bytes_, size, span_per_node, hw):
    """Seconds of one collective over `size` ranks of which `span_per_node` share a node:
    a ring on NVLink inside one node; across nodes the all-reduce as NCCL's flat ring or
    its tree, whichever is faster (time_model.nccl_allreduce_time), and an all-gather or
    reduce-scatter as the flat ring alone (time_model.hierarchical_shard_collective_time):
    NCCL has no tree for those two."""
    if size == 1:
        return 0.0
    if size <= span_per_node:
        if op == "all_reduce":
            return comm_model.allreduce_time(bytes_, size, *hw.nvlink)
        return time_model.shard_collective_time(bytes_, size, *hw.nvlink)
    if op == "all_reduce":
        return time_model.nccl_allreduce_time(bytes_, size, span_per_node, hw.nvlink,
                                              hw.network)
    return time_model.hierarchical_shard_collective_time(bytes_, size, span_per_node,
                                                         hw.nvlink, hw.network)


def priced(collectives, size, per_node, hw, gather_bytes=VALUE_BYTES, reduce_bytes=VALUE_BYTES):
    """Seconds of a list of (op, elements) collectives of 16-bit values (group_time), the
    all-gathers' at `gather_bytes` per element (less where FP8 weights are gathered), the
    reductions' at `reduce_bytes` (more where gradients are reduced in fp32)."""
    return priced_counts(Counter(collectives), size, per_node, hw, gather_bytes, reduce_bytes)


def priced_counts(counts, size, per_node, hw, gather_bytes=VALUE_BYTES,
                  reduce_bytes=VALUE_BYTES):
    """priced, of {(op, elements): how many} collectives."""
    return sum(count * group_time(op, (gather_bytes if op == "all_gather" else reduce_bytes)
                                  * numel, size, per_node, hw)
               for (op, numel), count in counts.items())

"""The 3-D device mesh, data x pipeline x tensor: which coordinates each rank has and which
ranks share a process group along each dimension.

Ranks are laid out with tp innermost, then pp, then dp outermost (the order of
init_device_mesh((dp, pp, tp)), and of Llama 3's training; Megatron-LM's default and
torchtitan put pp outermost and dp inside it): the t ranks of a tensor-parallel group are
consecutive, so on nodes of G GPUs with t dividing G they share a node and its NVLink,
the dimension that communicates most. The data-parallel groups, which communicate least
often, span the nodes.

    rank = (d * pp + p) * tp + t
"""

DIMENSIONS = ("dp", "pp", "tp")


def coordinates(rank, dp, pp, tp):
    """{dp, pp, tp}: the rank's position along each dimension."""
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp} x {pp} x {tp}")
    return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}


def rank_at(d, p, t, pp, tp):
    """The global rank at coordinates (d, p, t)."""
    return (d * pp + p) * tp + t


def groups(dp, pp, tp):
    """{dimension: [[ranks]]}: the ranks that vary along one dimension while the other two
    stay fixed, each group once, in rank order."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    result = {}
    for dim in DIMENSIONS:
        seen = {}
        for rank in range(dp * pp * tp):
            here = coordinates(rank, dp, pp, tp)
            key = tuple(here[other] for other in DIMENSIONS if other != dim)
            seen.setdefault(key, []).append(rank)
        result[dim] = sorted(seen.values())
        assert all(len(g) == sizes[dim] for g in result[dim])
    return result


def nodes_spanned(group, gpus_per_node):
    """How many nodes of `gpus_per_node` GPUs (ranks placed node by node) a group touches."""
    return len({rank // gpus_per_node for rank in group})

"""The device mesh, data x pipeline x context x tensor: which coordinates each rank has
and which ranks share a process group along each dimension.

Ranks are laid out with tp innermost, then cp, then pp, then dp outermost (the order of
init_device_mesh((dp, pp, cp, tp)), and of Llama 3's training; Megatron-LM's default and
torchtitan put pp outermost and dp inside it): the t ranks of a tensor-parallel group are
consecutive, so on nodes of G GPUs with t dividing G they share a node and its NVLink,
the dimension that communicates most; context parallelism, which passes keys and values
inside every layer, comes next. The data-parallel groups, which communicate least often,
span the nodes. Without context parallelism (cp = 1) this is the 3-D mesh dp x pp x tp.

    rank = ((d * pp + p) * cp + c) * tp + t
"""

DIMENSIONS = ("dp", "pp", "cp", "tp")


def coordinates(rank, dp, pp, tp, cp=1):
    """{dp, pp, cp, tp}: the rank's position along each dimension."""
    if not 0 <= rank < dp * pp * cp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp} x {pp} x {cp} x {tp}")
    return {"dp": rank // (pp * cp * tp), "pp": rank // (cp * tp) % pp,
            "cp": rank // tp % cp, "tp": rank % tp}


def rank_at(d, p, t, pp, tp, c=0, cp=1):
    """The global rank at coordinates (d, p, c, t)."""
    return ((d * pp + p) * cp + c) * tp + t


def groups(dp, pp, tp, cp=1):
    """{dimension: [[ranks]]}: the ranks that vary along one dimension while the others
    stay fixed, each group once, in rank order."""
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    result = {}
    for dim in DIMENSIONS:
        seen = {}
        for rank in range(dp * pp * cp * tp):
            here = coordinates(rank, dp, pp, tp, cp)
            key = tuple(here[other] for other in DIMENSIONS if other != dim)
            seen.setdefault(key, []).append(rank)
        result[dim] = sorted(seen.values())
        assert all(len(g) == sizes[dim] for g in result[dim])
    return result


def nodes_spanned(group, gpus_per_node):
    """How many nodes of `gpus_per_node` GPUs (ranks placed node by node) a group touches."""
    return len({rank // gpus_per_node for rank in group})

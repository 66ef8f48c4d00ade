"""The device mesh's layout: tp innermost, then pp, then dp, as init_device_mesh((dp, pp,
tp)) numbers it (the hybrid lab checks torch's own groups against these at run time)."""

import itertools

import pytest

from labkit.parallel import mesh


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (3, 1, 2), (1, 3, 1), (4, 2, 2), (2, 3, 5)])
def test_coordinates_and_ranks_are_inverse_and_tp_is_innermost(dp, pp, tp):
    world = dp * pp * tp
    seen = set()
    for rank in range(world):
        c = mesh.coordinates(rank, dp, pp, tp)
        assert mesh.rank_at(c["dp"], c["pp"], c["tp"], pp, tp) == rank
        seen.add((c["dp"], c["pp"], c["tp"]))
    assert seen == set(itertools.product(range(dp), range(pp), range(tp)))
    groups = mesh.groups(dp, pp, tp)
    assert all(g == list(range(g[0], g[0] + tp)) for g in groups["tp"])   # consecutive ranks
    for dim, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        assert len(groups[dim]) == world // size
        assert sorted(r for g in groups[dim] for r in g) == list(range(world))
        for g in groups[dim]:   # the other two coordinates stay fixed inside a group
            others = [k for k in mesh.DIMENSIONS if k != dim]
            assert len({tuple(mesh.coordinates(r, dp, pp, tp)[k] for k in others) for r in g}) == 1


def test_placement_on_nodes():
    groups = mesh.groups(4, 2, 8)   # 64 GPUs, nodes of 8
    assert all(mesh.nodes_spanned(g, 8) == 1 for g in groups["tp"])
    assert all(mesh.nodes_spanned(g, 8) == 2 for g in groups["pp"])
    assert all(mesh.nodes_spanned(g, 8) == 4 for g in groups["dp"])
    with pytest.raises(ValueError):
        mesh.coordinates(8, 2, 2, 2)

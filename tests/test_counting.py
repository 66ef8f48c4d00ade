"""The two counters the labs measure with: CountCollectives (every collective a step issues,
as torch's dispatcher sees it) and count_activation_bytes (what autograd keeps)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from labkit.predict import comm_model, memory_model
from labkit.runtime import distenv
from labkit.runtime.activations import count_activation_bytes
from labkit.runtime.collectives import CountCollectives
from labkit.model.transformer import Shape, Transformer, next_token_loss, random_batch


@pytest.fixture
def fake_world_of_four():
    """Rank 0 of 4 in one process: torch's fake process group, whose collectives do nothing
    but pass through the dispatcher as real ones do."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield 4
    dist.destroy_process_group()


def test_c10d_collectives_are_counted_with_ring_bytes(fake_world_of_four):
    n = fake_world_of_four
    counter = comm_model.CollectiveCounter(n)
    full, shard = torch.zeros(12), torch.zeros(3)
    with CountCollectives(counter):
        dist.all_reduce(full)
        distenv.all_gather_single(full, shard)
        distenv.reduce_scatter_single(shard, full)
        dist.broadcast(full, src=0)
    assert counter.counts == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1,
                              "broadcast": 1}
    # 48 bytes each: the all-reduce 2 x 3/4 of them, gather and scatter 3/4, broadcast 3/4
    assert counter.sent == 2 * 36 + 36 + 36 + 36


def test_dtensor_collectives_are_counted_too(fake_world_of_four):
    mesh = init_device_mesh("cpu", (fake_world_of_four,))
    sharded = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    counter = comm_model.CollectiveCounter(fake_world_of_four)
    with CountCollectives(counter):
        sharded.full_tensor()   # DTensor gathers with a functional collective
    assert counter.counts == {"all_gather": 1}
    assert counter.sent == 3 * 8 * 4 * 4 / 4   # 3/4 of the 128-byte full tensor


def test_a_collective_it_cannot_count_is_an_error(fake_world_of_four):
    counter = comm_model.CollectiveCounter(fake_world_of_four)
    with pytest.raises(NotImplementedError, match="cannot count"):
        with CountCollectives(counter):
            dist.all_to_all([torch.zeros(1)] * 4, [torch.zeros(1)] * 4)


def test_activations_of_one_layer_are_the_formula_plus_layernorm_statistics():
    shape, batch = Shape(layers=2, hidden=24, heads=4, seq=10, vocab=30), 3
    model = Transformer(shape)
    ids, targets = random_batch(shape, batch, torch.Generator().manual_seed(0), "cpu")
    kept = count_activation_bytes(model, lambda: next_token_loss(model(ids), targets))
    assert kept[0] == kept[1] == memory_model.activation_bytes_per_layer(
        shape.seq, batch, shape.hidden, shape.heads, value_bytes=4, dropout=False
    ) + memory_model.layer_norm_statistics_bytes(shape.seq, batch)
    assert set(kept) == {0, 1, "outside"}


def test_table_cells_keep_their_numbers_whole():
    # a narrow screen may break after the minus of an exponent, at a range's dash, and
    # between a number and its unit; table() joins them, and leaves words alone
    from labkit.runtime.notebook import keep_whole
    assert keep_whole("3.0e-08") == "3.0e\u201108"
    assert keep_whole("4.97–5.75") == "4.97\u2060–\u20605.75"
    assert keep_whole("17.2 GB") == "17.2\u00a0GB" and keep_whole("12 %") == "12\u00a0%"
    assert keep_whole("3 layers") == "3 layers" and keep_whole("all-reduce") == "all-reduce"

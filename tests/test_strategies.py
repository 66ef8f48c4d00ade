"""How a fused QKV weight is split by heads for tensor parallelism."""

import pytest
import torch

from labkit.strategies import group_qkv_by_rank, qkv_rows_of_rank
from labkit.transformer import Shape, Transformer


@pytest.mark.parametrize("t", [1, 2, 3, 6])
def test_each_rank_gets_the_same_whole_heads_of_q_k_and_v(t):
    h, heads = 12, 6
    head_size = h // heads
    rows = [qkv_rows_of_rank(h, heads, rank, t) for rank in range(t)]
    assert sorted(torch.cat(rows).tolist()) == list(range(3 * h))   # each row once
    for rank, mine in enumerate(rows):
        q, k, v = mine.view(3, -1)
        assert torch.equal(k - h, q) and torch.equal(v - 2 * h, q)   # the same heads
        first = rank * heads // t * head_size
        assert q.tolist() == list(range(first, first + heads // t * head_size))


def test_heads_t_does_not_divide_are_refused():
    with pytest.raises(ValueError, match="4 heads do not split over 3 ranks"):
        qkv_rows_of_rank(8, 4, 0, 3)


def test_regrouped_rows_give_torchs_block_split_whole_heads():
    shape, t = Shape(layers=2, hidden=12, heads=6, seq=4, vocab=8), 3
    model = Transformer(shape)
    before = [block.qkv.weight.detach().clone() for block in model.blocks]
    order = group_qkv_by_rank(model, t)
    for block, original in zip(model.blocks, before):
        blocks = block.qkv.weight.detach().chunk(t)   # what ColwiseParallel gives each rank
        for rank, rows in enumerate(blocks):
            assert torch.equal(rows, original[qkv_rows_of_rank(12, 6, rank, t)])
        restored = torch.empty_like(original).index_copy_(0, order, block.qkv.weight.detach())
        assert torch.equal(restored, original)

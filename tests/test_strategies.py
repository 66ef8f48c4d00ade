"""How a fused QKV weight is split by heads for tensor parallelism."""

import pytest
import torch

from labkit.parallel.strategies import group_qkv_by_rank, qkv_rows_of_rank
from labkit.model.transformer import Shape, Transformer


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


def test_fsdp_shards_on_the_labs_device_when_cuda_is_there_too(monkeypatch):
    """On a GPU box that fell back to gloo, FSDP2's own default mesh would be CUDA (it asks
    torch for the accelerator) and move every shard to cuda:0: apply_fsdp names the mesh,
    on the lab's device type. CUDA is faked here; a CUDA mesh would fail on this torch."""
    import torch.distributed as dist
    from labkit.model.transformer import Shape, Transformer
    from labkit.parallel.strategies import apply_fsdp
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = apply_fsdp(Transformer(Shape(layers=1, hidden=8, heads=2, seq=4, vocab=11)),
                           torch.device("cpu"))
        params = list(model.parameters())
        assert params and all(p.device.type == "cpu" for p in params)
        assert {p.device_mesh.device_type for p in params} == {"cpu"}
    finally:
        dist.destroy_process_group()

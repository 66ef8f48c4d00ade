"""The step-time model and its helpers against cases computed by hand, and DDP's bucket
grouping against torch's own."""

import random

import pytest
import torch
import torch.distributed as dist

from labkit.predict import time_model
from labkit.predict.time_model import schedule_order


def test_speedup_and_efficiencies():
    assert time_model.speedup(10.0, 4.0) == 2.5
    assert time_model.strong_efficiency(10.0, 4.0, 4) == 0.625   # 10 / (4 * 4)
    assert time_model.strong_efficiency(8.0, 1.0, 8) == 1.0
    assert time_model.weak_efficiency(10.0, 12.5) == 0.8


def test_amdahl():
    assert time_model.amdahl_speedup(1, 0.1) == pytest.approx(1.0)
    assert time_model.amdahl_speedup(4, 0.0) == pytest.approx(4.0)
    assert time_model.amdahl_speedup(10, 0.1) == pytest.approx(1 / (0.1 + 0.09))
    assert time_model.amdahl_speedup(10**9, 0.05) == pytest.approx(20, rel=1e-6)


def test_bucket_layout_by_hand():
    # caps 10 then 20: [4, 7] closes at 11 >= 10; [9, 5, 8] at 22 >= 20; [3] is left over
    assert time_model.bucket_layout([4, 7, 9, 5, 8, 3], (10, 20)) == [[0, 1], [2, 3, 4], [5]]
    assert time_model.bucket_bytes([4, 7, 9, 5, 8, 3], (10, 20)) == [11, 22, 3]
    # one tensor larger than the cap gets a bucket of its own
    assert time_model.bucket_layout([50, 1, 1], (10,)) == [[0], [1, 2]]


@pytest.mark.skipif(not hasattr(dist, "_compute_bucket_assignment_by_size"),
                    reason="this torch does not expose DDP's bucket assignment")
@pytest.mark.parametrize("mixed_dtypes", [False, True])
def test_bucket_layout_equals_ddps(mixed_dtypes):
    rng = random.Random(0)
    kinds = [torch.float32, torch.bfloat16, torch.float64] if mixed_dtypes else [torch.float32]
    for _ in range(20):
        numels = [rng.choice([1, 10, 1000, 50_000, 300_000]) for _ in range(rng.randint(1, 30))]
        dtypes = [rng.choice(kinds) for _ in numels]
        caps = (1 << 20, rng.choice([1 << 20, 2 << 20, 5 << 20]))
        tensors = [torch.empty(n, dtype=d) for n, d in zip(numels, dtypes)]
        theirs, _ = dist._compute_bucket_assignment_by_size(tensors, list(caps))
        sizes = [t.numel() * t.element_size() for t in tensors]
        assert time_model.bucket_layout(sizes, caps, dtypes) == theirs


def test_each_dtype_fills_buckets_of_its_own():
    # fp32 tensors of 6 and 6 bytes close one bucket at cap 10; the bf16 one between them
    # stays alone; buckets are listed by their first tensor
    assert time_model.bucket_layout([6, 2, 6], (10,), ["f32", "bf16", "f32"]) == [[0, 2], [1]]
    assert time_model.bucket_bytes([6, 2, 6], (10,), ["f32", "bf16", "f32"]) == [12, 2]


def test_shard_collective_is_half_an_allreduce():
    alpha, beta = 1e-5, 1e9
    assert time_model.shard_collective_time(8e6, 4, alpha, beta) == pytest.approx(3e-5 + 6e-3)
    assert time_model.shard_collective_time(1e6, 1, alpha, beta) == 0


def test_nccl_ring_is_one_flat_ring():
    # NCCL's tuning model (src/graph/tuning.cc): 2(N-1) steps, 2(nodes-1) of them on the
    # network; the bandwidth term at the slower of a GPU's NVLink and its node's G cards
    intra, inter = (1e-6, 100e9), (1e-5, 10e9)
    ring = time_model.nccl_ring_allreduce_time
    # inside one node: the plain ring, 2 x 3 alpha + 2 x 3/4 x S / beta
    assert ring(8e9, 4, 8, intra, inter) == pytest.approx(6e-6 + 0.12)
    assert ring(8e9, 1, 8, intra, inter) == 0
    # 4 nodes of 2: 14 steps, 6 across nodes; 2 cards of 10 GB/s bound it, not NVLink
    assert ring(8e9, 8, 2, intra, inter) == pytest.approx(2 * (4e-6 + 3e-5) + 1.75 * 8e9 / 20e9)
    # with faster cards NVLink binds instead
    assert ring(8e9, 8, 2, intra, (1e-5, 80e9)) == pytest.approx(2 * (4e-6 + 3e-5) + 0.14)
    # the same ring as the all-gather and reduce-scatter model, twice
    assert ring(8e9, 16, 4, intra, inter) == pytest.approx(
        2 * time_model.hierarchical_shard_collective_time(8e9, 16, 4, intra, inter))
    with pytest.raises(ValueError):
        ring(1e6, 12, 8, intra, inter)


def test_nccl_tree_is_a_chain_and_a_double_tree():
    intra, inter = (1e-6, 100e9), (1e-5, 10e9)
    tree = time_model.nccl_tree_allreduce_time
    # one node: a chain, the ring's 2(G-1) latencies and 2S over NVLink: never faster
    assert tree(8e9, 4, 8, intra, inter) == pytest.approx(6e-6 + 0.16)
    assert time_model.nccl_crossover_bytes(4, 8, intra, inter) is None
    assert tree(8e3, 4, 8, intra, inter) > time_model.nccl_ring_allreduce_time(8e3, 4, 8,
                                                                               intra, inter)
    # 4 nodes of 2: 2 x (1 alpha_intra + log2(4) alpha_inter); each node's 2 cards carry 2S
    assert tree(8e9, 8, 2, intra, inter) == pytest.approx(2 * (1e-6 + 2e-5) + 2 * 8e9 / 20e9)
    # 2 nodes: each is the root of one tree and a leaf of the other, so its cards carry S,
    # and the tree beats the ring even at 8 GB
    assert tree(8e9, 4, 2, intra, inter) == pytest.approx(2 * (1e-6 + 1e-5) + 8e9 / 20e9)
    assert time_model.nccl_allreduce_time(8e9, 4, 2, intra, inter) == tree(8e9, 4, 2, intra,
                                                                          inter)
    # one GPU a node: no chain, the double tree alone
    assert tree(8e9, 4, 1, intra, inter) == pytest.approx(2 * 2e-5 + 2 * 8e9 / 10e9)
    # 128 nodes of 8, 8 kB: latency-bound, so the tree's 2 x (7 + 7) alphas win over the
    # ring's 2 x 896 NVLink and 2 x 127 network steps
    assert tree(8e3, 1024, 8, intra, inter) == pytest.approx(2 * (7e-6 + 7e-5) + 2 * 8e3 / 80e9)
    assert time_model.nccl_allreduce_time(8e3, 1024, 8, intra, inter) == pytest.approx(
        tree(8e3, 1024, 8, intra, inter))
    assert time_model.nccl_ring_allreduce_time(8e3, 1024, 8, intra, inter) == pytest.approx(
        2 * (896e-6 + 127e-5) + 2 * 1023 / 1024 * 8e3 / 80e9)


def test_nccl_crossover_is_where_ring_and_tree_meet():
    intra, inter = (1e-6, 100e9), (1e-5, 80e9)
    crossover = time_model.nccl_crossover_bytes(1024, 8, intra, inter)
    ring = time_model.nccl_ring_allreduce_time(crossover, 1024, 8, intra, inter)
    tree = time_model.nccl_tree_allreduce_time(crossover, 1024, 8, intra, inter)
    assert ring == pytest.approx(tree, rel=1e-9)
    assert time_model.nccl_tree_allreduce_time(crossover / 2, 1024, 8, intra, inter) < \
        time_model.nccl_ring_allreduce_time(crossover / 2, 1024, 8, intra, inter)
    assert time_model.nccl_tree_allreduce_time(crossover * 2, 1024, 8, intra, inter) > \
        time_model.nccl_ring_allreduce_time(crossover * 2, 1024, 8, intra, inter)


def test_nvls_from_its_published_busbw():
    # nccl-tests issue 212: busbw ~480 GB/s on 8 H100s, algbw ~275 GB/s: 1 GB in ~3.6 ms
    t = time_model.nvls_allreduce_time(1e9, 8, 0.0, 480e9)
    assert t == pytest.approx(1.75e9 / 480e9)
    assert 1e9 / t / 1e9 == pytest.approx(274.3, abs=0.1)
    assert time_model.nvls_allreduce_time(1e9, 1, 25e-6, 480e9) == 0


def test_delay_counts_the_bytes_a_rank_sends():
    # all-reduce of 1 MB at N = 4: a rank sends 2 * 3/4 MB = 1.5 MB; at 2 ns/byte, 3 ms
    assert time_model.delay_s(1e6, 4, 2.0) == pytest.approx(3e-3)
    assert time_model.delay_s(1e6, 1, 2.0) == 0


def test_step_time_without_overlap_adds_everything():
    assert time_model.step_time(1.0, 2.0, [5, 5], [0.5, 0.25], overlap=False,
                                optimizer_s=0.1) == pytest.approx(3.85)


def test_step_time_with_overlap_by_hand():
    # forward 1, backward 2; buckets of 1, 1, 2 bytes are ready at 1.5, 2.0 and 3.0.
    # comm 0.8 each: finish 2.3, 3.1, then max(3.0, 3.1) + 0.8 = 3.9
    assert time_model.step_time(1.0, 2.0, [1, 1, 2], [0.8, 0.8, 0.8]) == pytest.approx(3.9)
    assert time_model.exposed_comm_s(1.0, 2.0, [1, 1, 2], [0.8, 0.8, 0.8]) == pytest.approx(0.9)
    # cheap communication: only the last bucket shows
    assert time_model.step_time(1.0, 2.0, [1, 1, 2], [0.1, 0.1, 0.1]) == pytest.approx(3.1)
    # one bucket: nothing can overlap
    assert time_model.step_time(1.0, 2.0, [4], [0.7]) == pytest.approx(3.7)
    # overlap never loses to no overlap, and never beats compute alone
    args = (1.0, 2.0, [3, 1, 2], [0.9, 0.2, 1.5])
    assert 3.0 <= time_model.step_time(*args) <= time_model.step_time(*args, overlap=False)
    with pytest.raises(ValueError):
        time_model.step_time(1.0, 2.0, [1, 2], [0.5])


def test_compute_time_from_flops():
    # 1e9 parameters, 1000 tokens: 2e12 FLOPs forward, 4e12 backward; at 1e15 x 0.5
    forward, backward = time_model.compute_time_from_flops(1e9, 1000, 1e15, 0.5)
    assert (forward, backward) == (pytest.approx(4e-3), pytest.approx(8e-3))


def test_layer_flops_are_what_torchs_flop_counter_counts():
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.model.transformer import Block, Shape
    shape, batch = Shape(layers=1, hidden=32, heads=4, seq=12, vocab=10), 3
    block = Block(shape)
    with FlopCounterMode(display=False) as counter:
        block(torch.randn(batch, shape.seq, shape.hidden))
    assert counter.get_total_flops() == time_model.layer_forward_flops(shape.seq, batch,
                                                                        shape.hidden)


def test_pipeline_bubble_by_hand():
    # one batch on p stages: only one works at a time
    assert time_model.pipeline_bubble_fraction(4, 1) == 3 / 4
    assert time_model.pipeline_bubble_fraction(1, 7) == 0
    # GPipe's example: p = 4, m = 8 -> 3 idle slots of 11
    assert time_model.pipeline_bubble_fraction(4, 8) == 3 / 11
    # interleaving v = 2 halves the fill and drain: 3 / (16 + 3)
    assert time_model.pipeline_bubble_fraction(4, 8, chunks=2) == 3 / 19
    # fewer micro-batches than stages: one micro-batch's 8 chunks go round the ring twice
    assert time_model.pipeline_bubble_fraction(4, 1, chunks=2) == 6 / 8
    assert time_model.pipeline_bubble_fraction(4, 2, chunks=2) == 5 / 9
    assert time_model.pipeline_bubble_fraction(4, 4, chunks=2) == 3 / 11   # both counts agree


def test_the_pipeline_step_with_no_handoff_is_the_textbook_step():
    # equal forwards F and backwards 2F, no handoff: (m + p - 1)(F + B), both schedules
    for kind in ("gpipe", "1f1b"):
        for p, m in ((1, 3), (2, 1), (3, 5), (4, 2), (4, 8)):
            orders = {s: [(op, i, s) for op, i in schedule_order(kind, p, s, m)]
                      for s in range(p)}
            durations = {s: [1.0 if op == "F" else 2.0 for op, _, _ in orders[s]]
                         for s in range(p)}
            assert time_model.pipeline_step_time(orders, durations) == (m + p - 1) * 3
            assert time_model.pipeline_bubble_with_handoff(orders, durations, 0.0) == \
                pytest.approx(time_model.pipeline_bubble_fraction(p, m))


def test_a_handoff_lies_on_every_edge_of_the_critical_path():
    # m = 1: one micro-batch down and back, 2(p - 1) handoffs exactly. With more
    # micro-batches a message leaves only once its receiver has posted the receive, so a
    # stage still busy with the previous op pays the handoff again: never less than the
    # fill and drain's 2(p - 1), and more as m grows.
    p, handoff = 3, 0.1

    def step(kind, m, latency, before=0.0):
        orders = {s: [(op, i, s) for op, i in schedule_order(kind, p, s, m)] for s in range(p)}
        durations = {s: [1.0 if op == "F" else 2.0 for op, _, _ in orders[s]] for s in range(p)}
        waits = {s: [before] * len(orders[s]) for s in range(p)}
        return time_model.pipeline_step_time(orders, durations, latency, waits)

    for kind in ("gpipe", "1f1b"):
        assert step(kind, 1, handoff) == pytest.approx(p * 3 + 2 * (p - 1) * handoff)
        for m in (2, 5, 8):
            assert step(kind, m, handoff) >= (m + p - 1) * 3 + 2 * (p - 1) * handoff - 1e-9
            assert step(kind, m, handoff) - (m + p - 1) * 3 > \
                step(kind, m - 1, handoff) - (m + p - 2) * 3 - 1e-9
        # what a rank spends before taking each input adds on its own path
        assert step(kind, 5, 0.0, before=0.5) > (5 + p - 1) * 3


def test_a_schedule_whose_ranks_wait_on_each_other_is_refused():
    orders = {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 0, 1), ("B", 0, 1)]}
    durations = {0: [1.0, 1.0], 1: [1.0, 1.0]}
    with pytest.raises(ValueError, match="deadlocks"):
        time_model.pipeline_step_time(orders, durations)


def test_ddp_bucket_caps_have_a_small_first_bucket_only_by_default():
    # torch 2.13's _BucketCapacityConfig: first_bucket_bytes_cap is 1 MiB only when
    # bucket_cap_mb is None; a cap the user sets is every bucket's
    assert time_model.ddp_bucket_caps() == (1 << 20, 25 << 20)
    assert time_model.ddp_bucket_caps(1) == (1 << 20,)
    assert time_model.ddp_bucket_caps(25) == (25 << 20,)


@pytest.mark.parametrize("tied", [False, True])
def test_transformer_tensors_are_the_models_own(tied):
    from labkit.model.transformer import Shape, Transformer
    from labkit.predict import memory_model
    model = Transformer(Shape(layers=2, hidden=16, heads=2, seq=8, vocab=40))
    if tied:
        model.head.out.weight = model.embed.tokens.weight   # one tensor, registered first
    numels = time_model.transformer_param_numels(2, 16, 40, 8, tied_head=tied)
    assert numels == [p.numel() for p in model.parameters()]
    assert sum(numels) == memory_model.transformer_params(2, 16, 40, 8, tied_head=tied)


def test_ddp_buckets_are_the_ones_ddp_rebuilds():
    """After the first iteration DDP rebuilds its buckets in the order the gradients came;
    its logging data holds their sizes. A tied embedding comes last, in a bucket of its own
    that is the largest of the model, and no tensor is split."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from labkit.model.transformer import Shape, Transformer, next_token_loss
    shape = Shape(layers=3, hidden=256, heads=4, seq=32, vocab=3000)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for cap_mb in (None, 1):
            torch.manual_seed(0)
            model = Transformer(shape)
            model.head.out.weight = model.embed.tokens.weight
            wrapped = DDP(model, bucket_cap_mb=cap_mb)
            ids = torch.randint(0, shape.vocab, (2, shape.seq))
            for _ in range(3):   # the order is recorded in the first backward, the buckets
                # rebuilt in the next forward, and logged in the step after
                next_token_loss(wrapped(ids), ids).backward()
            data = wrapped._get_ddp_logging_data()
            assert data["has_rebuilt_buckets"] == 1
            theirs = [int(b) for b in data["rebuilt_bucket_sizes"].replace(",", " ").split()]
            ours = time_model.ddp_bucket_bytes(
                time_model.transformer_param_numels(3, 256, 3000, 32, tied_head=True),
                caps_bytes=time_model.ddp_bucket_caps(cap_mb))
            assert ours == theirs and len(ours) > 1
            assert ours[-1] >= 4 * shape.vocab * shape.hidden == max(
                4 * p.numel() for p in model.parameters())
            del wrapped, model
    finally:
        dist.destroy_process_group()


def test_optimizer_step_by_hand():
    # 1e9 parameters x 28 bytes at 2.8e12 bytes/s: 10 ms
    assert time_model.optimizer_step_s(10**9, 2.8e12) == pytest.approx(0.010)

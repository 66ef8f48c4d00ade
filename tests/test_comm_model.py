"""Communication cost models, checked by hand-computed cases."""

import math
from fractions import Fraction

import pytest
import torch

from labkit.predict import comm_model


def test_chunks_cover_the_tensor_and_differ_by_at_most_one():
    for numel in (1, 2, 3, 7, 1000003):
        for n in (1, 2, 3, 4, 5, 8):
            bounds = comm_model.chunk_bounds(numel, n)
            sizes = [b - a for a, b in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
            assert max(sizes) - min(sizes) <= 1


def test_fewer_elements_than_ranks_leaves_empty_chunks():
    assert comm_model.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_bytes_equal_2_n_minus_1_over_n_when_divisible(n):
    numel = 1024 * n
    expected = 2 * (n - 1) / n * numel * 4
    assert all(comm_model.ring_allreduce_bytes_sent(numel, n, r) == expected for r in range(n))


def test_ring_bytes_with_unequal_chunks_by_hand():
    # numel 10 over 3 ranks: chunks of 4, 3, 3. Rank 0 sends every chunk twice except
    # chunks 1 and 2: 2*10 - 3 - 3 = 14 elements; rank 1 skips chunks 2 and 0: 20 - 3 - 4 = 13.
    assert comm_model.ring_allreduce_elements_sent(10, 3, 0) == 14
    assert comm_model.ring_allreduce_elements_sent(10, 3, 1) == 13
    assert comm_model.ring_allreduce_elements_sent(10, 3, 2) == 13
    assert comm_model.ring_allreduce_elements_sent(10, 1, 0) == 0


def test_bus_bandwidth_factors():
    # 1 GB in 1 s on 8 ranks: all-reduce busbw = 2*7/8 GB/s, all-gather 7/8, broadcast 1
    # (nccl-tests' doc/PERFORMANCE.md; alltoall's factor is (n-1)/n as for all-gather)
    assert comm_model.bus_bandwidth("all_reduce", 1e9, 1.0, 8) == pytest.approx(1.75e9)
    assert comm_model.bus_bandwidth("all_gather", 1e9, 1.0, 8) == pytest.approx(0.875e9)
    assert comm_model.bus_bandwidth("reduce_scatter", 1e9, 1.0, 8) == pytest.approx(0.875e9)
    assert comm_model.bus_bandwidth("all_to_all", 1e9, 1.0, 8) == pytest.approx(0.875e9)
    assert comm_model.bus_bandwidth("broadcast", 1e9, 1.0, 8) == pytest.approx(1e9)
    assert comm_model.bus_bandwidth("reduce", 1e9, 1.0, 8) == pytest.approx(1e9)


def test_broadcast_and_reduce_have_a_root():
    # a chain of 4: the root of a broadcast sends all of S, the last rank nothing; the
    # mean over ranks is 3/4 S. The root of a reduce receives the sum and sends nothing.
    assert comm_model.bytes_sent_by_root("broadcast", 8e9, 4) == 8e9
    assert comm_model.bytes_sent_per_rank("broadcast", 8e9, 4) == pytest.approx(6e9)
    assert comm_model.bytes_sent_by_root("reduce", 8e9, 4) == 0
    assert comm_model.bytes_sent_per_rank("reduce", 8e9, 4) == pytest.approx(6e9)
    assert comm_model.bytes_sent_by_root("broadcast", 8e9, 1) == 0
    with pytest.raises(ValueError):
        comm_model.bytes_sent_by_root("all_reduce", 8e9, 4)


def test_alpha_beta_time_and_fit_recover_the_model():
    alpha, beta, n = 5e-6, 2e9, 4
    # 2(N-1) alpha + 2(N-1)/N S / beta, by hand for S = 1 MB
    assert comm_model.allreduce_time(1e6, n, alpha, beta) == pytest.approx(6 * 5e-6 + 1.5e6 / 2e9)
    sizes = [2 ** k for k in range(10, 28, 2)]
    times = [comm_model.allreduce_time(s, n, alpha, beta) for s in sizes]
    fitted_alpha, fitted_beta = comm_model.fit_alpha_beta(sizes, times, n)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(beta, rel=1e-6)


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(ValueError):
        comm_model.fit_alpha_beta([1, 2], [1.0, 2.0], 1)
    with pytest.raises(ValueError):
        comm_model.fit_alpha_beta([1], [1.0], 4)
    # a larger message measured faster than a smaller one: noise, not a bandwidth
    with pytest.raises(ValueError, match="do not grow"):
        comm_model.fit_alpha_beta([4096, 2 ** 20], [2e-3, 1e-3], 2)


@pytest.mark.parametrize("text, value", [("4K", 4096), ("64k", 65536), ("1M", 2 ** 20),
                                         ("2G", 2 * 2 ** 30), ("100", 100)])
def test_parse_size(text, value):
    assert comm_model.parse_size(text) == value


@pytest.mark.parametrize("text", ["4X", "M", "1.5M", "-4K", ""])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        comm_model.parse_size(text)


def test_one_gigabyte_on_eight_gpus_by_hand():
    # The chapter's worked example: S = 1 GB, N = 8 -> each rank sends 1.75 GB.
    assert math.isclose(comm_model.ring_allreduce_bytes_sent(250_000_000, 8, 0), 1.75e9)


def test_bytes_per_rank_by_collective():
    assert comm_model.bytes_sent_per_rank("all_reduce", 8e9, 8) == pytest.approx(14e9)
    assert comm_model.bytes_sent_per_rank("all_gather", 8e9, 8) == pytest.approx(7e9)
    assert comm_model.bytes_sent_per_rank("reduce_scatter", 8e9, 8) == pytest.approx(7e9)
    assert comm_model.bytes_sent_per_rank("all_to_all", 8e9, 8) == pytest.approx(7e9)
    assert comm_model.bytes_sent_per_rank("all_reduce", 8e9, 1) == 0


def test_ring_and_tree_times_cross_where_the_formula_says():
    n, alpha, beta = 64, 10e-6, 50e9
    crossover = comm_model.ring_tree_crossover_bytes(n, alpha, beta)
    # by hand: 64 * 50e9 * 10e-6 * (63 - 6) = 1.824e9 bytes
    assert crossover == pytest.approx(64 * 50e9 * 10e-6 * 57)
    ring = comm_model.allreduce_time(crossover, n, alpha, beta)
    tree = comm_model.tree_allreduce_time(crossover, n, alpha, beta)
    assert ring == pytest.approx(tree)
    assert comm_model.allreduce_time(crossover * 2, n, alpha, beta) < \
        comm_model.tree_allreduce_time(crossover * 2, n, alpha, beta)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_data_parallel_bytes_by_hand(n):
    # DDP: one all-reduce, 2(N-1)/N x 4 psi; ZeRO-3: two all-gathers and a reduce-scatter
    # of the padded count, 3(N-1)/N x 4 psi'. Exact fractions, whatever N.
    psi = 1009   # prime: no N above divides it
    assert comm_model.data_parallel_bytes_per_rank("ddp", psi, n) == Fraction(2 * (n - 1) * 4 * psi, n)
    assert comm_model.data_parallel_bytes_per_rank("zero3", psi, n) == Fraction(3 * (n - 1) * 4 * psi, n)
    assert comm_model.data_parallel_bytes_per_rank("ddp", psi, n, value_bytes=2) == Fraction(
        2 * (n - 1) * 2 * psi, n)


def test_the_counter_adds_what_each_collective_sends():
    counter = comm_model.CollectiveCounter(world_size=4)
    counter.add("all_gather", torch.empty(10))          # 40 bytes: 3/4 of it = 30
    counter.add("all_gather", torch.empty(2, 5))
    counter.add("reduce_scatter", torch.empty(3, dtype=torch.float64))   # 24 bytes: 18
    counter.add("all_reduce", torch.empty(1))            # 4 bytes: 2 x 3/4 x 4 = 6
    assert counter.counts == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}
    assert counter.sent == 30 + 30 + 18 + 6
    counter.reset()
    assert counter.sent == 0 and counter.counts == {}


def test_zero1_in_torch_sends_half_as_much_again_as_the_papers():
    # ZeroRedundancyOptimizer: DDP's all-reduce, then every partition broadcast: 3(N-1)/N;
    # the paper's ZeRO-1 and ZeRO-2: a reduce-scatter and an all-gather, 2(N-1)/N like DDP.
    psi, n = 1000, 4
    ddp = comm_model.data_parallel_bytes_per_rank("ddp", psi, n)
    assert comm_model.data_parallel_bytes_per_rank("zero1", psi, n) == ddp
    assert comm_model.data_parallel_bytes_per_rank("zero2", psi, n) == ddp
    assert comm_model.data_parallel_bytes_per_rank("zero1_torch", psi, n) == Fraction(3, 2) * ddp


def test_bytes_per_network_card_by_hand():
    # 7B parameters in bf16 on 16 nodes of 8: full sharding runs rings over all 128 GPUs,
    # one channel per card; hybrid sharding all-reduces a 1/8 share across the 16 nodes.
    s, g, m = 14e9, 8, 16
    full = comm_model.internode_bytes_per_nic("full_shard", s, g, m)
    hybrid = comm_model.internode_bytes_per_nic("hybrid_shard", s, g, m)
    assert full == pytest.approx(3 * 127 / 128 * s / 8)
    assert hybrid == pytest.approx(2 * 15 / 16 * s / 8)
    assert full / hybrid == pytest.approx(1.5875)
    # DDP's flat ring through all 128 ranks: a little more than hybrid sharding's 1/8 share
    assert comm_model.internode_bytes_per_nic("ddp", s, g, m) == pytest.approx(2 * 127 / 128 * s / 8)
    with pytest.raises(ValueError):
        comm_model.internode_bytes_per_nic("zero2", s, g, m)


def test_tensor_parallel_collectives_are_megatrons_four_per_layer():
    layers, seq, batch, hidden, t = 3, 16, 2, 8, 4
    sbh = seq * batch * hidden
    plan = comm_model.tensor_parallel_collectives(layers, seq, batch, hidden, t)
    # per layer 2 forward (g) and 2 backward (f); the embedding's g and the head's f; the
    # cross-entropy's three all-reduces of one value per token
    assert plan == [("all_reduce", sbh)] * (4 * layers + 2) + [("all_reduce", seq * batch)] * 3
    buggy = comm_model.tensor_parallel_collectives(layers, seq, batch, hidden, t,
                                                   f_backward=False)
    assert len(buggy) == 2 * layers + 1 + 3


def test_sequence_parallel_f_and_g_send_what_the_all_reduces_sent():
    layers, seq, batch, hidden = 2, 12, 1, 6
    sbh = seq * batch * hidden
    for t in (2, 3, 4):
        tp = comm_model.torch_tensor_parallel_collectives(layers, seq, batch, hidden, t)
        sp = comm_model.torch_tensor_parallel_collectives(layers, seq, batch, hidden, t, True)
        tp_sent = comm_model.collectives_summary(tp, t)[0]
        sp_activations = [(op, n) for op, n in sp if n == sbh]
        # the same volume per layer, plus the head's gather and the first block's split
        assert comm_model.collectives_summary(sp_activations, t)[0] == tp_sent + 2 * Fraction(
            (t - 1) * sbh * 4, t)
        # the LayerNorms' partial gradients: 4 vectors of h per layer, all-reduced
        assert [op for op, n in sp if n == hidden] == ["all_reduce"] * 4 * layers
    assert comm_model.torch_tensor_parallel_collectives(layers, seq, batch, hidden, 1) == []


def test_collectives_summary_counts_and_sums_exactly():
    plan = [("all_reduce", 10), ("all_gather", 10), ("all_reduce", 3)]
    sent, counts = comm_model.collectives_summary(plan, 3, value_bytes=2)
    assert counts == {"all_reduce": 2, "all_gather": 1}
    assert sent == Fraction(2 * 2 * 20, 3) + Fraction(20 * 2, 3) + Fraction(2 * 2 * 6, 3)


def test_pipeline_p2p_bytes_by_hand():
    # 4 stages, 8 micro-batches of 1000 fp32 values: the ends send one way, the rest both
    assert comm_model.pipeline_p2p_bytes_per_rank(4, 8, 1000) == [32000, 64000, 64000, 32000]
    assert comm_model.pipeline_p2p_bytes_per_rank(1, 8, 1000) == [0]
    # interleaved, v = 2: rank 0 holds pieces 0 and 4 of 8 (sends 1 + 2), rank 3 pieces 3, 7
    assert comm_model.pipeline_p2p_bytes_per_rank(4, 8, 1000, chunks=2) == [
        3 * 32000, 4 * 32000, 4 * 32000, 3 * 32000]



def test_a_v_sends_nothing_across_its_tip():
    """ZB-V's layout on 4 ranks: rank r holds pieces r and 7 - r. Rank 0: piece 0 sends
    forward, piece 7 back; rank 3 holds the tip (3 and 4), each of whose other sends
    crosses (3 back to rank 2, 4 forward to rank 2); ranks 1 and 2 send all four ways."""
    assert [comm_model.pipeline_piece_owner(g, 4, "v") for g in range(8)] == [
        0, 1, 2, 3, 3, 2, 1, 0]
    assert comm_model.pipeline_p2p_bytes_per_rank(4, 8, 1000, 2, layout="v") == [
        2 * 32000, 4 * 32000, 4 * 32000, 2 * 32000]
    with pytest.raises(ValueError, match="two pieces per rank"):
        comm_model.pipeline_p2p_bytes_per_rank(4, 8, 1000, 3, layout="v")

def test_layer_boundaries_crossed():
    assert comm_model.layer_boundaries_crossed(24, 4, "contiguous") == 3
    assert comm_model.layer_boundaries_crossed(24, 4, "round_robin") == 23
    assert comm_model.layer_boundaries_crossed(24, 1, "round_robin") == 0


def test_data_parallel_step_collectives_add_what_accumulation_costs():
    numel, n = 1200, 4
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        one = comm_model.collectives_summary(
            comm_model.data_parallel_step_collectives(strategy, numel), n)[0]
        assert one == comm_model.data_parallel_bytes_per_rank(strategy, numel, n)
    m, units = 5, 3
    sent = lambda s: comm_model.collectives_summary(  # noqa: E731
        comm_model.data_parallel_step_collectives(s, numel, m, units), n)[0]
    ring = Fraction(n - 1, n) * numel * 4
    assert sent("ddp") == sent("zero1") == 2 * ring          # once per step, whatever m
    assert sent("zero2") == (m + 1) * ring                    # a reduce-scatter per micro-batch
    assert sent("zero3") == 3 * m * ring                      # every unit, every micro-batch
    counts = comm_model.collectives_summary(
        comm_model.data_parallel_step_collectives("zero3", numel, m, units), n)[1]
    assert counts == {"all_gather": 2 * m * units, "reduce_scatter": m * units}


def test_a_pipeline_stage_issues_only_its_own_tensor_parallel_collectives():
    layers, seq, batch, hidden, t = 6, 8, 2, 16, 2
    whole = comm_model.tensor_parallel_collectives(layers, seq, batch, hidden, t)
    first = comm_model.tensor_parallel_collectives(2, seq, batch, hidden, t, head=False)
    middle = comm_model.tensor_parallel_collectives(2, seq, batch, hidden, t, embedding=False,
                                                    head=False)
    last = comm_model.tensor_parallel_collectives(2, seq, batch, hidden, t, embedding=False)
    assert sorted(first + middle + last) == sorted(whole)
    for sp in (False, True):
        stages = [comm_model.tensor_parallel_collectives(3, seq, batch, hidden, t, sp,
                                                         embedding=e, head=h)
                  for e, h in ((True, False), (False, True))]
        total = sum(comm_model.collectives_summary(s, t)[0] for s in stages)
        assert total == comm_model.collectives_summary(comm_model.tensor_parallel_collectives(
            layers, seq, batch, hidden, t, sp), t)[0]


def test_node_limited_dispatch_by_hand():
    # 8 experts on 4 nodes (2 each), home node 0: a token to experts {1, 2} reaches node 1
    # once (node 0 is home); {2, 3} node 1 once, not twice; {4, 7} nodes 2 and 3
    ids = [[1, 2], [2, 3], [4, 7], [0, 1]]
    assert comm_model.node_dispatch_rows(ids, 8, 4, home_node=0) == 1 + 1 + 2 + 0
    # one row per (token, expert) pair away from home would be 1 + 2 + 2 + 0
    # uniform routing, E = 4 on 2 nodes, k = 2: the other node is missed only when both
    # experts are home, C(2, 2) / C(4, 2) = 1/6: 5/6 copies a token
    assert comm_model.expected_network_copies(4, 2, 2) == Fraction(5, 6)
    assert comm_model.expected_network_copies(4, 2, 2, once_per_node=False) == 1
    # DeepSeek-V3's 256 experts on 8 nodes, 8 per token, at most 4 nodes: 4 x 7/8 at most
    assert comm_model.expected_network_copies(256, 8, 8, node_limit=4) == Fraction(7, 2)
    assert comm_model.expected_network_copies(256, 8, 8, once_per_node=False) == 7
    assert comm_model.node_limited_dispatch_bytes(10, 3, 2, 4, 2) == 10 * 3 * 2 * Fraction(5, 6)


def test_expected_network_copies_match_a_count_of_random_routings():
    rng = torch.Generator().manual_seed(0)
    experts, nodes, k, tokens = 64, 8, 6, 20000
    ids = torch.rand(tokens, experts, generator=rng).topk(k).indices.tolist()
    counted = comm_model.node_dispatch_rows(ids, experts, nodes, home_node=3) / tokens
    expected = float(comm_model.expected_network_copies(experts, nodes, k))
    assert counted == pytest.approx(expected, rel=0.01)


def test_tree_is_the_double_binary_trees_2s():
    # 2S / beta whatever N (2 ceil(log2 N) latencies): at N = 5, 6 alphas + 2S / beta
    assert comm_model.tree_allreduce_time(1e9, 5, 1e-6, 1e9) == pytest.approx(6e-6 + 2.0)
    # more than the ring's bandwidth term at every N > 1 (2(N-1)/N < 2)
    for n in (2, 8, 1024):
        assert comm_model.tree_allreduce_time(1e9, n, 0.0, 1e9) > \
            comm_model.allreduce_time(1e9, n, 0.0, 1e9)

"""The context-parallel lab: ring, all-gather and Ulysses attention against one process,
every byte, kept attention matrix and attention FLOP against the cost models. The chapter
runs N = 4 and 2 and asserts the same (context_parallel.md, hidden cells); here N = 3 (odd)
and 1, in one launch (--sub-worlds), the refusals, and the cost models by hand. (A missing peer:
test_distenv, since every lab forms its group through distenv.)"""

from fractions import Fraction

import pytest

import context_parallel
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.predict import comm_model, memory_model, time_model
from labkit.runtime.launch import run_lab
from labkit.model.transformer import Shape

SHAPE, BATCH = context_parallel.SHAPE, context_parallel.BATCH
L, H, A, S, V = SHAPE.layers, SHAPE.hidden, SHAPE.heads, SHAPE.seq, SHAPE.vocab
CORRECT = ("ring", "allgather", "ulysses")


@pytest.fixture(scope="module")
def launch():
    """N = 3, then N = 1 on rank 0 alone (--sub-worlds) in the same launch."""
    return run_lab("context_parallel", 3, ["--sub-worlds", 1], echo=False)


@pytest.fixture(scope="module", params=[3, 1])
def result(request, launch):
    """The launch's result at N = 3, or at N = 1 with the launch's metadata."""
    return launch if request.param == 3 else dict(launch, **launch["sub_worlds"][0])


def test_the_result_says_where_it_came_from(result, launch):
    assert_lab_metadata(result, "context_parallel")
    assert [sub["world_size"] for sub in launch["sub_worlds"]] == [1]
    assert result["cp"] == result["world_size"] and result["layout"] == "zigzag"
    assert result["args"]["steps"] == context_parallel.STEPS
    ran = set(result["variants"]) | set(result["skipped"])
    assert ran == set(context_parallel.VARIANTS)


def test_correct_variants_match_one_process_and_the_pitfalls_do_not(result):
    n = result["cp"]
    for name, v in result["variants"].items():
        if name in CORRECT or name == "torch_cp" or (name == "ring_local_mask" and n == 1):
            assert v["expected_equal"] and v["max_param_diff"] <= 1e-5, (n, name)
        else:   # the unscaled merge is wrong even on one rank: two chunks still merge
            assert not v["expected_equal"] and v["max_param_diff"] > 1e-4, (n, name)
    if result["device"] == "cpu":
        assert result["skipped"] == {"torch_cp": context_parallel.TORCH_CP_ON_CPU}


def test_bytes_collectives_and_kept_attention_by_hand(result):
    n, variants = result["cp"], result["variants"]
    psi = memory_model.transformer_params(L, H, V, S)
    grads = Fraction(2 * (n - 1), n) * 4 * psi       # the gradients' ring all-reduce
    sbh = S * BATCH * H
    for v in variants.values():
        if v["predicted_collectives"] is not None:
            assert v["collectives"] == v["predicted_collectives"]
            assert v["comm_bytes_per_rank"] == v["predicted_comm_bytes_per_rank"]
    ring = variants["ring"]
    assert ring["collectives"] == ({"all_reduce": 1} if n == 1 else
                                   {"send": 2 * (n - 1) * L, "recv": 2 * (n - 1) * L,
                                    "all_reduce": 1})
    # K and V of s/N tokens, forward, then their gradients back: 2 (N-1) sends per layer
    assert ring["comm_bytes_per_rank"] == round(grads + L * 2 * (n - 1) * 4 * 2 * sbh / n)
    assert variants["allgather"]["comm_bytes_per_rank"] == ring["comm_bytes_per_rank"]
    assert variants["ulysses"]["comm_bytes_per_rank"] == round(
        grads + L * 2 * Fraction(n - 1, n) * 4 * (3 * sbh + sbh) / n)
    # attention probabilities kept over the L layers, fp32, the same on every rank
    c = S // (2 * n)
    assert variants["allgather"]["activation_bytes_per_rank"] == [4 * L * A * S // n * S
                                                                  * BATCH] * n
    assert variants["ulysses"]["activation_bytes_per_rank"] == [4 * L * A // n * S * S * BATCH] * n
    assert variants["ring"]["activation_bytes_per_rank"] == [4 * L * A * c * c * BATCH
                                                             * (2 * n + 1)] * n
    for name in CORRECT:
        v = variants[name]
        assert v["activation_bytes_per_rank"] == v["predicted_activation_bytes_per_rank"]


def test_attention_flops_contiguous_unbalanced_zigzag_balanced(result):
    n = result["cp"]
    flops = result["attention_flops_by_rank"]
    assert flops == result["predicted_attention_flops_by_rank"]
    block = 4 * BATCH * (S // n) ** 2 * H            # one s/N x s/N block, both products
    assert flops["contiguous"] == [block * (r + 1) for r in range(n)]
    assert flops["zigzag"] == [block // 4 * (2 * n + 1)] * n


def test_a_split_the_degree_cannot_make_is_refused_in_one_line():
    check = context_parallel.check_split
    with pytest.raises(SystemExit, match=r"error: --seq 20 does not split into 8 equal "
                                         r"chunks \(the zigzag layout over 4 ranks\)$"):
        check(Shape(L, H, A, 20, V), ["ring"], 4)
    check(Shape(L, H, A, 20, V), ["ring"], 4, layout="contiguous")   # 4 chunks of 5
    with pytest.raises(SystemExit, match="--seq 21 does not split into 2 equal chunks"):
        check(Shape(L, H, A, 21, V), ["ring"], 2, layout="contiguous")
    with pytest.raises(SystemExit, match="--heads 10 does not split over 4 ranks: ulysses"):
        check(Shape(L, 40, 10, 24, V), ["ring", "ulysses"], 4)
    check(Shape(L, 40, 10, 24, V), ["ring", "allgather"], 4)   # without Ulysses it runs


def test_bad_options_are_refused_in_one_line(script):
    parse = context_parallel.parse_args
    assert_refused(parse, ["--steps", 0], "--steps must be at least 1")
    assert_refused(parse, ["--variants", "ring,bogus"], "invalid choice: 'bogus'")
    assert_refused(parse, ["--hidden", 50, "--heads", 12],
                   "--hidden 50 is not divisible by --heads 12")



# the cost models, by hand

def test_layouts_and_causal_work():
    assert time_model.context_parallel_chunks(3, "zigzag") == [[0, 5], [1, 4], [2, 3]]
    assert time_model.context_parallel_chunks(3, "contiguous") == [[0], [1], [2]]
    assert time_model.causal_chunk_pairs(4, "contiguous") == [1, 2, 3, 4]
    assert time_model.causal_chunk_pairs(4, "zigzag") == [9] * 4
    # s = 16, b = 1, h = 8, N = 2: blocks of 8 tokens cost 4 * 64 * 8 FLOPs
    assert time_model.ring_attention_flops_by_rank(16, 1, 8, 2, "contiguous") == [2048, 4096]
    assert time_model.ring_attention_flops_by_rank(16, 1, 8, 2, "zigzag") == [2560, 2560]
    with pytest.raises(ValueError, match="unknown layout"):
        time_model.context_parallel_chunks(2, "striped")


def test_bytes_per_layer_by_hand():
    values = comm_model.context_parallel_layer_values
    # s = 8, b = 1, h = 4, N = 4: the ring and the all-gather 4 * 3/4 * 32, Ulysses
    # 2 * 3/16 * 8 * (8 + 8)
    assert values("ring", 8, 1, 4, 4) == values("allgather", 8, 1, 4, 4) == 96
    assert values("ulysses", 8, 1, 4, 4) == 48
    assert values("allgather", 8, 1, 4, 4, kv_hidden=1) == 24           # GQA: 1/4 of it
    assert values("ring", 8, 1, 4, 1) == values("ulysses", 8, 1, 4, 1) == 0
    # a training step's plan adds up to L layers of it and the gradients' all-reduce
    for method in comm_model.CP_METHODS:
        plan = comm_model.context_parallel_collectives(method, 3, 8, 1, 4, 4, params=100)
        sent, _ = comm_model.collectives_summary(plan, 4, value_bytes=1)
        assert sent == 3 * values(method, 8, 1, 4, 4) + Fraction(3, 2) * 100


def test_kept_attention_and_llama_layer_by_hand():
    kept = memory_model.context_parallel_attention_matrix_bytes
    assert kept("allgather", 8, 1, 2, 2, value_bytes=1) == [2 * 4 * 8] * 2
    assert kept("ulysses", 8, 1, 2, 2, value_bytes=1) == [1 * 8 * 8] * 2
    assert kept("ring", 8, 1, 2, 2, value_bytes=1) == [2 * 2 * 2 * 5] * 2   # 2N+1 blocks of 2x2
    assert kept("ring", 8, 1, 1, 2, "contiguous", value_bytes=1) == [16, 32]
    # at N = 1 the all-gather keeps the whole layer's matrix, a s^2 b values
    assert kept("allgather", 8, 2, 3, 1, value_bytes=1) == [3 * 64 * 2]
    layer = memory_model.context_parallel_layer_activation_bytes
    # 4 tokens per rank: 16 sbh values over t = 2, and the matrix's a (s/N) s b over t
    assert layer(16, 1, 8, 2, 4, 2, attention_matrix=True, value_bytes=1) == (
        16 * 4 * 8 / 2 + 2 * 4 * 16 / 2)
    assert layer(16, 1, 8, 2, 4, 2) == 2 * 16 * 4 * 8 / 2 + 4 * 2 * 4 / 2


def test_ring_overlap_threshold_by_hand():
    # n >= v h_kv R / (2 h beta): 2 bytes, R = 1e15, beta = 1e11, MHA -> 10,000 tokens
    assert time_model.ring_overlap_min_tokens(8, 8, 1e15, 1e11) == pytest.approx(10000)
    assert time_model.ring_overlap_min_tokens(8, 1, 1e15, 1e11) == pytest.approx(1250)
    # causal, zig-zag: each step after the first computes 2 of its 4 chunk pairs, half a
    # block, so the threshold doubles
    assert time_model.ring_overlap_min_tokens(8, 8, 1e15, 1e11, causal=True) == \
        pytest.approx(20000)
    n = 4
    pairs_after_step_0 = time_model.causal_chunk_pairs(n, "zigzag")[0] - 3   # step 0: 3 pairs
    assert pairs_after_step_0 == 2 * (n - 1)                                  # 2 per step


def test_ring_implementations_by_hand():
    ring = comm_model.ring_attention_layer_bytes
    # s = 8, b = 1, N = 4, h_kv = 2, bf16: a hop passes K and V of 2 tokens, 8 values
    assert ring("lab", 8, 1, 4, 2) == 2 * 3 * 8 * 2 == 96          # 2 (N-1) hops
    assert ring("lab", 8, 1, 4, 2) == 2 * comm_model.context_parallel_layer_values(
        "ring", 8, 1, 2, 4)
    assert ring("liu", 8, 1, 4, 2) == 6 * 8 * 2 * 2 == 192         # N + 2N hops: 6 s b h_kv
    assert ring("torch", 8, 1, 4, 2) == 96 + 4 * 8 * 4 == 224      # + N hops of dK, dV in fp32
    assert ring("torch", 8, 1, 1, 2) == ring("liu", 8, 1, 1, 2) == 0
    with pytest.raises(ValueError, match="unknown implementation"):
        ring("deepspeed", 8, 1, 4, 2)


def test_ulysses_copies_too_few_key_value_heads_by_hand():
    ulysses = comm_model.ulysses_layer_values
    # s = 8, b = 1, h = 8, N = 4: 2 (N-1)/N^2 s = 3; one key-value head of 2
    assert ulysses(8, 1, 8, 4, 2) == 3 * (16 + 4) == 60                     # split 4 ways
    assert ulysses(8, 1, 8, 4, 2, kv_heads=1) == 3 * (16 + 2 * 2 * 4) == 96  # copied 4 times
    assert ulysses(8, 1, 8, 4, 8, kv_heads=4) == ulysses(8, 1, 8, 4, 8) == 96
    assert comm_model.context_parallel_layer_values("ulysses", 8, 1, 8, 4, 2) == 60
    assert ulysses(12, 1, 6, 6, 3, kv_heads=3) == ulysses(12, 1, 6, 6, 6)    # copied twice
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        ulysses(8, 1, 8, 4, 6, kv_heads=6)
    with pytest.raises(ValueError, match="neither split nor copied"):
        ulysses(12, 1, 6, 6, 4, kv_heads=4)


def test_hybrid_of_ulysses_and_ring_by_hand():
    hybrid = comm_model.hybrid_context_parallel_layer_values
    # s = 16, b = 1, h = h_kv = 8, u = r = 2 (N = 4):
    # 2 (u-1)/(u N) s (2h + 2h_kv) = 2/8 * 16 * 32 and 4 (r-1)/N s h_kv = 4/4 * 16 * 8
    assert hybrid(16, 1, 8, 2, 2) == {"ulysses": 128, "ring": 128}
    values = comm_model.context_parallel_layer_values
    assert hybrid(16, 1, 8, 1, 4) == {"ulysses": 0, "ring": values("ring", 16, 1, 8, 4)}
    assert hybrid(16, 1, 8, 4, 1) == {"ulysses": values("ulysses", 16, 1, 8, 4), "ring": 0}
    # one key-value head of 2 and u = 2: copied twice, h_kv' = 4, and each GPU's ring
    # passes its one head: 4 (r-1)/N s h_kv' = 4/4 * 16 * 4
    assert hybrid(16, 1, 8, 2, 2, kv_hidden=2, kv_heads=1) == {
        "ulysses": Fraction(2, 8) * 16 * (16 + 8), "ring": 16 * 4}


def test_attention_products_flops_by_hand():
    # s = 4, b = 1, h = 2: one product 2 * 4 * 4 * 2 = 64 FLOPs
    assert time_model.attention_products_flops(4, 1, 2) == {"forward": 128, "backward": 320}
    assert time_model.attention_products_flops(4, 1, 2, fused=False) == {"forward": 128,
                                                                          "backward": 256}
    assert time_model.attention_products_flops(4, 1, 2, kv_seq=8)["forward"] == 256


def test_packed_documents_balance_per_document_by_hand():
    pairs = time_model.document_causal_pairs_by_rank
    # one document of 16, N = 2, chunks of 4: 10, 26, 42, 58 pairs; zig-zag 10 + 58, 26 + 42
    assert pairs([16], 2, "zigzag") == pairs([16], 2, "per_document") == [68, 68]
    # documents of 12 and 4: chunks 10, 26, 42 (the 12's) and 10 (the 4's)
    assert pairs([12, 4], 2, "zigzag") == [10 + 10, 26 + 42]
    # per document: the 12 in chunks of 3 (6, 15, 24, 33), the 4 in chunks of 1 (1, 2, 3, 4)
    assert pairs([12, 4], 2, "per_document") == [6 + 33 + 1 + 4, 15 + 24 + 2 + 3]
    with pytest.raises(ValueError, match="every document must split into 4 chunks"):
        pairs([10, 6], 2, "per_document")
    with pytest.raises(ValueError, match="unknown layout"):
        pairs([16], 2, "striped")


def test_torchs_per_document_balancer_cuts_its_order_contiguously():
    """torch's _PerDocumentHeadTailLoadBalancer orders each document's chunks head-tail,
    document after document, and _context_parallel_buffers cuts that order into N pieces:
    [4, 8, 4] at N = 2 gives rank 0 positions [0, 3, 1, 2, 4, 5, 10, 11]."""
    pairs = time_model.document_causal_pairs_by_rank
    # [4, 8, 4]: rank 0 the first 4 (10) and the 8's positions 0, 1, 6, 7 (1 + 2 + 7 + 8)
    assert pairs([4, 8, 4], 2, "torch_per_document") == [10 + 18, 18 + 10]
    assert pairs([4, 4, 8], 2, "torch_per_document") == [10 + 10, 36]       # unbalanced
    assert pairs([4, 4, 8], 2, "per_document") == [28, 28]
    assert pairs([16], 2, "torch_per_document") == pairs([16], 2, "per_document")
    balancer = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for docs, cp in (([4, 8, 4], 2), ([4, 4, 8], 2), ([8, 16, 24, 8], 4), ([12, 6], 3)):
        order = balancer._PerDocumentHeadTailLoadBalancer([docs], cp, "cpu")._generate_indices()
        order = order[0].tolist()
        if docs == [4, 8, 4]:
            assert order[:8] == [0, 3, 1, 2, 4, 5, 10, 11]
        start = [sum(docs[:i]) for i in range(len(docs)) for _ in range(docs[i])]
        piece = sum(docs) // cp
        assert pairs(docs, cp, "torch_per_document") == [
            sum(p - start[p] + 1 for p in order[r * piece:(r + 1) * piece]) for r in range(cp)]

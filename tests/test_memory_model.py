"""Memory cost models, against the ZeRO paper's numbers, torch's own layouts and hand counts."""

import pytest
import torch

from labkit.predict import memory_model
from labkit.parallel.strategies import FSDP_FAMILY
from labkit.model.transformer import Shape, Transformer

GB = 1e9


def test_zero_paper_worked_example():
    # Rajbhandari et al. 2020, Figure 1: psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam)
    totals = {s: memory_model.state_bytes_per_gpu(7.5e9, 64, s, "adam", "mixed")["total"]
              for s in memory_model.STRATEGIES}
    assert totals["ddp"] == 120 * GB
    assert round(totals["zero1"] / GB, 1) == 31.4
    assert round(totals["zero2"] / GB, 1) == 16.6
    assert round(totals["zero3"] / GB, 2) == 1.88


@pytest.mark.parametrize("optimizer, precision, expected", [
    ("adam", "mixed", (2, 2, 12)),     # fp32 master + momentum + variance: the paper's K = 12
    ("momentum", "mixed", (2, 2, 8)),
    ("sgd", "mixed", (2, 2, 4)),       # the master copy alone
    ("adam", "fp32", (4, 4, 8)),
    ("momentum", "fp32", (4, 4, 4)),
    ("sgd", "fp32", (4, 4, 0)),
])
def test_bytes_per_parameter(optimizer, precision, expected):
    assert memory_model.bytes_per_parameter(optimizer, precision) == expected


def test_each_stage_shards_one_more_state():
    psi, n = 1000, 8
    by = {s: memory_model.state_bytes_per_gpu(psi, n, s, "adam", "fp32")
          for s in memory_model.STRATEGIES}
    assert by["ddp"] == {"params": 4000, "grads": 4000, "optimizer": 8000, "total": 16000}
    assert by["zero1"] == {"params": 4000, "grads": 4000, "optimizer": 1000, "total": 9000}
    assert by["zero2"] == {"params": 4000, "grads": 500, "optimizer": 1000, "total": 5500}
    assert by["zero3"] == {"params": 500, "grads": 500, "optimizer": 1000, "total": 2000}


def test_one_gpu_shards_nothing():
    rows = [memory_model.state_bytes_per_gpu(12345, 1, s) for s in memory_model.STRATEGIES]
    assert all(row == rows[0] for row in rows)


@pytest.mark.parametrize("bad", [
    dict(params=-1, gpus=4, strategy="ddp"),
    dict(params=10, gpus=0, strategy="ddp"),
    dict(params=10, gpus=4, strategy="zero4"),
    dict(params=10, gpus=4, strategy="ddp", optimizer="lion"),
    dict(params=10, gpus=4, strategy="ddp", precision="fp8"),
])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        memory_model.state_bytes_per_gpu(**bad)


@pytest.mark.parametrize("shape", [Shape(2, 192, 4, 192, 384), Shape(3, 36, 3, 7, 11)])
def test_transformer_params_counts_the_model(shape):
    model = Transformer(shape)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab,
                                                      shape.seq)


def test_activations_per_layer_is_korthikanti_formula_in_16_bit_with_dropout():
    s, b, h, a = 2048, 4, 1024, 16
    assert memory_model.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_activations_without_dropout_in_fp32_by_hand():
    s, b, h, a = 10, 2, 8, 2
    # 16 sbh values + a s^2 b softmax values, 4 bytes each
    assert memory_model.activation_bytes_per_layer(s, b, h, a, 4, dropout=False) == 4 * (
        16 * 160 + 400)


def test_checkpointing_keeps_layer_inputs_and_recomputes_one_layer():
    layers, s, b, h, a, v = 4, 16, 2, 8, 2, 32
    layer = memory_model.activation_bytes_per_layer(s, b, h, a)
    head = memory_model.head_activation_bytes(s, b, h, v)
    assert head == 2 * 2 * s * b * h + 4 * s * b * v
    mask = s * b * h   # the embedding dropout's 1-byte mask (Korthikanti et al., 4.3)
    assert memory_model.embedding_activation_bytes(s, b, h) == mask
    plain = memory_model.activation_bytes(layers, s, b, h, a, v)
    assert plain == (mask + layers * layer + head,) * 2
    kept, peak = memory_model.activation_bytes(layers, s, b, h, a, v, checkpointing=True)
    assert kept == mask + layers * 2 * s * b * h + head
    assert peak == mask + layers * 2 * s * b * h + max(layer, head)
    assert peak < plain[1]


def test_without_dropout_there_is_no_embedding_mask():
    s, b, h, a, v = 16, 2, 8, 2, 32
    layer = memory_model.activation_bytes_per_layer(s, b, h, a, 4, dropout=False)
    head = memory_model.head_activation_bytes(s, b, h, v, 4)
    assert memory_model.embedding_activation_bytes(s, b, h, dropout=False) == 0
    assert memory_model.activation_bytes(3, s, b, h, a, v, 4, dropout=False)[0] == 3 * layer + head


@pytest.mark.parametrize("shape", [(5,), (7, 3), (2, 4), (1,), (1024, 6), ()])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_fsdp2_shards_follow_torch_chunk(shape, n):
    tensor = torch.empty(shape)
    chunks = torch.chunk(tensor.reshape(-1) if not shape else tensor, n, dim=0)
    for rank in range(n):
        expected = chunks[rank].numel() if rank < len(chunks) else 0
        assert memory_model.fsdp2_shard_numel(shape, n, rank) == expected
    assert sum(memory_model.fsdp2_shard_numel(shape, n, r) for r in range(n)) == tensor.numel()


def test_fsdp2_rank0_holds_a_whole_row_when_rows_are_fewer_than_ranks():
    assert memory_model.fsdp2_shard_numel((192, 64), 1024, 0) == 64   # not 192 * 64 / 1024 = 12
    assert memory_model.fsdp2_shard_numel((192, 64), 1024, 500) == 0


def test_zero1_partition_assigns_whole_tensors_largest_first():
    # largest first, each to the lighter rank: 10 -> r0, 7 -> r1, 5 -> r1 (7 < 10),
    # the first 3 -> r0 (10 < 12), the second 3 -> r1 (12 < 13)
    assert memory_model.zero1_partition([3, 10, 5, 7, 3], 2) == [0, 0, 1, 1, 1]
    assert memory_model.zero1_partition([4, 4, 4], 4) == [0, 1, 2]


@pytest.mark.parametrize("text, count", [("7.5B", 7_500_000_000), ("350M", 350_000_000),
                                         ("1.3e9", 1_300_000_000), ("120000", 120_000),
                                         ("2k", 2000), ("0", 0)])
def test_parse_count(text, count):
    assert memory_model.parse_count(text) == count


@pytest.mark.parametrize("text", ["-3", "abc", "7X", "", "inf", "nan"])
def test_parse_count_rejects_bad_counts(text):
    with pytest.raises(ValueError):
        memory_model.parse_count(text)


def test_formula_is_exact_where_the_layout_divides_evenly():
    assert memory_model.formula_is_exact("ddp", 1024, [3])
    assert memory_model.formula_is_exact("zero3", 4, [192, 768])
    assert not memory_model.formula_is_exact("zero3", 128, [192, 768])
    assert memory_model.formula_is_exact("zero1", 1, [5])
    assert not memory_model.formula_is_exact("zero1", 2, [4, 4])


def test_padded_numel_rounds_up_to_equal_shards():
    for numel in (1, 7, 96, 1009):
        for n in (1, 2, 3, 4, 64):
            padded = memory_model.padded_numel(numel, n)
            assert padded % n == 0 and 0 <= padded - numel < n


FSDP_UNITS = [sum(p.numel() for p in unit.parameters())
              for unit in Transformer(FSDP_FAMILY.shape).units()]


def test_the_fsdp_labs_model_pads_at_3_and_4_only():
    # The FSDP lab's shape is chosen so that sharding pads its units at N = 3 and 4 (the
    # world sizes its chapter and tests run) and not at N = 1 and 2.
    for n in (1, 2, 3, 4):
        padded = sum(memory_model.padded_numel(u, n) for u in FSDP_UNITS)
        assert (padded > sum(FSDP_UNITS)) == (n in (3, 4)), n


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_step_timeline_by_hand(n):
    b = 4
    padded = [memory_model.padded_numel(u, n) for u in FSDP_UNITS]
    units = len(FSDP_UNITS)
    ddp = memory_model.step_timeline("ddp", FSDP_UNITS, n, b)
    zero3 = memory_model.step_timeline("zero3", FSDP_UNITS, n, b)
    assert len(ddp) == len(zero3) == 4 * units   # start and end, forward and backward
    assert [(e["phase"], e["unit"]) for e in zero3[:2]] == [("forward", 0)] * 2
    assert [(e["phase"], e["unit"]) for e in zero3[-2:]] == [("backward", 0)] * 2
    # DDP holds every parameter and gradient all along
    assert memory_model.timeline_peak(ddp) == 8 * sum(FSDP_UNITS)
    assert all(e["param_bytes"] == e["grad_bytes"] == 4 * sum(FSDP_UNITS) for e in ddp)
    # ZeRO-3: its shards of both, plus the largest unit twice (parameters and flat
    # gradient) at the start of its backward; back to the shards at every end
    shards = b * sum(padded) // n
    assert memory_model.timeline_peak(zero3) == 2 * shards + 8 * max(padded)
    assert all(e["param_bytes"] == e["grad_bytes"] == shards
               for e in zero3 if e["point"] == "end")
    with pytest.raises(ValueError):
        memory_model.step_timeline("zero2", FSDP_UNITS, n)


# Hugging Face's published parameter counts of GPT-2 (tied output head), by size:
# (layers, hidden, count) with a 50,257-token vocabulary and 1,024 positions.
GPT2 = {"small": (12, 768, 124_439_808), "medium": (24, 1024, 354_823_168),
        "large": (36, 1280, 774_030_080), "xl": (48, 1600, 1_557_611_200)}


@pytest.mark.parametrize("size", list(GPT2))
def test_gpt2_parameter_counts_with_a_tied_head(size):
    layers, hidden, count = GPT2[size]
    assert memory_model.transformer_params(layers, hidden, 50257, 1024, tied_head=True) == count
    # untied, the head adds V x h more
    assert memory_model.transformer_params(layers, hidden, 50257, 1024) == count + 50257 * hidden


def test_tensor_parallel_activations_are_korthikantis_formulas():
    s, b, h, a = 2048, 1, 12288, 96   # GPT-3 175B's layer (Korthikanti et al. 2022, Table 2)
    sbh, attention = s * b * h, 5 * a * s * s * b
    assert memory_model.tensor_parallel_activation_bytes_per_layer(s, b, h, a, 1) == \
        memory_model.activation_bytes_per_layer(s, b, h, a)
    for t in (2, 4, 8):
        tp = memory_model.tensor_parallel_activation_bytes_per_layer(s, b, h, a, t)
        sp = memory_model.tensor_parallel_activation_bytes_per_layer(s, b, h, a, t, True)
        assert tp == sbh * (10 + 24 / t) + attention / t
        assert sp == (34 * sbh + attention) / t
        kept = memory_model.tensor_parallel_activation_bytes_per_layer(
            s, b, h, a, t, True, gathered_inputs_kept=True)
        assert kept - sp == 2 * 2 * sbh * (t - 1) / t


def test_tensor_parallel_parameters_per_rank():
    layers, h, vocab, seq = 3, 24, 60, 10
    psi = memory_model.transformer_params(layers, h, vocab, seq)
    assert memory_model.tensor_parallel_params_per_rank(layers, h, vocab, seq, 1) == psi
    for t in (2, 3, 4):
        split = memory_model.tensor_parallel_params_per_rank(layers, h, vocab, seq, t)
        whole_vocab = memory_model.tensor_parallel_params_per_rank(layers, h, vocab, seq, t,
                                                                   vocab_parallel=False)
        replicated = layers * 6 * h + seq * h + 2 * h
        assert t * split == psi + (t - 1) * replicated
        assert whole_vocab - split == 2 * vocab * h * (t - 1) / t


def test_layernorm_statistics_are_what_a_layernorm_saves():
    seq, batch, h = 7, 3, 16
    norm, saved = torch.nn.LayerNorm(h), []
    x = torch.randn(batch, seq, h, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    statistics = sum(t.numel() * t.element_size() for t in saved
                     if t.shape != x.shape and t.dim() > 1)   # the mean and 1/std
    assert statistics == memory_model.layer_norm_statistics_bytes(seq, batch, norms=1)
    assert memory_model.layer_norm_statistics_bytes(seq, batch, tokens_split=3) == 2 * 8 * 7


def test_pipeline_peak_microbatches_by_hand():
    assert memory_model.pipeline_peak_microbatches("gpipe", 4, 8) == [8, 8, 8, 8]
    assert memory_model.pipeline_peak_microbatches("1f1b", 4, 8) == [4, 3, 2, 1]
    assert memory_model.pipeline_peak_microbatches("1f1b", 4, 2) == [2, 2, 2, 1]
    # interleaved, p = 4, v = 2: warm-up (v-1)p + 2(p-1-s) forwards, then one more
    assert memory_model.pipeline_peak_microbatches("interleaved", 4, 8, 2) == [11, 9, 7, 5]
    assert memory_model.pipeline_peak_microbatches("interleaved", 2, 2, 2) == [4, 3]
    # p = 3, m = 5: one round of 5 micro-batches, so the warm-up is 5 + 2(p-1-s)
    assert memory_model.pipeline_peak_microbatches("interleaved", 3, 5, 2) == [10, 8, 6]
    with pytest.raises(ValueError):
        memory_model.pipeline_peak_microbatches("zero_bubble", 4, 8)


def test_stage_layers_cut_like_the_pipeline_lab():
    assert memory_model.stage_layers(8, 4) == [2, 2, 2, 2]
    assert memory_model.stage_layers(5, 2) == [2, 3]
    assert memory_model.stage_layers(4, 3) == [1, 1, 2]
    with pytest.raises(ValueError, match="cannot fill"):
        memory_model.stage_layers(2, 3)


@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 1), (3, 2), (4, 4)])
def test_stage_parameters_add_up_to_the_model(pp, tp):
    layers, h, vocab, seq = 12, 64, 96, 32
    stages = [memory_model.stage_params_per_rank(layers, h, vocab, seq, pp, tp, s)
              for s in range(pp)]
    if tp == 1:
        assert sum(stages) == memory_model.transformer_params(layers, h, vocab, seq)
    if pp == 1:
        assert stages[0] == memory_model.tensor_parallel_params_per_rank(layers, h, vocab, seq, tp)
    # split tp ways, every stage together holds the per-rank share of the whole model
    assert sum(stages) == memory_model.tensor_parallel_params_per_rank(layers, h, vocab, seq, tp)


def test_a_configuration_of_one_gpu_is_the_memory_chapter_s_model():
    layers, h, heads, seq, vocab, batch = 4, 256, 8, 128, 1000, 3
    psi = memory_model.transformer_params(layers, h, vocab, seq)
    for strategy in memory_model.STRATEGIES:
        for checkpointing in (False, True):
            c = memory_model.config_bytes_per_gpu(layers, h, heads, seq, vocab, 4, 1, 1,
                                                  strategy, batch, 1, "1f1b", False,
                                                  checkpointing)
            states = memory_model.state_bytes_per_gpu(psi, 4, strategy)
            assert c["states"] == states["total"] and c["params"] == states["params"]
            peak = memory_model.activation_bytes(layers, seq, batch, h, heads, vocab,
                                                 checkpointing=checkpointing)[1]
            assert c["activations"] == peak and c["total"] == states["total"] + peak


def test_a_pipeline_s_fullest_stage_holds_the_most_micro_batches():
    args = (16, 512, 8, 256, 5000)
    gpipe = memory_model.config_bytes_per_gpu(*args, pp=4, microbatches=8, schedule="gpipe")
    one_f_one_b = memory_model.config_bytes_per_gpu(*args, pp=4, microbatches=8)
    assert one_f_one_b["stage"] == 0 and gpipe["total"] > one_f_one_b["total"]
    # 1F1B's first stage holds 4 micro-batches where GPipe's stages hold all 8
    per_micro = memory_model.stage_activation_bytes(4, 256, 1, 512, 8, 5000, last=False)
    assert one_f_one_b["activations"] == 4 * per_micro
    assert gpipe["activations"] >= 8 * per_micro
    checkpointed = memory_model.config_bytes_per_gpu(*args, pp=4, microbatches=8,
                                                     checkpointing=True)
    assert checkpointed["activations"] < one_f_one_b["activations"] / 4


def test_dualpipe_holds_two_copies_of_the_parameters():
    one = memory_model.moe_bytes_per_gpu(2048, 16, 64)
    two = memory_model.moe_bytes_per_gpu(2048, 16, 64, param_copies=2)
    params = memory_model.deepseek_v3_params()
    rest, expert = params["other"] / 16, params["routed_experts"] / 1024
    # 2 + 2 bytes of weights and gradients, 12 of state over 128 (the rest) or 2 replicas
    assert one["total"] == pytest.approx(4 * rest + 12 * rest / 128 + 4 * expert + 12 * expert / 2)
    # DualPipe: weights and gradients twice; stage i sits on ranks i and 15 - i, so the
    # state of 2 x (rest + expert) shards over 256 and 4 replicas: one copy's state per GPU
    assert two["total"] == pytest.approx(2 * 4 * (rest + expert)
                                         + 12 * 2 * rest / 256 + 12 * 2 * expert / 4)
    assert two["total"] == pytest.approx(2 * one["total"] - 12 * rest / 128 - 12 * expert / 2)
    assert two["params_per_gpu"] == pytest.approx(2 * (rest + expert))
    assert 17.5e9 < two["total"] < 17.7e9 and 10e9 < one["total"] < 11e9
    # without ZeRO-1 nothing is sharded: twice everything
    assert memory_model.moe_bytes_per_gpu(2048, 16, 64, zero1=False, param_copies=2)[
        "total"] == pytest.approx(2 * memory_model.moe_bytes_per_gpu(2048, 16, 64,
                                                                     zero1=False)["total"])


def test_dualpipe_micro_batches_follow_its_schedule():
    # DualPipe.step (deepseek-ai/DualPipe, dualpipe/dualpipe.py) replayed: forwards and
    # backwards of phase 0 and 1 in the order of its eight steps; the most held per phase
    def replay(p, m, rank):
        hr, half_ranks, half = min(rank, p - 1 - rank), p // 2, m // 2
        order = (["F0"] * 2 * (half_ranks - hr - 1) + ["F0", "F1"] * (hr + 1)
                 + ["B1", "F1"] * (half_ranks - hr - 1)
                 + ["F0", "B1", "F1", "B0"] * (half - p + hr + 1)
                 + ["B1", "F1", "B0"] * (half_ranks - hr - 1) + ["B1", "B0"] * (hr + 1)
                 + ["B0"] * (half_ranks - hr - 1))
        held, most = [0, 0], [0, 0]
        for op in order:
            held[int(op[1])] += 1 if op[0] == "F" else -1
            most = [max(most[0], held[0]), max(most[1], held[1])]
        assert held == [0, 0]
        return most
    for p in (2, 4, 8, 16):
        for m in (2 * p, 2 * p + 2, 6 * p):
            ranks = memory_model.dualpipe_peak_microbatches(p, m)
            for rank, ((s0, a), (s1, b)) in enumerate(ranks):
                assert (s0, s1) == (rank, p - 1 - rank) and a + b == p + 1
                # phase 0 is the direction fed from this rank's own end of the pipeline
                first_half = rank < p // 2
                assert replay(p, m, rank) == ([a, b] if first_half else [b, a])
    assert memory_model.dualpipe_peak_microbatches(4, 8)[0] == ((0, 4), (3, 1))
    for bad in ((3, 12), (4, 7), (4, 6)):
        with pytest.raises(ValueError, match="DualPipe needs"):
            memory_model.dualpipe_peak_microbatches(*bad)


def test_moe_activations_and_folded_expert_replicas_by_hand():
    # h = 4, f = 2, k = 2, one shared expert, SwiGLU: 2 (2 x 4 + 3 x 2) + 3 x 2 = 34
    assert memory_model.moe_layer_activation_values(4, 2, 2, 1) == 34
    # GELU (2f), no shared expert, the busiest GPU at 1.5 x the mean: 1.5 x 2 (8 + 4) = 36
    assert memory_model.moe_layer_activation_values(4, 2, 2, 0, 2, load=1.5) == 36
    # Megatron-Core's example: 256 GPUs as TP 4 x CP 2 x DP 8 x PP 4 for attention; the
    # experts as ETP 1 x EP 64 x EDP 1 x PP 4, or ETP 4 x EP 8 x EDP 2
    assert memory_model.expert_data_parallel_size(256, 4, 64) == 1
    assert memory_model.expert_data_parallel_size(256, 4, 8, etp=4) == 2
    assert memory_model.expert_data_parallel_size(2048, 16, 64) == 2
    with pytest.raises(ValueError, match="does not divide 256 GPUs"):
        memory_model.expert_data_parallel_size(256, 4, 48)

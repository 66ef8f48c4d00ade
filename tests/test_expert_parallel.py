"""The expert-parallel lab: all-to-all and all-gather dispatch, EP x DP, against one process
holding every expert; bytes against the cost model; refusals (a missing peer: test_distenv). The chapter
runs N = 4 with k = 2 and asserts the same exactly (expert_parallel.md, hidden cells); here
N = 1 and 3 (odd) with k = 1, and the cost models by hand."""

from fractions import Fraction

import pytest

import expert_parallel
from conftest import assert_fails_with_one_line, assert_refused
from labkit.predict import comm_model, memory_model
from labkit.runtime.launch import run_lab


SHAPE = expert_parallel.SHAPE
CORRECT = ("dense", "alltoall", "allgather", "ep_dp")


@pytest.fixture(scope="module", params=[1, 3])
def result(request):
    n = request.param
    return run_lab("expert_parallel", None if n == 1 else n,
                   ["--top-k", 1, "--balance-steps", 2], echo=False)


def test_correct_variants_match_dense_and_pitfalls_do_not(result):
    assert result["args"]["top_k"] == 1 and result["world_size"] in (1, 3)
    for name, v in result["variants"].items():
        assert v["expected_equal"] == (name in CORRECT), name
        if name in CORRECT:
            assert v["max_param_diff"] <= 1e-5, name
        else:
            assert v["max_param_diff"] > 1e-5, name


def test_bytes_and_parameters_as_predicted(result):
    n = result["world_size"]
    for name, v in result["variants"].items():
        assert v["comm_bytes_per_rank"] == v["predicted_comm_bytes_per_rank"], name
        assert v["param_bytes_per_rank"] == v["predicted_param_bytes_per_rank"], name
        assert (v["ep"], v["dp"]) == ((1, 1) if name == "dense" else (n, 1)), name
    alltoall = result["variants"]["alltoall"]
    if n == 1:   # nothing leaves a world of one; every collective is still issued
        assert set(alltoall["comm_bytes_per_rank"]) == {0}
    # the same routing everywhere: the counts and the dropped slots are the reference's
    dense = result["variants"]["dense"]
    for name in ("alltoall", "allgather", "ep_dp"):
        assert result["variants"][name]["tokens_per_expert"] == dense["tokens_per_expert"]
        assert result["variants"][name]["dropped_tokens"] == dense["dropped_tokens"]
    small = result["variants"]["capacity_too_small"]
    assert small["dropped_tokens"] > dense["dropped_tokens"]
    # forward: the counts, dispatch and combine per layer; backward: two per layer
    assert alltoall["collectives"] == {"all_to_all": 5 * SHAPE.layers, "all_reduce": 1}


def test_the_load_balancing_loss_and_the_expert_bias_even_the_load(result):
    runs = result["load_balance"]["imbalance"]
    without, with_aux, with_bias = runs["none"], runs["aux_loss"], runs["expert_bias"]
    assert without[0] == with_aux[0] == with_bias[0]
    assert with_aux[-1] < without[-1] and with_bias[-1] < without[-1]


def test_alltoall_bytes_by_hand():
    # two ranks, h = 3, 4-byte values: rank 0 sends 5 rows to rank 1 and receives 2
    sent = [[7, 5], [2, 9]]
    assert comm_model.alltoall_dispatch_bytes(sent, 3) == [2 * (5 + 2) * 3 * 4] * 2
    three = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert comm_model.alltoall_dispatch_bytes(three, 1, 1, counts_bytes=10) == [
        2 * ((2 + 3) + (4 + 7)) + 10, 2 * ((4 + 6) + (2 + 8)) + 10, 2 * ((7 + 8) + (3 + 6)) + 10]
    # uniform routing: k (N-1)/N of the k T slots leave, each h values
    assert comm_model.alltoall_uniform_bytes(16, 8, 2, 4) == Fraction(2 * 3, 4) * 16 * 8 * 4
    uniform = [[4, 4], [4, 4]]   # T = 4, k = 2, N = 2: 8 slots, half stay
    assert comm_model.alltoall_dispatch_bytes(uniform, 5) == [
        4 * comm_model.alltoall_uniform_bytes(4, 5, 2, 2)] * 2


def test_allgather_bytes_and_capacity_by_hand():
    t, h, k, n = 16, 8, 2, 4
    rows = (n - 1) * t   # all-gather of N T rows: each rank sends its T rows N - 1 times
    assert comm_model.allgather_dispatch_bytes(t, h, k, n) == (
        4 * rows * h * 4 + 2 * rows * k * 4 + rows * k * 8)
    assert comm_model.expert_capacity(16, 12, 2, 3.0) == 8
    assert comm_model.expert_capacity(16, 12, 2, 1.0) == 3      # ceil(32 / 12)
    assert comm_model.expert_capacity(10, 5, 1, 1.25) == 3      # ceil(2.5), exactly


def test_deepseek_v3_parameters():
    params = memory_model.deepseek_v3_params()
    assert round(params["total"] / 1e9) == 671           # the report's 671B
    assert 37 <= params["active"] / 1e9 < 38             # the report's 37B
    # the model's own count: 256 routed SwiGLU experts of 3 x 7168 x 2048 in 58 layers
    assert params["routed_experts"] == 58 * 256 * 3 * 7168 * 2048
    per_gpu = memory_model.moe_bytes_per_gpu(2048, 16, 64)
    assert per_gpu["params_per_gpu"] == pytest.approx(
        params["other"] / 16 + params["routed_experts"] / 1024)


def test_lab_model_parameters_by_hand():
    h, e, f = 4, 3, 5
    per_layer = 12 * h * h // 3 + 8 * h + (h * e + e) + e * (2 * h * f + f + h)
    outside = memory_model.transformer_params(0, h, 7, 6)
    assert memory_model.moe_transformer_params(2, h, 7, 6, e, f) == 2 * per_layer + outside


def test_refusals_in_one_line(script):
    expert_parallel.check_split(12, 4, expert_parallel.VARIANTS)   # 12 splits 4 (and 2)
    with pytest.raises(SystemExit, match="--experts 10 does not split over 4 expert-parallel"):
        expert_parallel.check_split(10, 4, ["alltoall"])
    with pytest.raises(SystemExit, match="--experts 9 does not split over 2 .*ep_dp"):
        expert_parallel.check_split(9, 4, ["ep_dp"])
    parse = expert_parallel.parse_args
    assert_refused(parse, ["--top-k", 3], "invalid choice: 3")
    assert_refused(parse, ["--capacity-factor", 0], "--capacity-factor must be positive")
    assert_refused(parse, ["--experts", 1, "--top-k", 2], "--top-k 2 needs at least")
    assert_refused(parse, ["--variants", "alltoall,bogus"], "invalid choice: 'bogus'")
    assert_fails_with_one_line(script("expert_parallel", "--steps", 0),
                               "--steps must be at least 1")



def test_the_expert_bias_chooses_but_does_not_weight():
    import torch
    from labkit.model.moe import MoEConfig, MoELayer, route
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]).log()   # probs ∝ 2, 1, 0 ...
    probs = logits.softmax(-1)
    plain = route(logits, 1, 10.0)
    assert plain.idx.tolist() == [[0], [2]]
    # a bias of 0.5 on expert 1 makes it the choice of both tokens; the gates stay p_1
    biased = route(logits, 1, 10.0, torch.tensor([0.0, 0.5, 0.0]))
    assert biased.idx.tolist() == [[1], [1]]
    assert torch.equal(biased.gates, probs[:, 1:2])
    # after a step: down by the speed where above the mean count, up where below
    layer = MoELayer(4, MoEConfig(3, 1, 10.0, 2))
    layer.update_expert_bias(torch.tensor([4, 1, 1]), 0.25)
    layer.update_expert_bias(torch.tensor([2, 2, 2]), 0.25)
    assert layer.expert_bias.tolist() == [-0.25, 0.25, 0.25]

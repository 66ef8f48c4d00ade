"""The tensor-parallel lab: Megatron-LM's split from scratch and torch's DTensor, against
one process trained on the same batches, every collective and byte against counts made
by hand. The chapter runs t = 4 and 2 and asserts the same against the cost model
(tensor_parallel.md, hidden cells); here t = 3 and 1, in one launch (--sub-worlds)."""

import pytest

import tensor_parallel
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.predict import memory_model
from labkit.runtime.launch import run_lab
from labkit.model.transformer import Shape

SHAPE, BATCH = tensor_parallel.SHAPE, tensor_parallel.BATCH
CORRECT = ("scratch", "scratch_sp", "dtensor", "dtensor_sp")
L, H, S, V = SHAPE.layers, SHAPE.hidden, SHAPE.seq, SHAPE.vocab
SBH, SB = S * BATCH * H, S * BATCH


def ring(op, elements, t):
    """Bytes a rank sends in a ring `op` on a full tensor of `elements` fp32 values."""
    return (2 if op == "all_reduce" else 1) * (t - 1) * 4 * elements / t


# t = 3 (odd), then t = 1 on rank 0 alone (--sub-worlds) in the same launch; the chapter
# runs t = 4 and 2 alike and asserts the same exactly (tensor_parallel.md, hidden cells)
@pytest.fixture(scope="module")
def launch():
    return run_lab("tensor_parallel", 3, ["--sub-worlds", 1], echo=False)


@pytest.fixture(scope="module", params=[3, 1])
def result(request, launch):
    return launch if request.param == 3 else launch["sub_worlds"][0]


def test_the_result_says_where_it_came_from(launch):
    assert_lab_metadata(launch, "tensor_parallel")
    assert launch["tp"] == launch["world_size"] == 3
    assert [sub["tp"] for sub in launch["sub_worlds"]] == [1]
    for result in (launch, *launch["sub_worlds"]):
        assert result["shape"] == {"layers": L, "hidden": H, "heads": SHAPE.heads, "seq": S,
                                   "vocab": V}
        assert result["batch"] == BATCH and launch["args"]["steps"] == tensor_parallel.STEPS
        assert set(result["variants"]) == set(tensor_parallel.VARIANTS)


def test_correct_variants_match_one_process_and_the_pitfalls_do_not(result):
    t = result["tp"]
    for name, v in result["variants"].items():
        if name in CORRECT or t == 1:   # on one rank f's all-reduce and the blocks are no-ops
            assert v["expected_equal"] and v["max_param_diff"] <= 1e-5, (t, name)
        else:
            assert not v["expected_equal"] and v["max_param_diff"] > 1e-4, (t, name)


def test_collectives_and_bytes_by_hand(result):
    t, variants = result["tp"], result["variants"]
    for v in variants.values():
        assert v["collectives"] == v["predicted_collectives"]
        assert v["comm_bytes_per_rank"] == v["predicted_comm_bytes_per_rank"]
    # Megatron-LM's split: 2 all-reduces forward and 2 backward per layer, the embedding's g
    # and the head's f, and the cross-entropy's three of one value per token
    scratch = variants["scratch"]
    assert scratch["collectives"] == {"all_reduce": 4 * L + 2 + 3}
    assert scratch["comm_bytes_per_rank"] == round((4 * L + 2) * ring("all_reduce", SBH, t)
                                                   + 3 * ring("all_reduce", SB, t))
    # f without its backward all-reduce: half the layer's, and the head's f, missing
    assert variants["no_f_backward"]["collectives"] == {"all_reduce": 2 * L + 1 + 3}
    # torch splits the blocks only; on one rank it issues nothing
    dtensor = variants["dtensor"]
    assert dtensor["collectives"] == ({} if t == 1 else {"all_reduce": 4 * L})
    assert dtensor["comm_bytes_per_rank"] == round(4 * L * ring("all_reduce", SBH, t))
    # sequence parallelism: f and g become all-gathers and reduce-scatters, the inputs of the
    # column-parallel linears are gathered again in backward (2 per layer, 1 for the head),
    # and the replicated parameters' partial gradients are all-reduced once
    sp = variants["scratch_sp"]
    assert sp["collectives"] == {"all_gather": 6 * L + 3, "reduce_scatter": 4 * L + 2,
                                 "all_reduce": 3 + 1}
    replicated = L * 6 * H + S * H + 2 * H
    assert sp["comm_bytes_per_rank"] == round(
        (6 * L + 3) * ring("all_gather", SBH, t) + (4 * L + 2) * ring("reduce_scatter", SBH, t)
        + 3 * ring("all_reduce", SB, t) + ring("all_reduce", replicated, t))


def test_weights_and_activations_per_rank_by_hand(result):
    t = result["tp"]
    assert result["param_bytes_per_rank"] == result["predicted_param_bytes_per_rank"]
    assert result["activation_bytes_per_rank"] == result["predicted_activation_bytes_per_rank"]
    params = result["param_bytes_per_rank"]
    psi = memory_model.transformer_params(L, H, V, S)
    split = L * (12 * H * H + 7 * H)
    assert params["scratch"] == 4 * (split // t + L * 6 * H + 2 * V * H // t + S * H + 2 * H)
    assert params["dtensor"] == 4 * (split // t + L * 6 * H + 2 * V * H + S * H + 2 * H)
    if t == 1:
        assert params["scratch"] == params["dtensor"] == 4 * psi
    act = result["activation_bytes_per_rank"]
    ln_stats = 2 * 2 * 4 * SB           # a mean and a 1/std per token, two norms, fp32
    attention = SHAPE.heads * S * S * BATCH
    # fp32, no dropout: 4 sbh values replicated, 12 sbh and the attention matrix split
    assert act["scratch"] == 4 * (4 * SBH + (12 * SBH + attention) // t) + ln_stats
    assert act["scratch_sp"] == 4 * ((16 * SBH + attention) // t) + ln_stats // t
    # torch's plan keeps the gathered inputs of QKV and fc1 whole
    assert act["dtensor_sp"] == act["scratch_sp"] + 4 * 2 * SBH * (t - 1) // t
    if t == 1:
        assert act["scratch"] == memory_model.activation_bytes_per_layer(
            S, BATCH, H, SHAPE.heads, value_bytes=4, dropout=False) + ln_stats


def test_a_shape_t_cannot_split_is_refused_in_one_line():
    heads_5 = Shape(L, 40, 5, S, V)
    with pytest.raises(SystemExit, match="error: --heads 5 does not split over 2 "
                                         "tensor-parallel ranks$"):
        tensor_parallel.check_split(heads_5, ["scratch"], 2)
    odd_seq = Shape(L, H, SHAPE.heads, 25, V)
    tensor_parallel.check_split(odd_seq, ["scratch", "dtensor"], 3)   # no tokens split
    with pytest.raises(SystemExit, match="--seq 25 does not split over 3"):
        tensor_parallel.check_split(odd_seq, ["scratch_sp"], 3)
    with pytest.raises(SystemExit, match="--vocab 120 does not split over 7"):
        tensor_parallel.check_split(Shape(L, 42, 7, S, V), ["dtensor"], 7)


def test_bad_options_are_refused_in_one_line(script):
    parse = tensor_parallel.parse_args
    assert_refused(parse, ["--steps", 0], "--steps must be at least 1")
    assert_refused(parse, ["--sub-worlds", "2,0"], "--sub-worlds must be at least 1")
    assert_refused(parse, ["--variants", "scratch,bogus"], "invalid choice: 'bogus'")
    assert_refused(parse, ["--hidden", 50, "--heads", 12],
                   "--hidden 50 is not divisible by --heads 12")
    assert_fails_with_one_line(script("tensor_parallel", "--batch", -1),
                               "--batch must be at least 1")

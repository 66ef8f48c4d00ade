"""The planner: every configuration it returns uses all N GPUs, fits the stated memory,
and states the same bytes per GPU as the memory calculator (labs/memory.py predict) given
the same settings; its step time adds up and ranks them."""

import json
import random
from pathlib import Path

import pytest

import memory
import plan
from conftest import assert_fails_with_one_line, assert_refused
from labkit import comm_model

CHAPTER = Path(__file__).resolve().parent.parent / "book" / "hybrid.md"

SHAPE_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--vocab", "128256",
             "--seq", "4096"]
CASES = {"70B on 256": [*SHAPE_70B, "--gpus", "256", "--global-batch-tokens", "4M"],
         "13B on 64, 40 GB": ["--params", "13B", "--gpus", "64", "--gpu-memory-gb", "40",
                              "--global-batch-tokens", "1M"],
         "odd: 7B on 24": ["--params", "7B", "--gpus", "24", "--gpus-per-node", "4",
                           "--global-batch-tokens", "3M"]}


def planned(capsys, argv):
    plan.main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_every_configuration_uses_all_gpus_fits_and_is_ranked(capsys, argv):
    result = planned(capsys, argv)
    gpus, limit = result["hardware"]["gpus"], result["hardware"]["gpu_memory_gb"] * 1e9
    configurations = result["configurations"]
    assert configurations, "something must fit"
    sequences = result["global_batch_tokens"] // result["model"]["seq"]
    for c in configurations:
        assert c["dp"] * c["pp"] * c["tp"] == gpus
        assert c["memory_bytes"]["total"] <= limit
        assert result["hardware"]["gpus_per_node"] % c["tp"] == 0   # tp inside a node
        assert c["dp"] * c["micro_batch"] * c["microbatches"] == sequences
        times = c["time_s"]
        assert times["step"] == pytest.approx(sum(v for k, v in times.items() if k != "step"))
        assert 0 < c["mfu"] <= result["hardware"]["mfu"]
    steps = [c["time_s"]["step"] for c in configurations]
    assert steps == sorted(steps)


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_memory_equals_the_memory_calculator(capsys, argv):
    result = planned(capsys, argv)
    model = result["model"]
    shape = [f"--{k}={model[k]}" for k in ("layers", "hidden", "heads", "seq", "vocab")]
    configurations = result["configurations"]
    sample = configurations[:4] + random.Random(0).sample(configurations,
                                                          min(8, len(configurations)))
    for c in sample:
        memory.main(["predict", *shape, "--gpus", str(c["dp"]), "--pp", str(c["pp"]),
                     "--tp", str(c["tp"]), "--batch", str(c["micro_batch"]),
                     "--microbatches", str(c["microbatches"]), "--json"]
                    + (["--sequence-parallel"] if c["sequence_parallel"] else []))
        row = json.loads(capsys.readouterr().out)[c["zero"]]
        key = "per_gpu_checkpointed" if c["checkpointing"] else "per_gpu"
        assert row[key] == c["memory_bytes"]["total"], c


def test_the_planner_and_the_chapter_price_tensor_parallelism_with_one_function():
    """The planner's tp term is the time of comm_model.tensor_parallel_collectives for the
    slowest stage, sequence parallelism on, and the chapter's table of what each axis sends
    takes its tensor-parallel collectives from the same planner function: one model of
    tensor-parallel traffic, 10 collectives per layer and micro-batch (14 recomputing)."""
    args = plan.parse_args([*SHAPE_70B, "--gpus", "256"])
    shape = args.shape
    params = plan.memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab,
                                                  shape.seq)
    for dp, pp, tp, b, checkpointing in ((8, 4, 8, 1, False), (8, 4, 8, 2, True),
                                         (16, 8, 2, 1, False), (128, 1, 2, 4, True)):
        m = args.global_batch_tokens // shape.seq // dp // b
        config = {"dp": dp, "pp": pp, "tp": tp, "zero": "zero1", "micro_batch": b,
                  "microbatches": m, "checkpointing": checkpointing, "sequence_parallel": True}
        link = plan.links(dp, pp, tp, args)["tp"]
        times = []
        for stage in range(pp):
            layers = plan.memory_model.stage_layers(shape.layers, pp)[stage]
            collectives = comm_model.tensor_parallel_collectives(
                layers, shape.seq, b, shape.hidden, tp, sequence_parallel=True,
                embedding=stage == 0, head=stage == pp - 1, microbatches=m,
                recompute=checkpointing)
            assert plan.tensor_parallel_plan(shape, config, stage) == collectives
            times.append(sum(plan.collective_time(op, plan.VALUE_BYTES * n, tp, *link)
                             for op, n in collectives))
            if 0 < stage < pp - 1:   # a middle stage: only its layers, and one gradient
                sbh = b * shape.seq * shape.hidden
                per_layer = sum(n == sbh for _, n in collectives) / (m * layers)
                assert per_layer == (14 if checkpointing else 10)
        assert plan.step_time(shape, params, config, args)["tp"] == pytest.approx(max(times))
    chapter = CHAPTER.read_text()
    assert "tp_plan70 = plan.tensor_parallel_plan(shape70, config_axes, stage=1)" in chapter
    assert '"tp": comm_model.collectives_summary(tp_plan70, tp70, plan.VALUE_BYTES)[0]' in chapter
    assert "tp_per_layer = sum(n == sbh70 for _, n in tp_plan70)" in chapter


def test_flop_conventions_by_hand():
    """Narayanan et al.'s Eq. 3 per token, 6 psi, and 6 psi with attention's products."""
    layers, hidden, seq, vocab = 2, 64, 32, 100
    psi = plan.memory_model.transformer_params(layers, hidden, vocab, seq)
    flops = plan.memory_model.flops_per_token
    assert flops(layers, hidden, seq, vocab) == 6 * psi
    assert flops(layers, hidden, seq, vocab, "attention") == 6 * psi + 12 * layers * hidden * seq
    # four passes over 24 h^2 per layer, attention's 4 s h, the logits' 2 V h forward
    by_hand = 4 * layers * (24 * hidden ** 2 + 4 * seq * hidden) + 3 * 2 * vocab * hidden
    assert flops(layers, hidden, seq, vocab, "megatron") == pytest.approx(by_hand)
    with pytest.raises(ValueError):
        flops(layers, hidden, seq, vocab, "7psi")


def test_what_does_not_fit_is_left_out(capsys):
    """A 70B model in 16-bit needs 140 GB for its weights alone: 8 GPUs of 80 GB can hold
    it only sharded, and one GPU cannot."""
    one = planned(capsys, [*SHAPE_70B, "--gpus", "8", "--global-batch-tokens", "32K"])
    assert all(c["zero"] == "zero3" or c["tp"] * c["pp"] > 1 for c in one["configurations"])
    with pytest.raises(SystemExit):
        plan.main([*SHAPE_70B, "--gpus", "1", "--global-batch-tokens", "32K"])
    assert "no configuration fits" in capsys.readouterr().out


def test_a_shape_from_a_parameter_count_has_about_that_many():
    for count in (1.3e9, 13e9, 70e9, 175e9):
        shape = plan.shape_from_params(count, 2048, 51200)
        params = plan.memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab,
                                                      shape.seq)
        assert abs(params - count) / count < 0.1, (count, shape)
        assert shape.hidden % shape.heads == 0


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(plan.parse_args, ["--gpus", "8"], "give --params P, or a whole model shape")
    assert_refused(plan.parse_args, ["--params", "7B", "--layers", "2", "--gpus", "8"], "not both")
    assert_refused(plan.parse_args, ["--params", "7B", "--gpus", "8", "--mfu", "1.5"], "at most 1")
    assert_refused(plan.parse_args, ["--params", "7B", "--gpus", "8", "--seq", "3000",
                                     "--global-batch-tokens", "4M"], "not a whole number")
    assert_fails_with_one_line(script("plan", "--params", "lots", "--gpus", "8"), "--params")

"""The planner: every configuration it returns uses all N GPUs, fits the stated memory,
and states the same bytes per GPU as the memory calculator (labs/memory.py predict) given
the same settings; its step time adds up and ranks them."""

import json
import random

import pytest

import memory
import plan
from conftest import assert_fails_with_one_line, assert_refused

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

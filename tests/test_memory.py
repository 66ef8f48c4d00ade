"""The memory lab: predict against the ZeRO paper, measure against predict in torch's own
DDP, ZeroRedundancyOptimizer and FSDP2, and the allocator's own bytes against the count.
The chapter measures every strategy on real ranks at N = 4 and on simulated ones at
N = 1, 2, 3, 4, 8, 64 and 1024 (one process runs these, reading the allocator up to N = 8),
and asserts each; here real ranks at N = 3 (odd, where gloo's threads keep the allocator
unread) under the device guard, a simulated N = 16 alone, simulated worlds of one and three
under the guard, the calculator, and bad input."""

import json

import pytest

import memory
from conftest import assert_fails_with_one_line, assert_refused
from labkit.runtime import distenv
from labkit.predict import memory_model
from labkit.runtime.launch import run_lab
from labkit.model.transformer import Transformer, next_token_loss, random_batch
from labkit.runtime.activations import count_activation_bytes

KEYS = ("params", "grads", "optimizer", "total")


def test_predict_reproduces_the_zero_paper(capsys):
    memory.main(["predict", "--params", "7.5B", "--gpus", "64", "--json"])
    table = json.loads(capsys.readouterr().out)
    assert list(table) == list(memory_model.STRATEGIES)
    assert all(set(row) == set(KEYS) for row in table.values())
    gb = {s: table[s]["total"] / 1e9 for s in table}
    assert (gb["ddp"], round(gb["zero1"], 1), round(gb["zero2"], 1), round(gb["zero3"], 2)) == (
        120, 31.4, 16.6, 1.88)
    memory.main(["predict", "--params", "7.5B", "--gpus", "64"])
    text = capsys.readouterr().out
    assert "120.00" in text and "31.41" in text and "16.64" in text and "1.88" in text


def test_predict_counts_gpt2_with_its_tied_head(capsys):
    gpt2 = ["--layers", "12", "--hidden", "768", "--heads", "12", "--seq", "1024",
            "--vocab", "50257", "--precision", "fp32"]
    memory.main(["predict", *gpt2, "--tie-embeddings", "--json"])
    assert json.loads(capsys.readouterr().out)["ddp"]["params"] == 4 * 124_439_808
    memory.main(["predict", *gpt2, "--tie-embeddings"])
    assert "124,439,808 parameters" in capsys.readouterr().out
    memory.main(["predict", *gpt2, "--json"])   # untied: 50,257 x 768 more
    assert json.loads(capsys.readouterr().out)["ddp"]["params"] == 4 * (124_439_808 + 50257 * 768)


def test_predict_from_a_shape_adds_activations(capsys):
    shape = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "100"]
    memory.main(["predict", *shape, "--batch", "3", "--gpus", "2", "--json"])
    row = json.loads(capsys.readouterr().out)["ddp"]
    psi = memory_model.transformer_params(2, 64, 100, 32)
    assert row["total"] == 16 * psi
    assert row["activations"] == memory_model.activation_bytes(2, 32, 3, 64, 4, 100)[1]
    assert row["activations_checkpointed"] < row["activations"]


FIRST_DIMS = [p.shape[0] for p in Transformer(memory.SHAPE).parameters()]
SHAPES = [tuple(p.shape) for p in Transformer(memory.SHAPE).parameters()]


def check_measurement(row, strategy, world_size):
    """What every measurement must satisfy (the chapter asserts the same on its runs)."""
    measured, predicted = row["measured_bytes"], row["predicted_bytes"]
    assert row["world_size"] == world_size and row["strategy"] == strategy
    assert measured["total"] == sum(measured[k] for k in KEYS[:3])
    # The real layout of torch's implementation predicts every byte, at every N ...
    assert measured == row["layout_bytes"]
    # ... and the formula does wherever its arithmetic is exact; elsewhere rank 0 holds more.
    if memory_model.formula_is_exact(strategy, world_size, FIRST_DIMS):
        assert measured == predicted
    else:
        assert measured["total"] > predicted["total"]
    # Adam's step counters are 4-byte scalars, one per parameter tensor rank 0 optimizes
    assert row["step_counter_bytes"] % 4 == 0 and row["step_counter_bytes"] > 0


def check_allocator(row, activations):
    """The allocator's own bytes (c10's CPU allocator, through torch.profiler) beside the
    counts: at least what the counted tensors hold at each point, and, one forward after
    the step with its gradients kept, within 1 % of it (the chapter asserts the same)."""
    allocated = row["allocated_bytes"]
    around = row["buffer_bytes"] + row["step_counter_bytes"]   # the model's masks, Adam's
    after_step = allocated["after_step"] - row["held_after_step_bytes"]["total"] - around
    accumulating = (allocated["accumulating_forward"] - row["held_bytes"]["total"]
                    - activations - around)
    assert 0 <= after_step and 0 <= accumulating <= allocated["accumulating_forward"] / 100
    # every state the formula counts, and the activations, are held at once
    assert allocated["accumulating_forward"] >= row["predicted_bytes"]["total"] + activations
    assert allocated["step_peak"] >= max(allocated[point] for point in (
        "after_forward", "after_backward", "after_step"))
    # FSDP2 has resharded every unit after the step: ZeRO-2 holds its shards alone, as ZeRO-3
    if row["strategy"] in ("zero2", "zero3"):
        shards = memory_model.fsdp2_held_param_numel(SHAPES, row["world_size"], gathered=False)
        assert row["held_after_step_bytes"]["params"] == 4 * shards


@pytest.mark.parametrize("world_size", [3])   # the chapter runs 4 (and 1 to 1024 simulated)
def test_real_ranks_hold_what_the_layout_predicts(world_size):
    """Under the device guard (distenv.device_guard_on): a tensor made without naming its
    device is meta, and a real group's collectives refuse it, as NCCL would a CPU tensor."""
    result = run_lab("memory", world_size, ["measure", "--strategy", "all"],
                     env={distenv.DEVICE_GUARD: "1"}, echo=False)
    assert result["simulated"] is False and result["world_size"] == world_size
    assert result["device_guard"] is True
    assert [row["strategy"] for row in result["measurements"]] == list(memory_model.STRATEGIES)
    for row in result["measurements"]:
        check_measurement(row, row["strategy"], world_size)
    # gloo frees tensors on its own threads, which torch.profiler does not hear of
    assert result["allocator"].startswith("not measured: gloo")
    assert all(row["allocated_bytes"] is None for row in result["measurements"])


def test_a_simulated_world_of_16_in_one_process():
    """One simulated size: the world is that size. (The chapter runs several sizes in one
    process, where the world is the real one, and asserts each row as check_measurement
    does.)"""
    result = run_lab("memory", None, ["measure", "--strategy", "all",
                                      "--simulate-world-size", 16], echo=False)
    assert result["simulated"] is True and result["backend"] == "fake"
    assert result["world_size"] == 16 and "simulated_world_sizes" not in result
    assert [row["strategy"] for row in result["measurements"]] == list(memory_model.STRATEGIES)
    assert result["allocator"] == "c10's CPU allocator, through torch.profiler's memory events"
    for row in result["measurements"]:
        check_measurement(row, row["strategy"], 16)
        check_allocator(row, result["activation_bytes"]["measured"])
        assert row["simulated"] is True
    shape = result["shape"]
    assert result["param_count"] == memory_model.transformer_params(
        shape["layers"], shape["hidden"], shape["vocab"], shape["seq"])


def test_the_lab_runs_under_the_device_guard():
    """LABS_DEVICE_GUARD=1 (distenv.device_guard_on): what the lab makes without naming a
    device is meta, so a model or batch left off env.device fails as it would on a GPU.
    Simulated worlds of one and three (the fake group, whose collectives would pass a meta
    tensor silently; the real ranks above are guarded too) count what the unguarded lab
    counts."""
    result = run_lab("memory", None, ["measure", "--strategy", "all",
                                      "--simulate-world-size", "1,3",
                                      "--allocator-max-world", 1],
                     env={distenv.DEVICE_GUARD: "1"}, echo=False)
    assert result["device_guard"] is True and result["simulated_world_sizes"] == [1, 3]
    rows = result["measurements"]
    assert [(row["world_size"], row["strategy"]) for row in rows] == [
        (n, s) for n in (1, 3) for s in memory_model.STRATEGIES]
    assert result["allocator"] == "c10's CPU allocator, through torch.profiler's memory events"
    for row in rows:
        check_measurement(row, row["strategy"], row["world_size"])
        if row["world_size"] == 1:   # simulated too: every free on the lab's thread
            check_allocator(row, result["activation_bytes"]["measured"])
        else:                        # above --allocator-max-world
            assert row["allocated_bytes"] is None
    # the activations, counted here without the guard: the same bytes
    model = Transformer(memory.SHAPE)
    ids, targets = random_batch(memory.SHAPE, memory.BATCH,
                                distenv.generator(0, "activations"), "cpu")
    kept = count_activation_bytes(model, lambda: next_token_loss(model(ids), targets))
    activations = result["activation_bytes"]
    assert (activations["measured_per_layer"], activations["measured"]) == (
        kept[0], sum(kept.values()))


@pytest.mark.parametrize("args, words", [
    (["predict", "--params", "-7000"], "the parameter count must be a non-negative number"),
    (["predict", "--params", "7B", "--gpus", 0], "--gpus must be at least 1"),
    (["predict"], "give --params P, or a model shape"),
    (["predict", "--layers", 2, "--hidden", 64], "needs --heads --seq --vocab as well"),
    (["predict", "--params", "7B", "--layers", 2], "not both"),
    (["predict", "--params", "7B", "--tie-embeddings"], "--tie-embeddings needs a model shape"),
    (["measure", "--strategy", "zero4"], "invalid choice: 'zero4'"),
    (["measure"], "the following arguments are required: --strategy"),
    (["measure", "--strategy", "ddp", "--hidden", 100, "--heads", 3], "not divisible by --heads"),
    (["measure", "--strategy", "ddp", "--simulate-world-size", 0],
     "--simulate-world-size must be at least 1"),
    (["measure", "--strategy", "ddp", "--steps", 0], "--steps must be at least 1"),
    (["measure", "--strategy", "ddp", "--allocator-max-world", -1],
     "--allocator-max-world must be at least 0"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(memory.parse_args, args, words)


def test_bad_input_exits_with_one_clear_line(script):
    assert_fails_with_one_line(script("memory", "measure", "--strategy", "zero4"),
                               "invalid choice: 'zero4'")


def test_simulating_under_torchrun_is_refused(monkeypatch):
    # what torchrun sets for every rank it starts
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    args = memory.parse_args(["measure", "--strategy", "ddp", "--simulate-world-size", "8"])
    with pytest.raises(SystemExit, match="start it with python, not torchrun"):
        with distenv.initialize(args, simulate_world_size=8):
            pass


@pytest.mark.parametrize("command, options", [
    ("predict", ("--params", "--gpus", "--optimizer", "--precision", "--json", "--layers",
                 "--vocab")),
    ("measure", ("--strategy", "--simulate-world-size", "--allocator-max-world", "--out",
                 "--backend", "--timeout")),
])
def test_help_lists_every_option(capsys, command, options):
    with pytest.raises(SystemExit) as done:
        memory.parse_args([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert all(option in text for option in options), text

"""The FSDP lab: scratch ZeRO-3 and FSDP2 against DDP, the collectives they issue against
2 psi and 3 psi, and the memory timeline and state against the schedule; FSDP2's own step
(its collectives in order and the allocator's bytes, on rank 0 of a fake group) against
its layout. The chapter runs N = 4 and asserts the same (fsdp.md, hidden cells); here
N = 3, 2 and 1 in one launch (--sub-worlds), by hand."""

import pytest

import fsdp
from labkit.model.transformer import Transformer
from labkit.parallel.strategies import FSDP_FAMILY
from conftest import assert_fails_with_one_line, assert_refused
from labkit.parallel import sharded_checkpoint
from labkit.predict import memory_model
from labkit.runtime.launch import run_lab


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp") / "ckpt"


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp-profile")


@pytest.fixture(scope="module")
def launch(checkpoint_dir, profile_dir):
    """N = 3, which also saves the checkpoint lab's checkpoint (--checkpoint-dir) and
    profiles torch's FSDP2 (--profile), then N = 2 and 1 on its first ranks."""
    return run_lab("fsdp", 3, ["--steps", 3, "--checkpoint-dir", checkpoint_dir,
                               "--profile", profile_dir, "--sub-worlds", "2,1"], echo=False)


def test_fsdp2_s_trace_holds_two_gathers_and_a_reduction_per_unit_and_step(launch, profile_dir):
    """--profile: each of the three ranks' traces of FSDP2's two profiled steps (read by
    labkit.predict.trace_reader) gathers every unit twice and reduces it once a step, as
    comm_model.data_parallel_step_collectives lists ZeRO-3's; gloo carries a reduce-scatter
    out as an all-reduce, and names it so."""
    from labkit.predict import comm_model, trace_reader
    traces = sorted(profile_dir.glob("fsdp2-n3-rank*.json"))
    assert len(traces) == 3 and launch["profile"] == str(traces[0])
    units = len(launch["unit_param_counts"])
    listed = comm_model.data_parallel_step_collectives("zero3", 1, units=units)
    per_step = {op: sum(o == op for o, _ in listed) for op in ("all_gather", "reduce_scatter")}
    ranks = trace_reader.analyze_all([(p.name, trace_reader.load_file(p)) for p in traces])
    for r in ranks["ranks"].values():
        assert r["steps"] == 2
        assert r["collectives"] == {"all_gather": 2 * per_step["all_gather"],
                                    "all_reduce": 2 * per_step["reduce_scatter"]}


@pytest.fixture(scope="module")
def one_rank(launch):
    assert [sub["world_size"] for sub in launch["sub_worlds"]] == [2, 1]
    return launch["sub_worlds"][1]


def test_scratch_and_fully_shard_match_ddp_and_the_predictions(one_rank):
    result, n = one_rank, 1
    psi, padded = result["param_count"], result["padded_param_count"]
    assert result["world_size"] == n
    assert max(result["max_param_diff"].values()) <= 1e-5
    assert set(result["max_param_diff"]) == {"scratch_vs_ddp", "fully_shard_vs_ddp"}
    assert result["unit_padded_counts"] == result["unit_param_counts"] and padded == psi

    # one rank sends nothing, under either
    sent = result["comm_bytes_per_rank"]
    assert sent == result["predicted_comm_bytes_per_rank"] == {"ddp": 0, "zero3": 0}

    units = len(result["unit_param_counts"])
    for name in ("ddp", "zero3"):
        timeline = result["memory_timeline"][name]
        assert timeline["events"] == timeline["predicted_events"]
        assert timeline["peak_bytes"] == timeline["predicted_peak_bytes"]
        assert len(timeline["events"]) == 4 * units   # start and end, forward and backward
    # DDP holds 4 psi of parameters and 4 psi of gradients all along; ZeRO-3 at N = 1 its
    # shard (the whole model) plus the largest unit twice, gathered into its own buffers
    assert result["memory_timeline"]["ddp"]["peak_bytes"] == 8 * psi
    largest = max(result["unit_padded_counts"])
    assert result["memory_timeline"]["zero3"]["peak_bytes"] == 8 * padded + 8 * largest

    state = result["state_bytes_per_rank"]
    assert state == result["predicted_state_bytes_per_rank"]
    assert state["ddp"] == memory_model.state_bytes_per_gpu(psi, 1, "ddp", "momentum", "fp32")
    assert state["zero3"]["total"] == 12 * padded


def test_the_sawtooth_goes_up_and_down(one_rank):
    """ZeRO-3's live parameters rise at each unit's start and fall back at its end."""
    events = one_rank["memory_timeline"]["zero3"]["events"]
    params = [e["param_bytes"] for e in events]
    assert all(start > end for start, end in zip(params[0::2], params[1::2]))
    assert len(set(params[1::2])) == 1   # every unit freed: back to the shards alone


def test_bad_steps_is_refused_in_one_line(script):
    assert_refused(fsdp.parse_args, ["--steps", 0], "--steps must be at least 1")
    assert_fails_with_one_line(script("fsdp", "--steps", 0), "--steps must be at least 1")


def test_the_launch_saves_the_checkpoint_labs_checkpoint(launch, checkpoint_dir):
    saved = launch["checkpoint"]
    assert saved["step"] == sharded_checkpoint.STEPS
    assert saved["param_count"] == launch["param_count"]
    assert len(list(checkpoint_dir.glob("*.distcp"))) == 3   # a file per rank
    assert (checkpoint_dir / sharded_checkpoint.FULL_EXPORT).is_file()
    assert all("checkpoint" not in sub for sub in launch["sub_worlds"])


@pytest.mark.parametrize("n", [3, 2])
def test_real_ranks_match_ddp_and_the_predictions_by_hand(n, launch):
    result = launch if n == 3 else launch["sub_worlds"][0]
    psi, padded = result["param_count"], result["padded_param_count"]
    assert result["world_size"] == n
    assert max(result["max_param_diff"].values()) <= 1e-5
    for numel, rounded in zip(result["unit_param_counts"], result["unit_padded_counts"]):
        assert rounded % n == 0 and 0 <= rounded - numel < n
    assert (padded > psi) == (n == 3)   # the model is shaped so that N = 3 and 4 pad
    # bytes sent per rank per step: DDP 2(N-1)/N x 4 psi, ZeRO-3 3(N-1)/N x 4 psi'
    sent = result["comm_bytes_per_rank"]
    assert sent == result["predicted_comm_bytes_per_rank"]
    assert sent["ddp"] == round(2 * (n - 1) * 4 * psi / n)
    assert sent["zero3"] == round(3 * (n - 1) * 4 * padded / n)
    for name in ("ddp", "zero3"):
        timeline = result["memory_timeline"][name]
        assert timeline["events"] == timeline["predicted_events"]
        assert timeline["peak_bytes"] == timeline["predicted_peak_bytes"]
        assert len(timeline["events"]) == 4 * len(result["unit_param_counts"])
    largest = max(result["unit_padded_counts"])
    assert result["memory_timeline"]["zero3"]["peak_bytes"] == 8 * padded // n + 8 * largest
    events = result["memory_timeline"]["zero3"]["events"]   # the sawtooth
    params = [e["param_bytes"] for e in events]
    assert all(start > end for start, end in zip(params[0::2], params[1::2]))
    assert result["state_bytes_per_rank"] == result["predicted_state_bytes_per_rank"]
    assert result["state_bytes_per_rank"]["zero3"]["total"] == 12 * padded // n


UNIT_SHAPES = [[tuple(p.shape) for p in unit.parameters()]
               for unit in Transformer(FSDP_FAMILY.shape).units()]


@pytest.mark.parametrize("n", [3, 2, 1])
def test_fsdp2_s_own_step_against_its_layout(n, launch):
    """FSDP2 recorded on rank 0 of a fake group of N: one all-gather of each unit before
    its forward and again in backward, one reduce-scatter of each, in order and of the
    sizes its row-padded layout gives (none at N = 1); the allocator holds at least the
    counted shards throughout, the activations on top at the end of the forward, and a
    gathered unit at its peak."""
    result = launch if n == 3 else launch["sub_worlds"][[2, 1].index(n)]
    record = result["fsdp2_step"]
    assert record["process_group"] == "fake" and record["world_size"] == n
    measured, predicted = record["collectives"], record["predicted_collectives"]
    assert predicted == [
        {"phase": phase, "kind": kind, "unit": unit, "numel": [out, into]}
        for phase, kind, unit, out, into in memory_model.fsdp2_step_collectives(UNIT_SHAPES, n)]
    assert len(measured) == len(predicted) == (0 if n == 1 else 3 * len(UNIT_SHAPES))
    for kind in ("all_gather", "reduce_scatter"):
        assert ([c["numel"] for c in measured if c["kind"] == kind]
                == [c["numel"] for c in predicted if c["kind"] == kind])
    units, gathers, reduces = len(UNIT_SHAPES), 0, 0
    for collective in measured:
        if collective["kind"] == "all_gather":
            gathers += 1
        else:   # after every unit's forward gather, and after its own backward gather
            reduces += 1
            assert gathers >= units + reduces
    shards = sum(memory_model.fsdp2_shard_numel(shape, n, 0)
                 for shapes in UNIT_SHAPES for shape in shapes)
    assert record["state_bytes"] == 2 * 4 * shards   # parameters and momentum, counted
    allocated, timeline = record["allocated_bytes"], record["timeline"]
    assert min(held for _, held in timeline) >= record["state_bytes"]
    assert allocated["start"] == allocated["end"]   # gradients set to None again
    assert allocated["forward_end"] >= record["state_bytes"] + record["activation_bytes"]
    assert allocated["peak"] == max(held for _, held in timeline) >= max(
        allocated["forward_end"], record["state_bytes"] + record["largest_unit_gathered_bytes"])
    assert record["predicted_peak_bytes"] == memory_model.fsdp2_step_peak_bytes(
        UNIT_SHAPES, n, record["predicted_activation_bytes"])

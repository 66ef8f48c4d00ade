"""The pipeline lab: GPipe and 1F1B from scratch and torch's schedules, against one process
trained on the whole batch; the bubble, the micro-batches in flight and the bytes sent,
against the cost models. The chapter runs p = 2 and 4 under controlled time and asserts
the same (pipeline.md, hidden cells: every schedule at p = 4, m = 1, 2, 4 and 8, and
GPipe and 1F1B at p = 2, m = 1 to 8, and the deadlock's one line per stage); here p = 1
and 3, the loss-scale pitfall, the traces of --profile, and bad input."""

from pathlib import Path

import pytest

import pipeline
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.runtime.launch import run_lab
from labkit.parallel.pipeline_schedules import schedule_order


SHAPE = pipeline.SHAPE
# the runs under controlled time (the result fixture's), marked: `-m timed` selects them
ALONE = pytest.mark.timed
COMPUTE_MS = 10
TIMED = ["--compute-ms", COMPUTE_MS]
# p -> (micro-batch counts, options): one launch per p, every schedule, m = 1 and m >= p;
# one process times the real computation, the others run under controlled time
RUNS = {1: ("1,4", []),
        3: ("1,3,5", [*TIMED, "--microbatch-size", "2"])}   # odd p; m that 16 does not divide
PROFILED = 3   # the launch that also writes traces of its first m (--profile)


@pytest.fixture(scope="module", params=sorted(RUNS))
def result(request, tmp_path_factory):
    p = request.param
    microbatches, options = RUNS[p]
    schedules = ",".join(pipeline.SCHEDULES + ("no_loss_scale",))
    if p == 1:
        schedules = schedules.replace("torch_interleaved,", "")
    if p == PROFILED:
        options = [*options, "--profile", tmp_path_factory.mktemp("pipeline-profile")]
    return run_lab("pipeline", None if p == 1 else p, [
        "--schedule", schedules, "--microbatches", microbatches, *options], echo=False)


@ALONE
def test_the_result_says_where_it_came_from(result):
    assert_lab_metadata(result, "pipeline")
    assert result["pp"] == result["world_size"]
    assert result["compute_ms"] == (None if result["pp"] == 1 else COMPUTE_MS)
    assert [s["microbatches"] for s in result["sweep"]] == [
        int(m) for m in RUNS[result["pp"]][0].split(",")]
    first = result["sweep"][0]
    assert result["schedules"] == first["schedules"] and result["batch"] == first["batch"]
    fields = {"max_param_diff", "expected_equal", "step_time_s", "bubble_fraction",
              "predicted_bubble_fraction", "peak_microbatches_in_flight",
              "predicted_peak_microbatches_in_flight", "p2p_bytes_per_rank",
              "predicted_p2p_bytes_per_rank", "ops_over_compute_ms", "handoff_latency_s",
              "handoff_latency_range_s", "predicted_bubble_fraction_with_handoff",
              "predicted_bubble_fraction_with_handoff_range", "profile"}
    for entry in result["sweep"]:
        for name, r in entry["schedules"].items():
            assert set(r) == fields, name


@ALONE
def test_every_schedule_matches_one_process_and_the_pitfall_does_not(result):
    for entry in result["sweep"]:
        m, ran = entry["microbatches"], entry["schedules"]
        assert {"gpipe", "1f1b", "torch_gpipe", "no_loss_scale"} <= set(ran)
        for name, r in ran.items():
            if name == "no_loss_scale" and m > 1:   # gradients m times too large
                assert not r["expected_equal"] and r["max_param_diff"] > 1e-4, (m, name)
            else:
                assert r["expected_equal"] and r["max_param_diff"] <= 1e-5, (m, name)


@ALONE
def test_torch_schedules_run_where_torch_allows_them(result):
    p = result["pp"]
    for entry in result["sweep"]:
        m, ran, skipped = entry["microbatches"], entry["schedules"], entry["skipped"]
        # 1F1B refuses m < p; the interleaved schedule runs m // p rounds (at least one),
        # which must divide m
        refused = ({"torch_1f1b"} if m < p else set()) | (
            {"torch_interleaved"} if p > 1 and m % max(1, m // p) else set())
        assert set(skipped) == refused, (p, m)
        assert "torch_gpipe" in ran and (p == 1 or "torch_interleaved" in set(ran) | refused)


@ALONE
@ALONE
@pytest.mark.parametrize("result", [PROFILED], indirect=True)
def test_each_stage_s_trace_holds_its_sends_and_receives(result):
    """--profile: the traces of each schedule's two profiled steps at m = 1 (read by
    labkit.predict.trace_reader): each of a rank's virtual stages k of V sends its
    activation on unless it is the last and its input's gradient back unless it is the
    first, and receives as many (the first and last stage once a step, the middle one
    twice, without interleaving); and each rank has a bubble fraction, the share of its
    window it spent not computing."""
    from labkit.predict import trace_reader
    first = result["sweep"][0]
    assert first["microbatches"] == 1
    for name, r in first["schedules"].items():
        traces = sorted(Path(r["profile"]).parent.glob(f"{name}-m1-p3-rank*.json"))
        ranks = trace_reader.analyze_all([(p.name, trace_reader.load_file(p))
                                          for p in traces])["ranks"]
        assert list(ranks) == [0, 1, 2], name
        v = pipeline.chunks_of(name, pipeline.parse_args([]))
        for rank, t in ranks.items():
            stages = [chunk * 3 + rank for chunk in range(v)]
            per_step = sum((k < 3 * v - 1) + (k > 0) for k in stages)
            assert t["collectives"] == {"recv": 2 * per_step, "send": 2 * per_step}, (name, rank)
            assert 0 < t["bubble_fraction"] < 1


def test_in_flight_and_bytes_equal_the_prediction_exactly(result):
    p = result["pp"]
    for entry in result["sweep"]:
        m, micro = entry["microbatches"], entry["batch"] // entry["microbatches"]
        for name, r in entry["schedules"].items():
            assert r["peak_microbatches_in_flight"] == r["predicted_peak_microbatches_in_flight"]
            assert r["p2p_bytes_per_rank"] == r["predicted_p2p_bytes_per_rank"], name
        # by hand: GPipe holds all m, 1F1B p - s; an inner stage sends b/m x s x h fp32 values
        # forward and as many back per micro-batch, an end stage one way
        assert entry["schedules"]["gpipe"]["peak_microbatches_in_flight"] == [m] * p
        assert entry["schedules"]["1f1b"]["peak_microbatches_in_flight"] == [
            min(p - s, m) for s in range(p)]
        one_way = m * micro * SHAPE.seq * SHAPE.hidden * 4
        assert entry["schedules"]["gpipe"]["p2p_bytes_per_rank"] == (
            [0] if p == 1 else [one_way] + [2 * one_way] * (p - 2) + [one_way])


@ALONE
def test_the_bubble_under_controlled_time_follows_the_prediction_with_the_handoff(result):
    # The time between ops (a message, a process waking up) is idle time the textbook
    # formula leaves out; the lab measures it in the same launch (the handoff) and predicts
    # the step's critical path with it. The measured bubble lies within the range the
    # launch's own handoff samples give (pipeline.bubble_bounds), loaded machine or not.
    p = result["pp"]
    if result["compute_ms"] is None:
        return   # the real computation: the CPU's timeline, not the schedule's
    assert len(result["handoff_latency_samples_s"]) == pipeline.HANDOFF_ROUNDS
    for entry in result["sweep"]:
        m = entry["microbatches"]
        for name, r in entry["schedules"].items():
            if name == "torch_interleaved":
                continue   # its own formula, checked in the chapter
            assert r["predicted_bubble_fraction"] == (p - 1) / (m + p - 1)
            low, high = r["predicted_bubble_fraction_with_handoff_range"]
            assert low <= r["predicted_bubble_fraction_with_handoff"] <= high
            lowest, highest = pipeline.bubble_bounds(r)
            assert lowest <= r["bubble_fraction"] <= highest, (m, name, r["bubble_fraction"],
                                                                 lowest, highest)


def test_schedule_orders_run_every_op_once_forward_first():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 5, 8):
            for kind in ("gpipe", "1f1b"):
                for stage in range(p):
                    order = schedule_order(kind, p, stage, m)
                    assert sorted(order) == sorted([("F", i) for i in range(m)]
                                                   + [("B", i) for i in range(m)])
                    assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(pipeline.parse_args, ["--microbatches", "3"], "--microbatches 3 does not divide")
    assert_refused(pipeline.parse_args, ["--microbatches", "0"], "--microbatches must be at least 1")
    assert_refused(pipeline.parse_args, ["--schedule", "zero_bubble"], "invalid choice")
    assert_refused(pipeline.parse_args, ["--compute-ms", "-1"], "--compute-ms must be at least 0")
    assert_fails_with_one_line(script("pipeline", "--microbatches", "5"),
                               "--microbatches 5 does not divide --batch 16")
    assert_fails_with_one_line(script("pipeline", "--schedule", "torch_interleaved"),
                               "needs at least 2 pipeline stages")

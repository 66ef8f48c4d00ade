"""The pipeline lab: GPipe and 1F1B from scratch and torch's schedules, the zero-bubble ones
included, against one process trained on the whole batch; the bubble, the micro-batches in
flight and the bytes sent, against the cost models. The chapter runs p = 4 under
controlled time and asserts the same (pipeline.md, hidden cells: its schedules at m = 2,
4 and 8, and the deadlock's one line per stage); here p = 1 and 3 (every zero-bubble
schedule at the odd p = 3: ZB-V and DualPipeV's V of 2p pieces needs no even p, DualPipeV
only m >= 2p), the loss-scale pitfall, the traces of --profile, the device guard (p = 1
and 2), bad input, and the zero-bubble cost models against torch's own orders and the
published counts."""

import re
import time
from pathlib import Path

import pytest
import torch

import pipeline
from conftest import assert_fails_with_one_line, assert_lab_metadata, assert_refused
from labkit.predict import memory_model, time_model
from labkit.runtime.launch import LabError, run_lab
from labkit.parallel.pipeline_schedules import schedule_order


SHAPE = pipeline.SHAPE
# the launch under controlled time (the result fixture's p = 3) is marked: every test of it
# is `-m timed`, so that the launch runs once, in the phase that runs the timed tests alone
ALONE = pytest.mark.timed
COMPUTE_MS = 5   # ms per controlled forward, as the chapter runs it
TIMED = ["--compute-ms", COMPUTE_MS]
# p -> (micro-batch counts, options): one launch per p, every schedule, m = 1 and m >= p;
# one process times the real computation, the others run under controlled time
# at p = 3: m = 1 (fewer than p), 4 (rounds of 4, not p) and 6 (DualPipeV's least, 2p)
RUNS = {1: ("1,4", []),
        3: ("1,4,6", [*TIMED, "--microbatch-size", "2"])}   # odd p; m that 16 does not divide
PROFILED = 3   # the launch that also writes traces of its first m (--profile)
# The world of one runs under the device guard (distenv.device_guard_on): anything made
# without naming its device would be a meta tensor and fail, as it would beside a GPU's.
# Not the timed launch: the guard's mode adds a Python call to every tensor operation.
GUARD = {"LABS_DEVICE_GUARD": "1"}
GUARDED = 1


LAUNCHES = [pytest.param(p, marks=ALONE) if TIMED[0] in RUNS[p][1] else p for p in sorted(RUNS)]


@pytest.fixture(scope="module", params=LAUNCHES)
def result(request, tmp_path_factory):
    p = request.param
    microbatches, options = RUNS[p]
    schedules = ",".join(name for name in pipeline.SCHEDULES + ("no_loss_scale",)
                         if p > 1 or name not in pipeline.MULTI_PIECE)   # one stage: one piece
    if p == PROFILED:
        options = [*options, "--profile", tmp_path_factory.mktemp("pipeline-profile")]
    return run_lab("pipeline", None if p == 1 else p, [
        "--schedule", schedules, "--microbatches", microbatches, *options],
        env=GUARD if p == GUARDED else None, echo=False)


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
              "handoff_latency_range_s", "handoff_latency_step_max_s",
              "predicted_bubble_fraction_with_handoff",
              "predicted_bubble_fraction_with_handoff_range", "profile"}
    for entry in result["sweep"]:
        for name, r in entry["schedules"].items():
            assert set(r) == fields, name


def test_every_schedule_matches_one_process_and_the_pitfall_does_not(result):
    for entry in result["sweep"]:
        m, ran = entry["microbatches"], entry["schedules"]
        assert {"gpipe", "1f1b", "torch_gpipe", "no_loss_scale"} <= set(ran)
        for name, r in ran.items():
            if name == "no_loss_scale" and m > 1:   # gradients m times too large
                assert not r["expected_equal"] and r["max_param_diff"] > 1e-4, (m, name)
            else:
                assert r["expected_equal"] and r["max_param_diff"] <= 1e-5, (m, name)


def test_torch_schedules_run_where_torch_allows_them(result):
    p = result["pp"]
    for entry in result["sweep"]:
        m, ran, skipped = entry["microbatches"], entry["schedules"], entry["skipped"]
        # 1F1B refuses m < p; the interleaved schedules run m // p rounds (at least one),
        # which must divide m; DualPipeV needs m >= 2p
        refused = ({"torch_1f1b"} if m < p else set()) | (
            {"torch_interleaved", "torch_zb1p"} if p > 1 and m % max(1, m // p) else set()) | (
            {"torch_dualpipev"} if p > 1 and m < 2 * p else set())
        assert set(skipped) == refused, (p, m)
        # one stage runs none of the schedules that give a rank several pieces
        assert "torch_gpipe" in ran and (set(pipeline.MULTI_PIECE) <= set(ran) | refused
                                         if p > 1 else not set(pipeline.MULTI_PIECE) & set(ran))
    if p == 3:   # the odd world runs every zero-bubble schedule at some m
        assert set(pipeline.ZERO_BUBBLE) <= {name for entry in result["sweep"]
                                             for name in entry["schedules"]}


@pytest.mark.parametrize("result", [pytest.param(PROFILED, marks=ALONE)], indirect=True)
def test_each_stage_s_trace_holds_its_sends_and_receives(result):
    """--profile: the traces of each schedule's two profiled steps at m = 1 (read by
    labkit.predict.trace_reader): each of a rank's pieces k of V sends its activation on
    unless it is the last and its input's gradient back unless it is the first, and
    receives as many (the first and last stage once a step, the middle one twice, without
    interleaving), except to a piece on its own rank (the two middle pieces of a V); and
    each rank has a bubble fraction, the share of its window it spent not computing."""
    from labkit.predict import trace_reader
    first = result["sweep"][0]
    assert first["microbatches"] == 1
    for name, r in first["schedules"].items():
        traces = sorted(Path(r["profile"]).parent.glob(f"{name}-m1-p3-rank*.json"))
        ranks = trace_reader.analyze_all([(p.name, trace_reader.load_file(p))
                                          for p in traces])["ranks"]
        assert list(ranks) == [0, 1, 2], name
        v = pipeline.chunks_of(name, pipeline.parse_args([]))
        rank_of = {k: r for r in range(3) for k in pipeline.pieces_of(name, r, 3, v)}
        for rank, t in ranks.items():
            per_step = sum((k < 3 * v - 1 and rank_of[k + 1] != rank)
                           + (k > 0 and rank_of[k - 1] != rank)
                           for k in pipeline.pieces_of(name, rank, 3, v))
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
        gpipe_sent = [0] if p == 1 else [one_way] + [2 * one_way] * (p - 2) + [one_way]
        assert entry["schedules"]["gpipe"]["p2p_bytes_per_rank"] == gpipe_sent
        # a V's micro-batch crosses the ranks down and back up: twice GPipe's bytes
        for name in ("torch_zbv", "torch_dualpipev"):
            if name in entry["schedules"]:
                assert entry["schedules"][name]["p2p_bytes_per_rank"] == [
                    2 * b for b in gpipe_sent], (m, name)


def test_the_bubble_under_controlled_time_follows_the_prediction_with_the_handoff(result):
    # The time between ops (a message, a process waking up) is idle time the textbook
    # formula leaves out; the lab measures it in the same launch (the handoff) and predicts
    # the step's critical path with it. The measured bubble lies within the range the
    # launch's own handoffs give (pipeline.bubble_bounds), loaded machine or not: its
    # samples, and the longest handoff each step showed, which load arriving after the
    # samples lengthens too.
    p = result["pp"]
    if result["compute_ms"] is None:
        return   # the real computation: the CPU's timeline, not the schedule's
    assert len(result["handoff_latency_samples_s"]) == pipeline.HANDOFF_ROUNDS
    for entry in result["sweep"]:
        m = entry["microbatches"]
        for name, r in entry["schedules"].items():
            if name in pipeline.ZERO_BUBBLE:   # the walk of its order, equal F, I and W
                assert r["predicted_bubble_fraction"] == \
                    time_model.zero_bubble_bubble_fraction(pipeline.ZERO_BUBBLE[name], p,
                                                           m, 1, 1, 1)
            elif name != "torch_interleaved":   # its own formula, checked in the chapter
                assert r["predicted_bubble_fraction"] == (p - 1) / (m + p - 1)
            low, high = r["predicted_bubble_fraction_with_handoff_range"]
            assert low <= r["predicted_bubble_fraction_with_handoff"] <= high
            # one host: some stage waited for a neighbour's op and its handoff was timed
            assert r["handoff_latency_step_max_s"] > 0, (m, name)
            lowest, highest = pipeline.bubble_bounds(r)
            assert lowest <= r["bubble_fraction"] <= highest, (m, name, r["bubble_fraction"],
                                                                 lowest, highest)


def test_a_steps_own_handoffs_are_timed_where_the_stage_was_waiting():
    def rank(clock, start, *events):
        return {"clock": clock, "start": start, "events": [
            {"op": op, "microbatch": 0, "piece": piece, "end_s": end, "wait_s": wait}
            for op, piece, end, wait in events]}
    ranks = [rank("a", 100.0, ("F", 0, 0.010, None), ("B", 0, 0.050, [0.020, 0.031])),
             rank("a", 100.002, ("F", 1, 0.020, [0.0, 0.0105]), ("B", 1, 0.028, None)),
             rank("a", 100.0, ("F", 2, 0.040, [0.035, 0.041]))]   # asked after: not counted
    shown = pipeline.step_handoffs(ranks)
    # stage 1 waited from 100.002 for stage 0's F, which ended at 100.010: in hand at
    # 100.0125; stage 0 waited from 100.020 for stage 1's B, ended 100.030, in hand 100.031
    assert shown == pytest.approx([0.001, 0.0025])
    ranks[2]["clock"] = "b"   # two hosts: two clocks, nothing timed across them
    assert pipeline.step_handoffs(ranks) is None


@pytest.mark.parametrize("result", [GUARDED], indirect=True)
def test_one_process_runs_every_schedule_under_the_device_guard(result):
    # the same checks as unguarded (the tests above, on this very result): built where
    # they run, the model and every tensor of the step are the CPU's, none the default's
    assert result["device_guard"] is True and result["device"] == "cpu"
    assert {"gpipe", "1f1b", "torch_gpipe", "torch_1f1b"} <= set(result["schedules"])


def test_two_stages_run_every_schedule_under_the_device_guard():
    """Two stages, every schedule that takes m = 2 (all but DualPipeV), under the device
    guard: the sends' and receives' buffers,
    torch's stages and the handoff probe are all made on the run's device, and the results
    are those of an unguarded run (each exactly as predicted, or within 1e-5 of one
    process)."""
    result = run_lab("pipeline", 2, ["--microbatches", 2, "--steps", 2], env=GUARD,
                     echo=False)
    assert result["device_guard"] is True and result["backend"] == "gloo"
    ran = result["schedules"]
    # DualPipeV needs m >= 2p; its stages and runtime are ZB-V's, which runs here
    assert set(ran) == set(pipeline.SCHEDULES) - {"torch_dualpipev"}, ran
    assert set(result["sweep"][0]["skipped"]) == {"torch_dualpipev"}
    for name, r in ran.items():
        assert r["max_param_diff"] <= 1e-5, name
        assert r["peak_microbatches_in_flight"] == r["predicted_peak_microbatches_in_flight"]
        assert r["p2p_bytes_per_rank"] == r["predicted_p2p_bytes_per_rank"], name
    assert len(result["handoff_latency_samples_s"]) == pipeline.HANDOFF_ROUNDS


class FakeWork:
    """A work as NCCL's behaves: wait() returns at once (it only orders the stream), and
    is_completed() turns true after `polls` calls; wait(timeout) on an unfinished one
    raises, as torch's does once the timeout has passed (`raises=False`: as an old torch)."""

    def __init__(self, polls, raises=True):
        self.polls, self.raises, self.waits = polls, raises, []

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is not None and self.polls >= 0 and self.raises:
            raise RuntimeError("timed out in blocking wait")


def test_a_wait_on_nccl_returns_when_the_message_is_in_or_gives_up():
    """wait_for_work on a CUDA device: it asks is_completed() until the work is done, not
    trusting wait() (a stream wait on NCCL), then calls wait() once, with the timeout if
    there is one; it gives up by itself at 0.8 of the timeout, before NCCL's watchdog
    would tear the process down at the group's timeout, and never calls wait() then (a
    timed wait() past its timeout aborts the communicator)."""
    import datetime
    from labkit.runtime.timing import wait_for_work
    cuda = torch.device("cuda", 0)   # only its type is read: no GPU needed
    work = FakeWork(polls=1000)
    wait_for_work(work, cuda)
    assert work.polls == -1 and work.waits == [None]
    work = FakeWork(polls=3)
    wait_for_work(work, cuda, timeout_s=5)
    assert work.polls == -1 and work.waits == [datetime.timedelta(seconds=5)]
    work = FakeWork(polls=10 ** 12)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="not done within 0.08 s"):
        wait_for_work(work, cuda, timeout_s=0.1)
    assert work.waits == [] and 0.08 <= time.perf_counter() - start < 0.1 + 5
    work = FakeWork(polls=10 ** 12)   # on the CPU (gloo): wait() itself blocks, as before
    wait_for_work(work, torch.device("cpu"))
    assert work.waits == [None] and work.polls == 10 ** 12


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


# The zero-bubble cost models, without a launch: torch's own orders, the published counts,
# and the memory they hold.

def torch_zero_bubble_orders(schedule, p, m, v=2):
    """{rank: [(op, micro-batch, piece)]}: torch's own order for every rank of `schedule`,
    its overlapped pairs as their two ops. Each class computes every rank's order in its
    constructor from a few attributes (_calculate_single_rank_operations), set here
    directly: no stages, no process group."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.schedules import _ComputationType as Op
    from labkit.parallel.strategies import TORCH_SCHEDULES
    name = TORCH_SCHEDULES[schedule]
    if not hasattr(schedules, name):
        pytest.skip(f"torch {torch.__version__} has no {name}")
    plan = object.__new__(getattr(schedules, name))
    plan.pp_group_size, plan._n_microbatches, plan.n_local_stages = p, m, v
    plan._num_stages = plan.num_stages = v * p
    plan.number_of_rounds = max(1, m // p)
    plan.microbatches_per_round = m // plan.number_of_rounds
    plan.pipeline_order = {r: plan._calculate_single_rank_operations(r) for r in range(p)}
    letters = {Op.FORWARD: "F", Op.FULL_BACKWARD: "B", Op.BACKWARD_INPUT: "I",
               Op.BACKWARD_WEIGHT: "W"}
    orders = {}
    for rank, actions in plan.pipeline_order.items():   # None: a slot left idle
        ops = [sub for a in actions if a is not None
               for sub in (a.sub_actions if a.computation_type == Op.OVERLAP_F_B else [a])]
        orders[rank] = [(letters[a.computation_type], a.microbatch_index, a.stage_index)
                        for a in ops]
    return orders


@pytest.mark.parametrize("schedule", time_model.ZERO_BUBBLE_SCHEDULES)
def test_zero_bubble_orders_are_torchs_own(schedule):
    """time_model.zero_bubble_order, which prices a step without torch, runs every rank's
    ops in torch's order, at p = 1 to 5, the m torch takes among 1 to 6, 8, 9 and 12 (fewer
    than p, p, between, multiples and not), v = 1 to 3."""
    checked = 0
    for p in range(1, 6):
        for m in (1, 2, 3, 4, 5, 6, 8, 9, 12):
            for v in ((1, 2, 3) if schedule == "zb1p" else (2,)):
                if (schedule == "zb1p" and m % max(1, m // p)) or (
                        schedule == "dualpipev" and m < 2 * p):
                    continue   # torch refuses it
                theirs = torch_zero_bubble_orders(schedule, p, m, v)
                for rank in range(p):
                    assert time_model.zero_bubble_order(schedule, p, rank, m, v) == \
                        theirs[rank], (p, m, v, rank)
                    checked += 1
    assert checked >= 40   # the loop compared something (DualPipeV takes the fewest m)
    with pytest.raises(ValueError, match="m >= 2p"):
        time_model.zero_bubble_order("dualpipev", 3, 0, 5)


def idle_per_rank(schedule, p, m, f, b, w, v=2):
    """Seconds each rank idles in the walked step: the step less its busy time."""
    pieces = len(time_model.zero_bubble_pieces(schedule, p, 0, v))
    return time_model.zero_bubble_step_time(schedule, p, m, f, b, w, v) - \
        pieces * m * (f + b + w)


TIMES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1.3, 1.7, 0.6), (1, 3, 0.2), (1, 1, 0.5),
         (1, 0.5, 1), (1, 1, 2), (0.5, 1, 1)]   # (F, B, W): equal, and each one longest


def test_published_counts_against_the_walk_of_the_orders():
    """The published counts (time_model.published_bubble_s) against the critical path of
    the orders: 1F1B's (p-1)(F+B+W) is the from-scratch 1F1B's walk with B + W as one
    backward; Qi et al.'s ZB-H1 count (p-1)(F+B-W) is torch's ZB1P's exactly while W <= F
    and W <= B, and (p-1) max(F, B) past them; ZB-V's 0 within each rank's span leaves
    (p-1)F to a step that starts together; DualPipeV idles (p-1)F at equal times, below
    DeepSeek-V3's count for the pair run whole, 2(p-1)F."""
    for p in range(1, 6):
        for f, b, w in TIMES:
            for m in (p, 2 * p + 1, 4 * p):
                one_f_one_b = {s: schedule_order("1f1b", p, s, m) for s in range(p)}
                orders = {s: [(op, i, s) for op, i in order]
                          for s, order in one_f_one_b.items()}
                durations = {s: [f if op == "F" else b + w for op, _ in order]
                             for s, order in one_f_one_b.items()}
                walked = time_model.pipeline_step_time(orders, durations) - m * (f + b + w)
                assert walked == pytest.approx(time_model.published_bubble_s("1f1b", p, f, b, w))
                for v in (1, 2, 3):
                    if m % max(1, m // p):
                        continue
                    idle = idle_per_rank("zb1p", p, m, f, b, w, v)
                    assert idle == pytest.approx((p - 1) * max(f + b - w, f, b)), (p, m, f, b, w)
                    if w <= min(f, b):
                        assert idle == pytest.approx(
                            time_model.published_bubble_s("zb1p", p, f, b, w))
        for m in range(2 * p - 1, 4 * p + 1):
            assert idle_per_rank("zbv", p, m, 1, 1, 1) == pytest.approx(
                time_model.published_bubble_s("zbv", p, 1, 1, 1) + (p - 1))
        for m in range(2 * p, 4 * p + 1):
            assert idle_per_rank("dualpipev", p, m, 1, 1, 1) == pytest.approx(p - 1)
            assert time_model.published_bubble_s("dualpipev", p, 1, 1, 1) == 2 * (p - 1)
    with pytest.raises(ValueError, match="F = B = W"):
        time_model.published_bubble_s("zbv", 4, 1, 1, 0.5)
    # as fractions of the step: idle over idle plus each rank's busy time
    assert time_model.published_bubble_fraction("zb1p", 4, 8, 1, 1, 1) == 3 / (3 + 48)
    assert time_model.published_bubble_fraction("1f1b", 4, 8, 1, 1, 1) == 9 / (9 + 24) \
        == time_model.pipeline_bubble_fraction(4, 8)


def test_zero_bubble_memory_by_hand():
    """Micro-batches held from their forward until their W: ZB1P (v-1) r + p on every rank
    (r micro-batches per round), ZB-V 2p pieces' worth (p stages', 1F1B's first stage's),
    DualPipeV 2p + 1 (DeepSeek-V3's PP + 1 over PP = 2p stages), once m is large; fewer
    below."""
    for p in range(1, 6):
        for m in (2 * p, 3 * p, 4 * p):
            for v in (1, 2, 3):
                per_round = m // max(1, m // p)
                assert memory_model.zero_bubble_peak_microbatches("zb1p", p, m, v) == \
                    [(v - 1) * per_round + p] * p
            assert memory_model.zero_bubble_peak_microbatches("zbv", p, m) == [2 * p] * p
            assert memory_model.zero_bubble_peak_microbatches("dualpipev", p, m) == \
                [2 * p + 1] * p
    assert memory_model.zero_bubble_peak_microbatches("zbv", 4, 4) == [5, 6, 7, 8]
    assert memory_model.zero_bubble_peak_microbatches("zb1p", 4, 2) == [4, 4, 4, 4]   # m v


def test_a_deadlocked_stage_stays_for_its_peers_only_while_nccl_lets_it():
    """After its line, a stage stays DEADLOCK_GRACE_S for its peers' lines; on NCCL no
    longer than half what the watchdog leaves after the stage gave up (a --p2p-timeout
    equal to a short --timeout would otherwise be ended mid-stay)."""
    import argparse
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    args = argparse.Namespace(timeout=3.0, p2p_timeout=3.0)
    assert pipeline.deadlock_grace_s(args, cpu) == pipeline.DEADLOCK_GRACE_S
    assert pipeline.deadlock_grace_s(args, cuda) == pytest.approx(0.3)   # (3 - 0.8 x 3) / 2
    assert pipeline.deadlock_grace_s(argparse.Namespace(timeout=120.0, p2p_timeout=1.0),
                                     cuda) == pipeline.DEADLOCK_GRACE_S


def test_the_deadlock_is_each_stage_waiting_on_the_next_and_the_right_order_finishes():
    """recv_before_send at the odd p = 3: every stage gives up, in one line, on a wait; the
    waits form a cycle (stages 0 and 1 on each other; 2 on 1). The positive control: GPipe's
    order, same world, m and --p2p-timeout, finishes, so the timeout is not what stops it."""
    same = ["--microbatches", 2, "--steps", 1, "--p2p-timeout", 2]
    with pytest.raises(LabError) as error:
        run_lab("pipeline", 3, ["--schedule", "recv_before_send", *same], echo=False)
    waits = sorted(tuple(map(int, found)) for found in re.findall(
        r"stage (\d+) waited [\d.]+ s for .*? from rank (\d+) and gave up \(--p2p-timeout\): "
        r"nothing came", error.value.output))
    assert sorted(set(waits)) == [(0, 1), (1, 0), (2, 1)], error.value.output
    control = run_lab("pipeline", 3, ["--schedule", "gpipe", *same], echo=False)
    assert control["schedules"]["gpipe"]["max_param_diff"] <= 1e-5

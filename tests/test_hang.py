"""Ranks out of step. The chapter on hangs (hangs.md) runs the four desynchronisations on
2 ranks and asserts, in hidden cells, that each ends where the cost model predicts
(labkit/predict/hang_model.py), within the group's timeout, with a message, never a hang: the
skipped all-reduce with every thread's stack, the wrong shape in gloo's words,
TORCH_DISTRIBUTED_DEBUG=DETAIL naming the mismatched op and shapes, the sleeping rank given
up on. Here the model by hand (on gloo and on NCCL, a rank that has left, a straggler), the
lab against it on 3 ranks, a rank that exits, the run where no rank breaks step, the stack
dump on SIGUSR2, the flight-recorder option, and bad input."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

import hang
from conftest import assert_fails_with_one_line, assert_refused
from labkit.predict import hang_model
from conftest import LABS
from labkit.predict.hang_model import BACKEND, CLOSED, NAMED, TIMEOUT, Collective, Wait
from labkit.runtime.launch import LabError, run_lab

T = 2.0


def programs(mode, world, breaking_rank=1, steps=5, at_step=2):
    return [hang_model.lab_program(mode, r, steps, at_step, breaking_rank, 4, T)
            for r in range(world)]


def test_a_skipped_collective_shifts_the_order_until_the_operations_differ():
    # rank 1's all-reduces of steps 3 and 4 meet rank 0's of steps 2 and 3, silently; then
    # rank 0's last all-reduce meets rank 1's barrier, and neither completes
    assert hang_model.where_ranks_wait(programs("skip_collective", 2), T) == {
        0: Wait("the all-reduce of step 4", T, TIMEOUT), 1: Wait("the final barrier", T, TIMEOUT)}
    waits = hang_model.where_ranks_wait(programs("skip_collective", 3, breaking_rank=2), T)
    assert [waits[r].label for r in range(3)] == ["the all-reduce of step 4"] * 2 + [
        "the final barrier"]
    # DETAIL compares the operations first: named at once, at the same place
    assert hang_model.where_ranks_wait(programs("skip_collective", 2), T, checked=True) == {
        0: Wait("the all-reduce of step 4", 0.0, NAMED), 1: Wait("the final barrier", 0.0, NAMED)}


def test_one_collective_too_many_is_a_skip_seen_from_the_other_side():
    # a metric all-reduced on rank 0 alone, after step 1: rank 0 is one call ahead
    steps = [Collective(f"step {s}", "all_reduce", 4) for s in range(3)]
    extra = Collective("the metric", "all_reduce", 1)
    barrier = Collective("the barrier", "barrier")
    rank0 = steps[:2] + [extra] + steps[2:] + [barrier]
    waits = hang_model.where_ranks_wait([rank0, steps + [barrier]], T)
    # the metric (1 element) meets rank 1's step 2 (4 elements): the sizes differ there
    assert waits == {0: Wait("the metric", None, BACKEND), 1: Wait("step 2", None, BACKEND)}


def test_a_late_rank_is_waited_for_up_to_the_timeout_and_then_given_up_on():
    assert hang_model.where_ranks_wait(programs("sleep", 3), T) == {
        0: Wait("the all-reduce of step 2", T, TIMEOUT),
        2: Wait("the all-reduce of step 2", T, TIMEOUT)}   # rank 1 says nothing
    slow = [[Collective("step 0", "all_reduce", 4, late_s=late)] for late in (0.0, T - 0.5)]
    assert hang_model.where_ranks_wait(slow, T) == {}    # late, but within the timeout
    # lateness adds up over the steps only through the slowest rank: the others wait for it
    drift = [[Collective(f"step {s}", "all_reduce", 4, late_s=0.9 * T * (r == s))
              for s in range(3)] for r in range(3)]
    assert hang_model.where_ranks_wait(drift, T) == {}


def test_a_shape_mismatch_is_up_to_the_backend_unless_checked():
    assert hang_model.where_ranks_wait(programs("wrong_shape", 2), T) == {
        r: Wait("the all-reduce of step 2", None, BACKEND) for r in range(2)}
    assert hang_model.where_ranks_wait(programs("wrong_shape", 2), T, checked=True) == {
        r: Wait("the all-reduce of step 2", 0.0, NAMED) for r in range(2)}
    assert hang_model.where_ranks_wait(programs("none", 4), T) == {}


def test_the_lab_ends_where_the_model_predicts_on_three_ranks():
    """An odd world, the breaking rank in the middle: every rank's one line names the
    collective the model predicts, after the timeout (not before it, and however busy the
    machine, before a second one)."""
    timeout = 1
    with pytest.raises(LabError) as failed:
        run_lab("hang", 3, ["--mode", "skip_collective", "--timeout", timeout], echo=False)
    said = str(failed.value)
    predicted = hang_model.where_ranks_wait(
        [hang.program(hang.parse_args(["--timeout", timeout]), r) for r in range(3)], timeout)
    for rank, wait in predicted.items():
        ended = re.findall(rf"rank {rank}: {wait.label} ended after ([\d.]+) s", said)
        assert ended and timeout - 0.1 <= float(ended[0]) < 2 * timeout, (rank, said)


def test_in_step_it_runs_clean(script, tmp_path):
    done = script("hang", "--mode", "none", "--out", tmp_path / "hang.json")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "hang.json").read_text())
    assert result["mode"] == "none" and result["steps"] == hang.STEPS


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(hang.parse_args, ["--at-step", 5], "--at-step 5 is past the last step (4)")
    assert_refused(hang.parse_args, ["--mode", "deadlock"], "invalid choice")
    assert_fails_with_one_line(script("hang"), "run 2 or more")


def test_on_nccl_what_differs_is_up_to_the_backend_and_a_barrier_is_an_all_reduce():
    # the skip run's fifth place, rank 0's all-reduce of 4 against rank 1's barrier: on
    # NCCL, an all-reduce of 4 elements against one of 1
    assert hang_model.where_ranks_wait(programs("skip_collective", 2), T, backend="nccl") == {
        0: Wait("the all-reduce of step 4", None, BACKEND),
        1: Wait("the final barrier", None, BACKEND)}
    one = [Collective("a one-element all-reduce", "all_reduce", 1)]
    barrier = [Collective("the barrier", "barrier")]
    assert hang_model.where_ranks_wait([one, barrier], T, backend="nccl") == {}   # it pairs
    assert hang_model.where_ranks_wait([one, barrier], T) == {
        0: Wait("a one-element all-reduce", T, TIMEOUT), 1: Wait("the barrier", T, TIMEOUT)}
    # DETAIL compares what the program called, whatever the backend sends
    assert hang_model.where_ranks_wait([one, barrier], T, checked=True, backend="nccl")[1] == (
        Wait("the barrier", 0.0, NAMED))


def test_a_rank_that_has_left_closes_gloo_at_once_and_is_waited_for_on_nccl():
    # rank 1 exits before the all-reduce of step 2: the others are alone at that place
    left = programs("exit", 3)
    assert [len(p) for p in left] == [6, 2, 6]
    at_step_2 = "the all-reduce of step 2"
    assert hang_model.where_ranks_wait(left, T) == {
        r: Wait(at_step_2, 0.0, CLOSED) for r in (0, 2)}
    assert hang_model.where_ranks_wait(left, T, backend="nccl") == {
        r: Wait(at_step_2, T, TIMEOUT) for r in (0, 2)}
    # DETAIL's monitored barrier runs over gloo whatever the backend: rank 0 names it
    for backend in hang_model.BACKENDS:
        assert hang_model.where_ranks_wait(left, T, checked=True, backend=backend) == {
            0: Wait(at_step_2, 0.0, NAMED), 2: Wait(at_step_2, 0.0, CLOSED)}
    # rank 0 itself gone: nobody names anyone
    assert hang_model.where_ranks_wait(programs("exit", 2, breaking_rank=0), T,
                                       checked=True) == {1: Wait(at_step_2, 0.0, CLOSED)}
    with pytest.raises(ValueError):
        hang_model.where_ranks_wait(left, T, backend="mpi")
    with pytest.raises(ValueError):
        hang_model.lab_program("deadlock", 0, 5, 2, 1, 4, T)


def test_a_straggler_makes_the_others_wait_and_waits_least_itself():
    late = 0.3   # rank 2's data loader, 0.3 s slow at every step
    steps = [[Collective(f"step {s}", "all_reduce", 4, late_s=late * (r == 2))
              for s in range(5)] for r in range(4)]
    waits = hang_model.collective_waits(steps, T)
    assert waits[2] == 0.0
    assert all(waits[r] == pytest.approx(5 * late) for r in (0, 1, 3))
    assert hang_model.where_ranks_wait(steps, T) == {}   # it never hangs: it is only slow
    # each step, a different rank the slowest: everyone waits, no one stands out as much
    rotating = [[Collective(f"step {s}", "all_reduce", 4, late_s=late * (r == s % 4))
                 for s in range(4)] for r in range(4)]
    rotated = hang_model.collective_waits(rotating, T)
    assert list(rotated.values()) == pytest.approx([3 * late] * 4)
    # the waits stop where the program stops matching (the skip run's fifth place)
    skip = hang_model.collective_waits(programs("skip_collective", 2), T)
    assert skip == {0: 0.0, 1: 0.0}


def test_a_rank_that_exits_ends_the_others_at_once_on_gloo():
    """The exit run on 2 ranks: rank 1 leaves before the all-reduce of step 2, and rank 0,
    in that all-reduce, is told at once (its connection closed), not after the timeout."""
    timeout = 20
    with pytest.raises(LabError) as failed:
        run_lab("hang", 2, ["--mode", "exit", "--timeout", timeout], echo=False)
    said = str(failed.value)
    predicted = hang_model.where_ranks_wait(
        [hang.program(hang.parse_args(["--mode", "exit", "--timeout", timeout]), r)
         for r in range(2)], timeout)
    assert predicted == {0: Wait("the all-reduce of step 2", 0.0, CLOSED)}
    ended = re.findall(r"rank 0: the all-reduce of step 2 ended after ([\d.]+) s", said)
    assert ended and float(ended[0]) < timeout / 4, said
    assert "rank 1:" not in said   # the rank that left says nothing


def test_every_thread_s_stack_on_sigusr2_and_sigusr1_left_alone():
    """`kill -USR2 PID` prints the stacks and the process goes on; SIGUSR1 is left to a
    training loop (checkpoint-and-requeue, in the chapter on running at scale)."""
    assert hang.STACKS_SIGNAL == signal.SIGUSR2
    code = ("import os, hang; hang.dump_stacks_on_signal(); "
            "os.kill(os.getpid(), hang.STACKS_SIGNAL); print('still running')")
    done = subprocess.run([sys.executable, "-c", code], cwd=LABS, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(LABS), OMP_NUM_THREADS="1"))
    assert done.returncode == 0 and "still running" in done.stdout, done.stderr
    assert "most recent call first" in done.stderr, done.stderr


def test_the_flight_recorder_option_leaves_blocking_wait_off_and_needs_nccl(
        script, tmp_path, monkeypatch):
    # what to set, by release: the names each reads first (no deprecation warning)
    assert hang_model.flight_recorder_env("2.7.1+cu126", "fr/rank_") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "fr/rank_"}
    assert hang_model.flight_recorder_env("2.8.0", "fr/rank_") == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "fr/rank_"}
    assert [hang_model.flight_recorder_default_entries(f"2.{minor}.0")
            for minor in range(6, 14)] == [0] * 5 + [2000] * 3
    variables = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
    for name in variables:
        # set, then deleted: monkeypatch restores each at the end, so what
        # arm_flight_recorder sets below does not leak into the later tests' launches
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    prefix = str(tmp_path / "fr" / "rank_")
    hang.arm_flight_recorder(prefix)
    armed = {name: os.environ[name] for name in variables if name in os.environ}
    assert armed == hang_model.flight_recorder_env(hang.torch.__version__, prefix)
    assert (tmp_path / "fr").is_dir()   # blocking wait left off, the folder made
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(SystemExit) as refused:
        hang.arm_flight_recorder(prefix)
    assert "blocking wait off" in str(refused.value)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    # ProcessGroupNCCL still reads the older alias
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(SystemExit) as refused:
        hang.arm_flight_recorder(prefix)
    assert "unset NCCL_BLOCKING_WAIT" in str(refused.value)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT")
    # an inherited 0 under either buffer name silences the recorder (ProcessGroupNCCL writes
    # no dump unless TORCH_NCCL_TRACE_BUFFER_SIZE > 0, whatever TORCH_FR_BUFFER_SIZE says)
    assert set(hang_model.FR_BUFFER_SIZES) == {"TORCH_NCCL_TRACE_BUFFER_SIZE",
                                               "TORCH_FR_BUFFER_SIZE"}
    for name in hang_model.FR_BUFFER_SIZES:
        for value in ("0", "", "-5"):
            for other in variables:
                monkeypatch.delenv(other, raising=False)
            monkeypatch.setenv(name, value)
            with pytest.raises(SystemExit) as refused:
                hang.arm_flight_recorder(prefix)
            assert f"needs {name} unset or above 0" in str(refused.value), (name, value)
        monkeypatch.delenv(name)
    # a positive size is kept; an inherited TORCH_NCCL_DUMP_ON_TIMEOUT=0 is overridden
    for name in variables:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    hang.arm_flight_recorder(prefix)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    for name in variables:
        monkeypatch.delenv(name, raising=False)
    # on gloo there is no watchdog to write the dump: refused in one line
    assert_fails_with_one_line(script("hang", "--mode", "none", "--flight-recorder", prefix),
                               "--flight-recorder needs NCCL")

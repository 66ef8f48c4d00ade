"""Ranks out of step: each desynchronisation ends within the group's timeout with a message
(never a hang); TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatched op and shapes; a stuck
rank can be made to print every thread's stack."""

import time

import pytest

import hang
from conftest import assert_fails_with_one_line, assert_refused
from labkit.launch import LabError, run_lab

TIMEOUT = 2


def failing(args, env=None):
    """Run the lab on 2 ranks, expecting it to fail; (its error text, seconds it took)."""
    started = time.monotonic()
    with pytest.raises(LabError) as error:
        run_lab("hang", 2, [*args, "--timeout", TIMEOUT], env=env, echo=False)
    return str(error.value) + error.value.output, time.monotonic() - started


def test_a_skipped_collective_times_out_and_the_stacks_show_where():
    said, took = failing(["--mode", "skip_collective", "--dump-stacks-after", 1])
    assert took < 60
    # the skip shifts every later all-reduce by one: the wait surfaces at a later step
    assert "rank 0: the all-reduce of step 4 ended after" in said
    assert "Timed out waiting" in said
    # faulthandler's dump: every thread of every rank, stuck in the lab's own frames
    assert "most recent call first" in said and "step_collective" in said


def test_a_sleeping_rank_is_given_up_on():
    said, took = failing(["--mode", "sleep"])
    assert took < 60 and "rank 0: the all-reduce of step 2 ended after" in said


def test_a_wrong_shape_is_caught_and_detail_names_it():
    said, _ = failing(["--mode", "wrong_shape"])
    assert "doesn't match expected size" in said            # gloo, after the fact
    said, _ = failing(["--mode", "wrong_shape"], env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert "Detected mismatch between collectives" in said    # before anything is sent
    assert "TensorShape=[4]" in said and "TensorShape=[5]" in said


def test_in_step_it_runs_clean():
    result = run_lab("hang", 2, ["--mode", "none", "--timeout", TIMEOUT], echo=False)
    assert result["mode"] == "none" and result["steps"] == hang.STEPS


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(hang.parse_args, ["--at-step", 5], "--at-step 5 is past the last step (4)")
    assert_refused(hang.parse_args, ["--mode", "deadlock"], "invalid choice")
    assert_fails_with_one_line(script("hang"), "run 2 or more")

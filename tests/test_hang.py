"""Ranks out of step. The chapter on running at scale (at_scale.md) runs the four
desynchronisations on 2 ranks and asserts, in a hidden cell, that each ends within the
group's timeout with a message, never a hang: the skipped all-reduce with every thread's
stack, the wrong shape in gloo's words, TORCH_DISTRIBUTED_DEBUG=DETAIL naming the
mismatched op and shapes, the sleeping rank given up on. Here the run where no rank breaks
step, and bad input."""

import pytest

import hang
from conftest import assert_fails_with_one_line, assert_refused
from labkit.launch import run_lab

TIMEOUT = 2


def test_in_step_it_runs_clean():
    result = run_lab("hang", 2, ["--mode", "none", "--timeout", TIMEOUT], echo=False)
    assert result["mode"] == "none" and result["steps"] == hang.STEPS


def test_bad_input_is_refused_in_one_line(script):
    assert_refused(hang.parse_args, ["--at-step", 5], "--at-step 5 is past the last step (4)")
    assert_refused(hang.parse_args, ["--mode", "deadlock"], "invalid choice")
    assert_fails_with_one_line(script("hang"), "run 2 or more")

"""The resilience lab: a rank killed mid-run, the group restarted by torchrun, the run resumed
from its last DCP checkpoint. The chapter runs the kill, the restart and the resume on three
ranks and asserts that the final parameters equal an uninterrupted run's bit for bit
(at_scale.md, hidden cells); here a world of one and bad input."""

import json

import resilience
from conftest import assert_fails_with_one_line, assert_refused


def test_bad_input_is_refused_in_one_line(script, tmp_path):
    assert_refused(resilience.parse_args, ["--dir", tmp_path, "--fail-at-step", 8],
                   "--fail-at-step 8 is past the last step (7)")
    assert_refused(resilience.parse_args, ["--dir", tmp_path, "--every", 0],
                   "--every must be at least 1")
    assert_fails_with_one_line(script("resilience", "--dir", tmp_path, "--fail-rank", 3),
                               "--fail-rank 3 is not a rank of a world of 1")


def test_a_run_that_never_saves_still_reports(script, tmp_path):
    """--every past the last step: no checkpoint, nothing resumed, a world of one."""
    out = tmp_path / "result.json"
    done = script("resilience", "--dir", tmp_path / "ckpt", "--every", 8, "--out", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["checkpoints"] == [] and result["resumed_from_step"] == 0
    assert result["max_param_diff_vs_uninterrupted"] == 0.0
    assert result["max_param_diff_resumed_without_rng_state"] is None
    assert result["max_param_diff_resumed_with_ddp_buckets"] == 0.0   # one rank: no sums

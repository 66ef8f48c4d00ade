"""The from-scratch ring all-reduce against dist.all_reduce, at odd and even world sizes."""

import pytest

from conftest import assert_fails_with_one_line
from launch import run_lab


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_ring_matches_library_and_counted_bytes_match_predicted(world_size):
    for numel in (1, world_size - 1, 1000003):
        result = run_lab("ring_allreduce", world_size, ["--numel", numel], echo=False)
        assert result["max_abs_err"] <= 1e-5, (numel, result["max_abs_err"])
        assert result["bytes_sent_per_rank"] == result["predicted_bytes_per_rank"]
        assert result["bytes_sent_by_rank"] == result["predicted_bytes_by_rank"]


def test_sweep_reports_every_size_with_bandwidths():
    # 4K to 8M: a range wide enough that time grows with size through any noise
    result = run_lab("ring_allreduce", 2, ["--numel", 10, "--sizes", "4K,8M", "--repeats", 3],
                     echo=False)
    assert [row["bytes"] for row in result["sweep"]] == [4096, 8 * 2 ** 20]
    for row in result["sweep"]:
        for key in ("ring_time_s", "library_time_s", "ring_busbw_gbps", "library_busbw_gbps",
                    "predicted_time_s"):
            assert row[key] > 0, key
    assert result["alpha_s"] >= 0 and result["beta_bytes_per_s"] > 0


@pytest.mark.parametrize("args, words", [
    (["--numel", 0], "--numel must be at least 1"),
    (["--sizes", "4X"], "--sizes: bad size '4X'"),
    (["--repeats", 0], "--repeats must be at least 1"),
])
def test_bad_input_exits_with_one_clear_line(script, args, words):
    assert_fails_with_one_line(script("ring_allreduce", *args), words)


def test_help_works_without_torchrun(script):
    done = script("ring_allreduce", "--help")
    assert done.returncode == 0 and "--sizes" in done.stdout and "--numel" in done.stdout

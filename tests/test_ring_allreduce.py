"""The from-scratch ring all-reduce against dist.all_reduce. The chapter runs N = 2, 3 and 4
(every length below, and a timing sweep at 2 and 4); here the odd N = 5, and bad input."""

import pytest

import ring_allreduce
from conftest import assert_fails_with_one_line, assert_refused
from labkit.launch import run_lab


def test_ring_matches_library_and_counted_bytes_match_predicted_at_n_5():
    n = 5
    # one element (four ranks get empty chunks), N - 1 elements, and a length no N divides
    result = run_lab("ring_allreduce", n, ["--numel", f"1,{n - 1},1000003"], echo=False)
    assert [check["numel"] for check in result["correctness"]] == [1, n - 1, 1000003]
    for check in result["correctness"]:
        assert check["max_abs_err"] <= 1e-5, check
        assert check["bytes_sent_per_rank"] == check["predicted_bytes_per_rank"]
        assert check["bytes_sent_by_rank"] == check["predicted_bytes_by_rank"]
        assert len(check["bytes_sent_by_rank"]) == n


@pytest.mark.parametrize("args, words", [
    (["--numel", 0], "--numel must be at least 1"),
    (["--numel", "5,0"], "--numel must be at least 1"),
    (["--sizes", "4X"], "--sizes: bad size '4X'"),
    (["--sizes", "2"], "less than one float32 element"),
    (["--repeats", 0], "--repeats must be at least 1"),
    (["--segment-bytes", 2], "--segment-bytes must be at least 4"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(ring_allreduce.parse_args, args, words)


def test_bad_input_exits_with_one_clear_line(script):
    assert_fails_with_one_line(script("ring_allreduce", "--numel", 0),
                               "--numel must be at least 1")


def test_help_works_without_torchrun(script):
    done = script("ring_allreduce", "--help")
    assert done.returncode == 0 and "--sizes" in done.stdout and "--numel" in done.stdout

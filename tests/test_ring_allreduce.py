"""The from-scratch ring all-reduce against dist.all_reduce. The chapter runs N = 2 and 4
(every length below, and a timing sweep); here the odd N = 3 and 5, and bad input."""

import pytest

import ring_allreduce
from conftest import assert_fails_with_one_line, assert_refused
from labkit.runtime.launch import run_lab


@pytest.fixture(scope="module")
def odd_worlds():
    """N = 5, and N = 3 on its first three ranks in the same launch: {N: its results}. One
    element (ranks get empty chunks), N - 1 elements at both N, and a length no N divides."""
    result = run_lab("ring_allreduce", 5, ["--numel", "1,2,4,1000003", "--sub-worlds", 3],
                     echo=False)
    assert [sub["world_size"] for sub in result["sub_worlds"]] == [3]
    return {5: result, 3: result["sub_worlds"][0]}


@pytest.mark.parametrize("n", [3, 5])
def test_ring_matches_library_and_counted_bytes_match_predicted(odd_worlds, n):
    result = odd_worlds[n]
    assert result["world_size"] == n
    assert [check["numel"] for check in result["correctness"]] == [1, 2, 4, 1000003]
    for check in result["correctness"]:
        assert check["max_abs_err"] <= 1e-5, check
        assert check["bytes_sent_per_rank"] == check["predicted_bytes_per_rank"]
        assert check["bytes_sent_by_rank"] == check["predicted_bytes_by_rank"]
        assert len(check["bytes_sent_by_rank"]) == n


def test_many_segments_of_unequal_counts_pair_up_in_their_batches():
    """With 3-element segments, 1001 elements at N = 3 give chunks of 334, 334 and 333: a
    step sends 112 segments and receives 111, or the other way round, each send paired
    with a receive in one batch_isend_irecv and the extra one alone."""
    result = run_lab("ring_allreduce", 3, ["--numel", "7,1001", "--segment-bytes", 12],
                     echo=False)
    for check in result["correctness"]:
        assert check["max_abs_err"] <= 1e-5, check
        assert check["bytes_sent_by_rank"] == check["predicted_bytes_by_rank"]


@pytest.mark.parametrize("args, words", [
    (["--numel", 0], "--numel must be at least 1"),
    (["--numel", "5,0"], "--numel must be at least 1"),
    (["--sizes", "4X"], "--sizes: bad size '4X'"),
    (["--sizes", "2"], "less than one float32 element"),
    (["--repeats", 0], "--repeats must be at least 1"),
    (["--segment-bytes", 2], "--segment-bytes must be at least 4"),
    (["--sub-worlds", 0], "--sub-worlds must be at least 1"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(ring_allreduce.parse_args, args, words)


def test_bad_input_exits_with_one_clear_line(script):
    # a refusal that needs the world's size, so it comes after the process group forms
    assert_fails_with_one_line(script("ring_allreduce", "--sub-worlds", 2),
                               "--sub-worlds 2: the world has only 1 rank")


def test_help_lists_its_options_and_launch_lines(capsys):
    with pytest.raises(SystemExit) as done:
        ring_allreduce.parse_args(["--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0 and "--sizes" in text and "--numel" in text
    assert "torchrun --standalone --nproc_per_node=8" in text

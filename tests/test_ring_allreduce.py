"""The from-scratch ring all-reduce against dist.all_reduce. The chapter runs N = 2 and 4
(every length below, and a timing sweep); here the odd N = 3 and 5 and a world of one,
under the device guard, how the ring cuts a chunk into segments, and bad input."""

import json

import pytest

import ring_allreduce
from conftest import assert_fails_with_one_line, assert_refused
from labkit.runtime.launch import run_lab


# Under the device guard (distenv.device_guard_on), a tensor made without naming its device
# is a meta tensor and fails at its first use, as it would beside a GPU's: the runs here
# check nothing but exact results, so they all run under it.
GUARD = {"LABS_DEVICE_GUARD": "1"}


@pytest.fixture(scope="module")
def odd_worlds():
    """N = 5, and N = 3 on its first three ranks in the same launch: {N: its results}. One
    element (ranks get empty chunks), N - 1 elements at both N, and a length no N divides."""
    result = run_lab("ring_allreduce", 5, ["--numel", "1,2,4,1000003", "--sub-worlds", 3],
                     env=GUARD, echo=False)
    assert result["device_guard"] is True
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


def test_segments_of_unequal_counts_pair_up_in_their_batches():
    """Segments of one element asked for (--segment-bytes 4): 7 elements at N = 3 give
    chunks of 3, 2 and 2, in segments of one; 38 give chunks of 13, 13 and 12, in segments
    of 4 (at most MAX_SEGMENTS = 4 a chunk). A step sends 3 segments and receives 2, or 4
    and 3, or the other way round, each send paired with a receive in one
    batch_isend_irecv and the extra one alone."""
    assert ring_allreduce.segment_elements(13, 4, 4) == 4
    result = run_lab("ring_allreduce", 3, ["--numel", "7,38", "--segment-bytes", 4],
                     env=GUARD, echo=False)
    for check in result["correctness"]:
        assert check["max_abs_err"] <= 1e-5, check
        assert check["bytes_sent_by_rank"] == check["predicted_bytes_by_rank"]


def test_a_step_sends_a_few_segments_whatever_the_size():
    """At most MAX_SEGMENTS sends per step to the neighbour, each of at least --segment-bytes:
    the chapter's sizes keep their 2 MiB segments (16 MiB: 4 a step at N = 2, 2 at N = 4),
    and 1 GiB on 8 GPUs is 4 segments of 32 MiB a step, 56 calls for the 14 steps, where
    2 MiB segments would make 64 a step and 896 calls, the launches' time, not the links'."""
    def per_step(size, n, segment_bytes=ring_allreduce.SEGMENT_BYTES):
        largest = -(-size // 4 // n)
        return -(-largest // ring_allreduce.segment_elements(largest, 4, segment_bytes))

    assert ring_allreduce.MAX_SEGMENTS == 4
    assert ring_allreduce.segment_elements(2 ** 20, 4) == 2 ** 19   # 4 MiB chunk: 2 MiB
    assert per_step(16 * 2 ** 20, 2) == 4 and per_step(16 * 2 ** 20, 4) == 2
    assert per_step(2 ** 30, 8) == 4 and 2 * (8 - 1) * per_step(2 ** 30, 8) == 56
    assert ring_allreduce.segment_elements(2 ** 30 // 4 // 8, 4) * 4 == 32 * 2 ** 20
    assert per_step(2 ** 20, 8) == 1   # 128 KiB chunks: one send a step
    assert per_step(1000, 2, 4) == 4   # tiny segments asked for: still no more than 4


def test_a_world_of_one_reports_no_bandwidth_and_says_why(script, tmp_path):
    """One process, no ring: the result is checked and the calls are timed, but nothing
    crosses a link, so the bus bandwidths are null (not 0) and a note says why, in the JSON
    and in the output. Under the device guard, as a plain `python labs/ring_allreduce.py`."""
    out = tmp_path / "ring1.json"
    done = script("ring_allreduce", "--numel", 1000, "--sizes", "4K,64K", "--repeats", 1,
                  "--out", out, env_extra=GUARD)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["device_guard"] is True
    assert result["note"] == ring_allreduce.ONE_RANK and ring_allreduce.ONE_RANK in done.stdout
    assert result["correctness"][0]["max_abs_err"] == 0
    assert result["correctness"][0]["bytes_sent_per_rank"] == 0
    assert result["alpha_s"] is None and result["beta_bytes_per_s"] is None
    for row in result["sweep"]:
        assert row["ring_busbw_gbps"] is None and row["library_busbw_gbps"] is None
        assert row["ring_over_library_busbw"] is None and row["segments_per_step"] == 0
        assert row["ring_time_s"] > 0 and row["library_time_s"] > 0


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

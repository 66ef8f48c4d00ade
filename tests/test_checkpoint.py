"""Sharded checkpoints: training resumes at another world size exactly where an
uninterrupted run would be, and the full export loads into a plain model. The chapter saves
at N = 4 and resumes in one process; here one process saves and three ranks resume, and the
failures."""

import pytest

import checkpoint
from labkit.parallel import sharded_checkpoint
from conftest import assert_fails_with_one_line, assert_refused
from labkit.runtime.launch import run_lab


@pytest.fixture(scope="module")
def saved_by_one(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    result = run_lab("checkpoint", None, ["save", "--dir", folder, "--steps", 2], echo=False)
    # a world of one, without torchrun
    return folder, result


def test_save_writes_shards_and_a_full_export(saved_by_one):
    folder, result = saved_by_one
    assert result["world_size"] == 1 and result["step"] == 2 and result["phase"] == "save"
    assert len(list(folder.glob("*.distcp"))) == 1   # one file per rank
    assert result["full_export_bytes"] > 4 * result["param_count"]   # fp32, plus names
    assert result["checkpoint_bytes"] > result["full_export_bytes"]  # + momentum, metadata


def test_resume_at_another_world_size_equals_an_uninterrupted_run(saved_by_one):
    folder, _ = saved_by_one
    result = run_lab("checkpoint", 3, ["resume", "--dir", folder, "--steps", 2], echo=False)
    assert result["saved_world_size"] == 1 and result["world_size"] == 3
    assert result["resumed_from_step"] == 2 and result["total_steps"] == 4
    assert result["max_param_diff_vs_uninterrupted"] <= 1e-5
    assert result["export_max_diff"] == 0.0


def test_resume_without_a_checkpoint_is_one_line(tmp_path, script):
    assert_fails_with_one_line(script("checkpoint", "resume", "--dir", tmp_path),
                               "no checkpoint there")


def test_a_world_size_the_batch_does_not_split_over_is_refused():
    # checked on every rank once the group is up; the launcher shows it (test_distenv)
    for world_size in (1, 2, 3, 4, 6, 12):
        sharded_checkpoint.check_world_size(world_size)
    for world_size in (5, 8):
        with pytest.raises(SystemExit, match=f"does not split over {world_size} ranks"):
            sharded_checkpoint.check_world_size(world_size)


@pytest.mark.parametrize("args, words", [
    (["save"], "the following arguments are required: --dir"),
    (["load", "--dir", "x"], "invalid choice: 'load'"),
    (["save", "--dir", "x", "--steps", -1], "--steps must be at least 0"),
])
def test_bad_input_is_refused_in_one_line(args, words):
    assert_refused(checkpoint.parse_args, args, words)

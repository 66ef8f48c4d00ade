"""Sharded checkpoints: saved by 4 ranks, loaded by 2 and by 3, training resumes exactly
where an uninterrupted run would be; the full export loads into a plain model."""

import pytest

from conftest import assert_fails_with_one_line
from launch import LabError, run_lab


@pytest.fixture(scope="module")
def saved_by_four(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    result = run_lab("checkpoint", 4, ["save", "--dir", folder, "--steps", 2], echo=False)
    return folder, result


def test_save_writes_shards_and_a_full_export(saved_by_four):
    folder, result = saved_by_four
    assert result["world_size"] == 4 and result["step"] == 2
    assert len(list(folder.glob("*.distcp"))) == 4   # one file per rank
    assert result["full_export_bytes"] > 4 * result["param_count"]   # fp32, plus names
    assert result["checkpoint_bytes"] > result["full_export_bytes"]  # + momentum, metadata


@pytest.mark.parametrize("nproc", [2, 3])
def test_resume_at_another_world_size_equals_an_uninterrupted_run(saved_by_four, nproc):
    folder, _ = saved_by_four
    result = run_lab("checkpoint", nproc, ["resume", "--dir", folder, "--steps", 2], echo=False)
    assert result["saved_world_size"] == 4 and result["world_size"] == nproc
    assert result["resumed_from_step"] == 2 and result["total_steps"] == 4
    assert result["max_param_diff_vs_uninterrupted"] <= 1e-5
    assert result["export_max_diff"] == 0.0


def test_resume_without_a_checkpoint_is_one_line(tmp_path, script):
    assert_fails_with_one_line(script("checkpoint", "resume", "--dir", tmp_path),
                               "no checkpoint there")


def test_a_world_size_the_batch_does_not_split_over_fails(tmp_path):
    with pytest.raises(LabError, match="does not split over 5 ranks"):
        run_lab("checkpoint", 5, ["save", "--dir", tmp_path], echo=False)

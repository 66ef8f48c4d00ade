"""scripts/book_cache.py: the book's execution cache is emptied whenever anything a chapter
runs changes (a lab, a committed result, a SLURM script, the pinned packages), and only
then; the unit is measured when it is."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("book_cache", REPO / "scripts" / "book_cache.py")
book_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book_cache)


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "labs" / "labkit").mkdir(parents=True)
    (tmp_path / "labs" / "labkit" / "model.py").write_text("A = 1\n")
    (tmp_path / "results" / "cpu").mkdir(parents=True)
    (tmp_path / "results" / "cpu" / "bench.json").write_text("{}\n")
    (tmp_path / "scripts" / "slurm").mkdir(parents=True)
    (tmp_path / "scripts" / "slurm" / "job.sbatch").write_text("#!/bin/bash\n")
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n")
    return tmp_path


@pytest.mark.parametrize("changed", ["labs/labkit/model.py", "results/cpu/bench.json",
                                     "scripts/slurm/job.sbatch", "requirements.txt"])
def test_a_change_to_what_chapters_run_changes_the_hash(repo, changed):
    before = book_cache.inputs_hash(repo)
    assert book_cache.inputs_hash(repo) == before   # the same files, the same hash
    path = repo / changed
    path.write_text(path.read_text() + "# changed\n")
    assert book_cache.inputs_hash(repo) != before


def test_a_new_lab_changes_the_hash_and_bytecode_does_not(repo):
    before = book_cache.inputs_hash(repo)
    (repo / "labs" / "labkit" / "__pycache__").mkdir()
    (repo / "labs" / "labkit" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    assert book_cache.inputs_hash(repo) == before
    (repo / "labs" / "new_lab.py").write_text("")
    assert book_cache.inputs_hash(repo) != before


def test_the_cache_is_emptied_and_the_unit_measured_only_when_the_inputs_change(
        repo, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    measured = []
    monkeypatch.setattr(book_cache, "REPO", repo)
    monkeypatch.setattr(book_cache, "measure_unit",
                        lambda: measured.append(1) or {"unit_s": 2.0, "unit_samples_s": [2.0]})
    monkeypatch.setattr("sys.argv", ["book_cache.py", "--cache", str(cache)])
    book_cache.main()
    (cache / "executed-chapter").write_text("outputs")
    book_cache.main()                       # nothing changed: the chapter stays
    assert (cache / "executed-chapter").exists() and len(measured) == 1
    (repo / "labs" / "labkit" / "model.py").write_text("A = 2\n")
    book_cache.main()                       # a lab changed: every chapter runs again
    assert not (cache / "executed-chapter").exists() and len(measured) == 2
    state = json.loads((cache / book_cache.STATE).read_text())
    assert state["inputs_sha256"] == book_cache.inputs_hash(repo) and state["unit_s"] == 2.0


def test_the_unit_is_measured_again_after_the_chapters_once(tmp_path, monkeypatch):
    """The samples after the chapters join those before (the median of all six); a build
    that reused the cache, its state already holding them, measures nothing again."""
    state_file = tmp_path / book_cache.STATE
    state_file.write_text(json.dumps({"unit_s": 3.0, "unit_samples_s": [3.1, 3.0, 2.9]}))
    taken = []
    monkeypatch.setattr(book_cache, "unit_samples",
                        lambda: taken.append(1) or [3.6, 3.8, 3.4])
    state = book_cache.add_samples_after(tmp_path)
    assert state["unit_samples_after_s"] == [3.6, 3.8, 3.4]
    assert state["unit_s"] == pytest.approx((3.1 + 3.4) / 2)   # the median of six
    assert json.loads(state_file.read_text()) == state
    assert book_cache.add_samples_after(tmp_path) == state and len(taken) == 1
    assert book_cache.add_samples_after(tmp_path / "no-cache") is None

"""The banner under each chapter's title (book/_ext/where_numbers.py), without building the
book: which pages get it, which labs a chapter runs, and which GPU boxes of results/ it names.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "book" / "_ext"))

import where_numbers   # noqa: E402 (after the path)


def test_the_chapters_are_the_numbered_parts_of_the_table_of_contents():
    chapters = where_numbers.chapters(REPO)
    assert {"book/grad_averaging", "book/hybrid", "book/hangs"} <= chapters
    # the intro, the reference and tool pages and the status page get no banner
    for page in ("book/intro", "book/notation", "book/which_parallelism", "book/sizing",
                 "book/your_trace", "book/status"):
        assert page not in chapters, page


def test_a_chapters_labs_are_read_from_its_source():
    source = (REPO / "book" / "hybrid.md").read_text()
    assert "hybrid" in where_numbers.chapter_labs(source)
    assert where_numbers.chapter_labs('run_lab("scaling", 4)\ngpu_references("fsdp")') == {
        "scaling", "fsdp"}


def test_only_the_boxes_that_ran_a_chapters_labs_are_named(tmp_path):
    (tmp_path / "labs").symlink_to(REPO / "labs")
    for folder, lab, ok in (("h100-x8", "hybrid", True), ("a100-x4", "hybrid", False),
                            ("l4-x2", "scaling", True)):
        (tmp_path / "results" / folder).mkdir(parents=True)
        (tmp_path / "results" / folder / "summary.json").write_text(json.dumps(
            {"gpu": folder.split("-")[0].upper(), "world_size": int(folder[-1]),
             "labs": [{"lab": lab, "ok": ok}]}))
    assert where_numbers.gpu_boxes(tmp_path, {"hybrid"}) == [("h100-x8", "H100", 8)]
    assert where_numbers.gpu_boxes(tmp_path, {"memory"}) == []


def test_the_cpu_is_named():
    name = where_numbers.cpu_name(REPO)
    assert name and "cores" in name

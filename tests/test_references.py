"""labkit.runtime.references: the GPU references a chapter's "On a GPU box" section shows,
each figure a lab measured beside the prediction it carries, read from results/."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "labs"))
from labkit.runtime import references  # noqa: E402

REFERENCE = {"gpu": "NVIDIA H100 80GB HBM3", "world_size": 8, "backend": "nccl",
             "driver_version": "570.86", "cuda_version": "12.8", "nccl_version": "2.26.2",
             "torch_version": "2.13.0", "date": "2026-11-20T10:00:00+00:00",
             "command": "torchrun --standalone --nproc_per_node=8 labs/memory.py measure",
             "seconds": 12.5}
# a memory-lab-shaped result: a peak that does not follow the naming rule, a list of
# strategies named by their fields, per-rank lists, and a prediction with no measurement
RESULT = {"lab": "memory", "world_size": 8,
          "strategies": [
              {"strategy": "ddp", "peak_cuda_bytes": 1100, "predicted_peak_bytes": 1000,
               "bytes": {"params": 400, "grads": 400}, "predicted_bytes": {"params": 400,
                                                                          "grads": 400}},
              {"strategy": "fsdp", "peak_cuda_bytes": 300, "predicted_peak_bytes": 300,
               "comm_bytes_per_rank": [10, 12], "predicted_comm_bytes_per_rank": [10, 10],
               "predicted_nothing_measured": 5}]}


def write(folder, lab, result, reference=REFERENCE):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{lab}.json").write_text(json.dumps({"reference": reference,
                                                    "result": result}))


def test_every_prediction_is_paired_with_its_measurement():
    pairs = {name: (measured, predicted)
             for name, measured, predicted in references.figure_pairs(RESULT)}
    assert pairs == {
        "strategies · strategy ddp · peak_cuda_bytes": (1100, 1000),
        "strategies · strategy ddp · bytes · params": (400, 400),
        "strategies · strategy ddp · bytes · grads": (400, 400),
        "strategies · strategy fsdp · peak_cuda_bytes": (300, 300),
        "strategies · strategy fsdp · comm_bytes_per_rank · rank 0": (10, 10),
        "strategies · strategy fsdp · comm_bytes_per_rank · rank 1": (12, 10),
    }


def test_a_section_shows_the_box_and_the_figures_furthest_from_their_predictions(tmp_path):
    write(tmp_path / "h100-x8", "memory", RESULT)
    text = references.section("memory", tmp_path)
    assert text.startswith("**h100-x8**: 8 × NVIDIA H100 80GB HBM3, nccl, 2026-11-20")
    assert "driver 570.86, CUDA 12.8, NCCL 2.26.2, torch 2.13.0" in text
    assert "Of its 6 predicted figures, 4 equal their prediction exactly" in text
    rows = [line for line in text.splitlines() if line.startswith("| strategies")]
    # furthest first: 12 against 10 (1.2), then 1,100 against 1,000 (1.1)
    assert rows == [
        "| strategies · strategy fsdp · comm_bytes_per_rank · rank 1 | 12 | 10 | 1.200 |",
        "| strategies · strategy ddp · peak_cuda_bytes | 1,100 | 1,000 | 1.100 |"]


def test_without_a_reference_the_section_says_so(tmp_path):
    write(tmp_path / "cpu", "ranks", {"lab": "ranks"})   # another lab's result
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "memory.json").write_text(json.dumps({"no": "reference"}))
    text = references.section("memory", tmp_path)
    assert text.startswith("No GPU reference is recorded for `labs/memory.py` yet")
    assert "make gpu-references" in text


def test_the_committed_results_are_references_or_other_files():
    # every results/<box>/<lab>.json a chapter would show has both halves
    for path in references.RESULTS.glob("*/*.json"):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "reference" in data:
            assert "result" in data and data["reference"]["backend"], path

"""benchmarks/gpu_references.py, on this machine's CPU: the runs' arguments against each
lab's own parser at the world sizes of a GPU box, the mesh it picks, and one launch with
gloo that fails and one that does not, after which it writes, prints and exits as it would
on a GPU box."""

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_references  # noqa: E402
from gpu_references import Run  # noqa: E402


@pytest.mark.parametrize("world_size", [1, 8])
def test_every_run_is_accepted_by_its_labs_parser(world_size):
    for run in gpu_references.RUNS:
        lab = importlib.import_module(run.lab)
        if not hasattr(lab, "parse_args"):   # ranks.py takes the common options alone
            assert run.arguments(world_size) == []
            continue
        args = lab.parse_args([str(a) for a in run.arguments(world_size)]
                              + ["--backend", "nccl"])
        assert args.backend == "nccl", run.lab


def test_the_mesh_uses_every_gpu_tensor_parallel_first():
    for n in range(1, 17):
        degrees = dict(zip(("dp", "pp", "tp"), gpu_references.largest_mesh(n)[1::2]))
        assert degrees["dp"] * degrees["pp"] * degrees["tp"] == n
        assert degrees["tp"] == (2 if n % 2 == 0 else 1)
    assert gpu_references.largest_mesh(8) == ["--dp", 2, "--pp", 2, "--tp", 2]


def test_a_lab_that_fails_is_one_line_and_the_others_still_run(tmp_path, capsys):
    runs = (Run("ranks", "running at scale", ("--no-such-option",)),   # every rank refuses
            Run("ranks", "running at scale"))
    status = gpu_references.main(["--backend", "gloo", "--nproc", "2", "--out", str(tmp_path)],
                                 runs=runs)
    printed = capsys.readouterr().out
    assert status == 1
    failures = [line for line in printed.splitlines() if line.startswith("FAILED")]
    assert len(failures) == 1 and failures[0].startswith("FAILED ranks after"), printed
    assert "[1/2] ranks" in printed and "[2/2] ranks" in printed and "summary: 1 of 2" in printed

    written = json.loads((tmp_path / "ranks.json").read_text())
    reference, result = written["reference"], written["result"]
    for key in ("gpu", "driver_version", "cuda_version", "nccl_version", "torch_version",
                "date", "command", "seconds", "backend", "world_size"):
        assert key in reference, key
    assert reference["command"].startswith("torchrun --standalone --nproc_per_node=2 labs/ranks.py")
    assert (reference["backend"], reference["world_size"]) == ("gloo", 2)
    assert result["lab"] == "ranks" and len(result["ranks"]) == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [o["ok"] for o in summary["labs"]] == [False, True]


def test_bad_input_is_one_line():
    with pytest.raises(SystemExit) as error:
        gpu_references.parse_args(["--labs", "memory,nonsense"])
    assert error.value.code == 2
    import torch
    if not torch.cuda.is_available():   # NCCL with no GPU: says what to do instead
        with pytest.raises(SystemExit) as error:
            gpu_references.main(["--labs", "ranks"])
        assert "no CUDA GPU is visible; --backend gloo" in str(error.value)

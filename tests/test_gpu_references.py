"""benchmarks/gpu_references.py, on this machine's CPU: every run's launches against each
lab's own parser at the world sizes of a GPU box, the world sizes and mesh it picks, and
launches with gloo (into a temporary folder: a gloo run is refused anywhere under
results/) that succeed, fail, fail as meant to, and are not run, after which it writes,
keeps, removes, merges and prints as it would on a GPU box."""

import gzip
import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_references  # noqa: E402
from gpu_references import HANG_ENDED, TRACES, Launch, NotRun, Run  # noqa: E402
from labkit.runtime import references  # noqa: E402  (labs/ is on the path now)

GLOO = ["--backend", "gloo", "--nproc", "2"]
# labs/ that are not a chapter's distributed run: the planner and the trace reader's CLI
NOT_GPU_RUNS = {"plan", "trace"}


def test_every_lab_is_run_once():
    labs = [run.lab for run in gpu_references.RUNS]
    assert len(labs) == len(set(labs))
    assert set(labs) == {path.stem for path in (REPO / "labs").glob("*.py")} - NOT_GPU_RUNS


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_every_launch_is_accepted_by_its_labs_parser(world_size, tmp_path):
    for run in gpu_references.RUNS:
        try:
            launches = run.launch_list(world_size)
        except NotRun:
            continue
        assert launches and len({launch.name for launch in launches}) == len(launches)
        lab = importlib.import_module(run.lab)
        for launch in launches:
            assert launch.nproc is None or 1 <= launch.nproc <= world_size, run.lab
            args, _ = gpu_references.fill(launch.args, tmp_path, tmp_path / "traces")
            if not hasattr(lab, "parse_args"):   # ranks.py takes the common options alone
                assert args == []
                continue
            assert lab.parse_args(args + ["--backend", "nccl"]).backend == "nccl", run.lab


def test_the_checkpoint_saves_and_resumes_on_world_sizes_that_split_its_batch():
    from labkit.parallel import sharded_checkpoint
    assert gpu_references.CHECKPOINT_BATCH == sharded_checkpoint.GLOBAL_BATCH
    for n in range(1, 17):
        save, resume = (launch.nproc for launch in gpu_references.checkpoint_launches(n))
        assert save <= n and sharded_checkpoint.GLOBAL_BATCH % save == 0
        assert sharded_checkpoint.GLOBAL_BATCH % resume == 0
        assert resume < save or save == resume == 1
    assert [launch.nproc for launch in gpu_references.checkpoint_launches(8)] == [6, 4]


def test_the_hang_modes_fail_on_purpose_only_with_a_peer():
    assert [launch.name for launch in gpu_references.hang_launches(1)] == ["none"]
    launches = gpu_references.hang_launches(8)
    assert launches[0].fails_with is None
    assert {launch.name for launch in launches[1:]} == {"skip_collective", "wrong_shape",
                                                         "sleep", "exit"}
    assert all(launch.fails_with == HANG_ENDED for launch in launches[1:])


def test_zero_libraries_are_not_run_without_either_library(monkeypatch):
    monkeypatch.setattr(gpu_references.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NotRun, match="neither deepspeed nor accelerate"):
        gpu_references.zero_libraries_args(8)
    monkeypatch.setattr(gpu_references.importlib.util, "find_spec",
                        lambda name: object() if name == "accelerate" else None)
    assert gpu_references.zero_libraries_args(8) == ["--library", "accelerate"]


def test_the_mesh_uses_every_gpu_tensor_parallel_first():
    for n in range(1, 17):
        degrees = dict(zip(("dp", "pp", "tp"), gpu_references.largest_mesh(n)[1::2]))
        assert degrees["dp"] * degrees["pp"] * degrees["tp"] == n
        assert degrees["tp"] == (2 if n % 2 == 0 else 1)
    assert gpu_references.largest_mesh(8) == ["--dp", 2, "--pp", 2, "--tp", 2]


def test_the_first_error_is_the_labs_own_line():
    output = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: RuntimeError: a peer's error, printed first",
        "hang: error: rank 0: step 2's all-reduce ended after 2.0 s: timed out",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "UserWarning: not an error"])
    assert gpu_references.lab_errors("hang", output) == [
        "hang: error: rank 0: step 2's all-reduce ended after 2.0 s: timed out",
        "RuntimeError: a peer's error, printed first"]
    error = gpu_references.LabError("lab hang failed with exit status 1 at nproc=2.", 1, output)
    assert gpu_references.first_error("hang", error).startswith("hang: error: rank 0:")
    # a traceback alone: its last line
    error = gpu_references.LabError("lab x failed with exit status 1", 1,
                                    "Traceback (most recent call last):\n  File ...\n"
                                    "torch.OutOfMemoryError: CUDA out of memory\n")
    assert gpu_references.first_error("x", error) == "torch.OutOfMemoryError: CUDA out of memory"
    assert gpu_references.first_error("x", FileNotFoundError("no lab named 'x'")) == \
        "no lab named 'x'"


def test_gloo_runs_stay_out_of_the_results_folder(capsys):
    with pytest.raises(SystemExit) as error:   # on a GPU box this went to results/<gpu>-x2/
        gpu_references.main(["--backend", "gloo", "--labs", "ranks"])
    assert "a gloo run is not a GPU reference: give --out DIR" in str(error.value)
    gpu_folder = gpu_references.RESULTS / "nvidia-h200-x2"
    assert not gpu_folder.exists()
    with pytest.raises(SystemExit) as error:
        gpu_references.main(["--backend", "gloo", "--labs", "ranks", "--out", str(gpu_folder)])
    assert "is under results/" in str(error.value) and "\n" not in str(error.value)
    assert not gpu_folder.exists()
    assert "gpu_references:" not in capsys.readouterr().out   # refused before anything ran


def test_a_failing_lab_keeps_its_log_and_error_loses_its_result_and_the_rest_merge(
        tmp_path, capsys):
    hang = Run("hang", "hangs", launches=(
        Launch("none", ("--mode", "none", "--steps", 1, "--at-step", 0)),
        # rank 1 skips step 1's all-reduce: rank 0 waits out the timeout and says so
        Launch("skip_collective", ("--mode", "skip_collective", "--steps", 3, "--at-step", 1,
                                   "--timeout", 5), fails_with=HANG_ENDED)))
    runs = (Run("ranks", "running at scale"), hang)
    out = ["--out", str(tmp_path)]
    assert gpu_references.main([*GLOO, *out], runs=runs) == 0
    printed = capsys.readouterr().out
    assert "[1/2] ranks" in printed and "[2/2] hang" in printed and "summary: 2 of 2" in printed

    ranks = json.loads((tmp_path / "ranks.json").read_text())
    reference, result = ranks["reference"], ranks["result"]
    for key in ("gpu", "driver_version", "cuda_version", "nccl_version", "torch_version",
                "date", "command", "seconds", "backend", "world_size"):
        assert key in reference, key
    assert reference["command"].startswith("torchrun --standalone --nproc_per_node=2 labs/ranks.py")
    assert (reference["backend"], reference["world_size"]) == ("gloo", 2)
    assert result["lab"] == "ranks" and len(result["ranks"]) == 2
    assert "ranks.py" in (tmp_path / "ranks.log").read_text()   # a success keeps its log too

    phases = json.loads((tmp_path / "hang.json").read_text())
    assert len(phases["reference"]["commands"]) == 2
    assert phases["result"]["none"]["mode"] == "none"
    skipped = phases["result"]["skip_collective"]
    assert skipped["failed_as_expected"] and skipped["exit_status"] != 0
    assert any("ended after" in line for line in skipped["errors"]), skipped
    assert "# skip_collective (meant to fail" in (tmp_path / "hang.log").read_text()
    first = json.loads((tmp_path / "summary.json").read_text())
    assert [(o["lab"], o["ok"]) for o in first["labs"]] == [("ranks", True), ("hang", True)]

    # ranks again, alone, and now it fails: its result goes, its log and error stay
    runs = (Run("ranks", "running at scale", ("--no-such-option",)), hang)
    assert gpu_references.main([*GLOO, *out, "--labs", "ranks"], runs=runs) == 1
    printed = capsys.readouterr().out
    said = "ranks: error: unrecognized arguments: --no-such-option"
    failures = [line for line in printed.splitlines() if line.startswith("FAILED")]
    assert len(failures) == 1 and failures[0].startswith("FAILED ranks after"), printed
    assert failures[0].endswith(f": {said}"), failures
    assert not (tmp_path / "ranks.json").exists()
    assert said in (tmp_path / "ranks.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [o["lab"] for o in summary["labs"]] == ["ranks", "hang"]
    assert summary["labs"][0]["ok"] is False and summary["labs"][0]["error"] == said
    assert summary["labs"][1] == first["labs"][1]   # not run now: kept as it was
    assert references.failures(summary) == [said]
    assert (tmp_path / "hang.json").exists()


def test_traces_are_kept_small_and_read_not_run_is_said_and_a_launch_must_fail_as_meant(
        tmp_path, capsys):
    box = tmp_path / "results" / "box-x2"   # a results/ folder of the test's own
    stale = box / "traces" / "scaling" / "ddp-strong-n2-rank7.json.gz"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier run's")
    (box / "zero_libraries.json").write_text("{}")

    def missing(world_size):
        raise NotRun("deepspeed is not installed (a test)")

    runs = (Run("scaling", "scaling", ("--strategy", "ddp", "--scaling", "strong",
                                       "--steps", 1, "--warmup", 0, "--profile", TRACES)),
            Run("zero_libraries", "FSDP and ZeRO", missing),
            Run("ranks", "running at scale", launches=(
                Launch("ranks", (), fails_with="a line no rank prints"),)))
    assert gpu_references.main([*GLOO, "--out", str(box)], runs=runs) == 1
    printed = capsys.readouterr().out
    assert "zero_libraries (FSDP and ZeRO): not run: deepspeed is not installed" in printed
    assert "summary: 1 of 3 labs ran on 2 x CPU; failed: ranks; not run: zero_libraries" \
        in printed

    outcomes = {o["lab"]: o for o in json.loads((box / "summary.json").read_text())["labs"]}
    assert outcomes["zero_libraries"]["not_run"] is True
    assert outcomes["zero_libraries"]["error"] == "not run: deepspeed is not installed (a test)"
    assert not (box / "zero_libraries.json").exists()   # the earlier result is not current
    assert "was meant to fail" in outcomes["ranks"]["error"]
    assert not (box / "ranks.json").exists()

    traces = sorted((box / "traces" / "scaling").iterdir())
    assert [path.name for path in traces] == ["ddp-strong-n2-rank0.json.gz",
                                              "ddp-strong-n2-rank1.json.gz"]   # stale gone
    for path in traces:
        assert json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    run = json.loads((box / "scaling.json").read_text())["result"]["runs"][0]
    assert Path(run["profile"]) == traces[0]
    assert list(references.gpu_traces(box.parent)) == [("box-x2", "ddp-strong-n2")]
    table = references.trace_section(box.parent)
    assert "| box-x2 | ddp-strong-n2 | 2 |" in table
    assert references.trace_section(tmp_path / "nothing") == ""

"""Every chapter's GPU reference in one command: each chapter's labs on the GPUs of this box,
with NCCL, one result file per lab, written with what it ran on.

    make gpu-references                                        # every GPU, NCCL
    python benchmarks/gpu_references.py                        # the same
    python benchmarks/gpu_references.py --labs memory,precision
    python benchmarks/gpu_references.py --backend gloo --nproc 2 --out /tmp/refs   # CPU

One torchrun launch per lab, --nproc_per_node equal to the GPU count (a world of one on one
GPU), each lab at the GPU-sized arguments its docstring gives; a lab whose chapter needs
phases gets several launches: the checkpoint saved at one world size and resumed at
another (world sizes that split its global batch), the resilience lab killing a rank and
restarting under --max-restarts=1, the hang lab once clean and once per way of breaking
step, each of those meant to fail with every rank's own line. Among them: peak CUDA memory
(torch.cuda.max_memory_allocated) beside the memory model's prediction for DDP, ZeRO-1 and
FSDP2 (memory); the from-scratch ring and dist.all_reduce, with their bus bandwidths
(ring_allreduce); tensor, pipeline, context (torch's context_parallel, CUDA only) and expert
parallelism; float8 from torchao where it is installed (precision); the mesh at the largest
layout that fits (hybrid); DeepSpeed and Accelerate where they are installed
(zero_libraries: "not run" and why, where neither is).

It writes into OUT, which defaults to results/<gpu>-x<N>/:
  <lab>.json     the lab's own result under "result" (with several launches, one entry per
                 launch), and under "reference" the GPU, driver, CUDA, NCCL and torch
                 versions, the date, the command line and the seconds it took
  <lab>.log      everything the lab printed, for a failure and for a success alike
  traces/<lab>/  the scaling lab's profiled steps, one Chrome trace per rank, gzipped
                 (labs/trace.py and the traces chapter read them as they are)
  summary.json   every lab's outcome: ok, or the lab's own first error line, or not run
                 and why. A run of some labs (--labs) keeps the others' earlier entries.
A lab that fails loses its earlier <lab>.json and traces, so that no stale result is shown
as current. It prints progress as it goes, one line for each lab that fails (and goes on
with the rest), and a summary. The exit status is 1 if any lab failed.

With --backend gloo the same runs go on CPU: how the tests check this script's paths on a
machine without a GPU. A CPU run is not a GPU reference, so it needs --out, outside
results/ (where the chapters and the status page read every folder as a GPU box's).
"""

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
sys.path.insert(0, str(REPO / "labs"))
from labkit.runtime.launch import LabError, reader_command, run_lab  # noqa: E402

# A launch that runs past this is stopped and its lab reported as failed; the others go on
LAB_TIMEOUT_S = 1800
# Placeholders in a launch's arguments: a scratch folder of the run's own (removed after
# it; a checkpoint's --dir), and the lab's folder of traces (OUT/traces/<lab>)
SCRATCH, TRACES = "{scratch}", "{traces}"
# The checkpoint lab's global batch: each rank takes an equal slice, so only the world
# sizes that divide it can save or resume (labkit.parallel.sharded_checkpoint.GLOBAL_BATCH;
# a test checks the two agree, without importing the model here)
CHECKPOINT_BATCH = 12


class NotRun(Exception):
    """A lab this box cannot run (a library missing): recorded as not run, with why."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One torchrun launch of a run: its name in the result (when there are several), its
    arguments, its ranks (None: every GPU), torchrun's --max-restarts, and, for a launch
    meant to fail, a pattern its output must show (else the run fails)."""
    name: str
    args: tuple = ()
    nproc: int = None
    max_restarts: int = 0
    fails_with: str = None


@dataclasses.dataclass(frozen=True)
class Run:
    """One lab's reference run: the lab, its chapter, and either its arguments (one launch
    on every GPU) or its launches, each a tuple or a function of the world size. A function
    may raise NotRun."""
    lab: str
    chapter: str
    args: tuple = ()
    launches: tuple = None

    def launch_list(self, world_size):
        if self.launches is None:
            args = self.args(world_size) if callable(self.args) else self.args
            return [Launch(self.lab, tuple(args))]
        launches = self.launches
        return list(launches(world_size) if callable(launches) else launches)


def largest_mesh(world_size):
    """dp x pp x tp over every GPU, as many axes above 1 as the count allows: tp 2 inside
    the node first (the fastest link), then pp 2, the rest data-parallel."""
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if (world_size // tp) % 2 == 0 else 1
    return ["--dp", world_size // (tp * pp), "--pp", pp, "--tp", tp]


def checkpoint_launches(world_size):
    """Save on the most ranks that split the global batch, resume on the next fewer (one
    process if it saved on one): 8 GPUs save on 6 and resume on 4, as the lab's docstring
    says for a GPU box."""
    sizes = [n for n in range(1, CHECKPOINT_BATCH + 1) if CHECKPOINT_BATCH % n == 0]
    save = max(n for n in sizes if n <= world_size)
    resume = max([n for n in sizes if n < save] or [1])
    folder = f"{SCRATCH}/ckpt"
    return [Launch("save", ("save", "--dir", folder), nproc=save),
            Launch("resume", ("resume", "--dir", folder), nproc=resume)]


def resilience_launches(world_size):
    """The chapter's crash: the last rank dies at step 7, torchrun restarts the group once,
    and the lab resumes from its last checkpoint (the lab's GPU-box line)."""
    return [Launch("resilience", ("--dir", f"{SCRATCH}/ckpt", "--fail-at-step", 7,
                                  "--fail-rank", world_size - 1), max_restarts=1)]


# Each way the hang lab breaks step must end, on every rank still there, in its own line
# "hang: error: rank R: <collective> ended after S s: ..." (labs/hang.py's guarded)
HANG_ENDED = r"hang: error: rank \d+: .* ended after [\d.]+ s"
HANG_TIMEOUT_S = 30   # the chapter's GPU line (book/hangs.md); NCCL's first collective
                      # sets its communicators up inside it


def hang_launches(world_size):
    """Once clean, then once per mode of breaking step, each meant to fail in its lines;
    one GPU has no other rank to fall out of step with, so there only the clean run."""
    clean = [Launch("none", ("--mode", "none"))]
    if world_size < 2:
        return clean
    return clean + [Launch(mode, ("--mode", mode, "--timeout", HANG_TIMEOUT_S),
                           fails_with=HANG_ENDED)
                    for mode in ("skip_collective", "wrong_shape", "sleep", "exit")]


ZERO_LIBRARIES = {"deepspeed-zero2": "deepspeed", "deepspeed-zero3": "deepspeed",
                  "accelerate": "accelerate"}


def zero_libraries_args(world_size):
    """Every library the lab knows that this interpreter can import (a GPU box's own torch
    may have neither)."""
    found = [name for name, module in ZERO_LIBRARIES.items()
             if importlib.util.find_spec(module) is not None]
    if not found:
        raise NotRun("neither deepspeed nor accelerate is installed for "
                     f"{sys.executable}")
    return ["--library", ",".join(found)]


# Each chapter's labs, at the GPU-sized arguments of their docstrings' "GPU box" lines.
# The scaling run alone is profiled: its DDP and FSDP2 traces are what the traces chapter
# reads (gzipped, about 75 kB a rank on CPU, more with CUDA's kernels); the pipeline's took
# five times as much on CPU at its chapter's small size, and its GPU run is far larger.
RUNS = (
    Run("ranks", "running at scale"),
    Run("grad_averaging", "gradient averaging"),
    Run("ring_allreduce", "collectives", ("--sizes", "1M,64M,1G")),
    Run("memory", "memory", ("measure", "--strategy", "all")),
    Run("mini_ddp", "scaling"),
    Run("scaling", "scaling", ("--strategy", "ddp,fsdp", "--scaling", "weak", "--batch", 8,
                               "--profile", TRACES)),
    Run("fsdp", "FSDP and ZeRO"),
    Run("low_communication", "talking less", ("--steps", 32)),
    Run("zero_libraries", "FSDP and ZeRO", zero_libraries_args),
    Run("checkpoint", "FSDP and ZeRO", launches=checkpoint_launches),
    Run("precision", "precision"),
    Run("tensor_parallel", "tensor parallelism", ("--heads", 16, "--hidden", 512, "--seq", 256)),
    Run("pipeline", "pipeline parallelism", ("--microbatches", "8,16", "--layers", 16,
                                             "--hidden", 1024, "--heads", 16, "--seq", 512)),
    Run("context_parallel", "context parallelism", ("--heads", 16, "--hidden", 512,
                                                    "--seq", 4096)),
    Run("expert_parallel", "expert parallelism", ("--experts", 64, "--top-k", 2,
                                                  "--hidden", 256, "--heads", 8)),
    Run("hybrid", "5-D parallelism", largest_mesh),
    Run("resilience", "failures and resuming", launches=resilience_launches),
    Run("hang", "hangs", launches=hang_launches),
    # started once: the lab forks its replica groups itself, a GPU each where there are enough
    Run("fault_tolerance", "keeping a job alive", launches=(Launch("fault_tolerance", nproc=1),)),
    Run("data_order", "keeping a job alive", launches=(Launch("data_order", nproc=1),)),
)


def gpu_facts():
    """The GPU, its count, driver, CUDA and NCCL, as torch and nvidia-smi see them."""
    import torch
    facts = {"torch_version": torch.__version__, "python_version": platform.python_version(),
             "gpu": None, "gpus": 0, "driver_version": None, "cuda_version": torch.version.cuda,
             "nccl_version": None}
    if torch.cuda.is_available():
        facts["gpus"] = torch.cuda.device_count()
        facts["gpu"] = torch.cuda.get_device_name(0)
        nccl = torch.cuda.nccl.version()
        facts["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            facts["driver_version"] = smi.stdout.split("\n")[0].strip() or None
    return facts


def default_out(facts, world_size):
    """results/<gpu>-x<N>: the GPU's name in lower case, words joined by dashes."""
    name = re.sub(r"[^a-z0-9]+", "-", (facts["gpu"] or "cpu").lower()).strip("-")
    return RESULTS / f"{name}-x{world_size}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="nccl on the GPUs (the references); gloo on CPU (a test)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks per lab (default: the GPU count; 2 with gloo)")
    parser.add_argument("--labs", default=None,
                        help=f"comma-separated, from {', '.join(run.lab for run in RUNS)} "
                             "(default: all)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (default: results/<gpu>-x<N>; "
                             "required with gloo, outside results/)")
    args = parser.parse_args(argv)
    known = {run.lab for run in RUNS}
    if args.labs is not None:
        chosen = [name.strip() for name in args.labs.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            parser.error(f"--labs: no lab named {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(sorted(known))}")
        args.labs = chosen
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    return args


def refuse_cpu_references(args):
    """A gloo run is a test of this script, not a GPU reference: it goes where --out says,
    and never under results/, whose every folder the chapters and the status page show as
    a GPU box's (on a GPU box the default folder would even carry the GPU's name). Refusing
    beats a default elsewhere: the run's place is then always the one its caller chose."""
    if args.backend != "gloo":
        return
    if args.out is None:
        sys.exit("gpu_references: a gloo run is not a GPU reference: give --out DIR "
                 "(outside results/)")
    if args.out.resolve().is_relative_to(RESULTS.resolve()):
        sys.exit(f"gpu_references: --out {args.out} is under results/, where the chapters "
                 f"show every folder as a GPU reference; a gloo run goes elsewhere")


# torchrun prefixes a rank's lines with "[rankN]: " in some of its modes
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)(: |$)")


def lab_errors(lab, output):
    """The lab's own one-line errors ("<lab>: error: ...", distenv's fail and argparse's),
    then the last lines of Python tracebacks and C++ aborts ("what(): ..."), then the
    launcher's timeout, in the order printed, each once; not torchrun's own report."""
    own, raised = [], []
    for line in output.splitlines():
        line = RANK_PREFIX.sub("", line).strip()
        if re.match(rf"{re.escape(lab)}(\.py)?: error: ", line):
            own.append(line)
        elif ((EXCEPTION.match(line) and "ChildFailedError" not in line)
              or line.startswith("what():") or line.startswith("[launcher] killed after")):
            raised.append(line)
    return list(dict.fromkeys(own + raised))


def first_error(lab, error):
    """What a reader of the summary needs: the lab's own first error line; else the
    exception's first line (the launcher's, or this script's)."""
    errors = lab_errors(lab, getattr(error, "output", "") or "")
    if errors:
        return errors[0]
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "failed")


def fill(args, scratch, traces):
    """The launch's arguments with the placeholders filled: as run, and as a reader's
    command shows them (the scratch folder as `scratch`)."""
    run = [str(a).replace(SCRATCH, str(scratch)).replace(TRACES, str(traces)) for a in args]
    shown = [str(a).replace(SCRATCH, "scratch").replace(TRACES, str(traces)) for a in args]
    return run, shown


def compress_traces(folder, result):
    """Gzip each trace the lab wrote into `folder` (a CPU trace shrinks 14-fold; the reader,
    Perfetto and labs/trace.py read .json.gz as they are), and point the result's
    `profile` entries at the compressed files."""
    renamed = {}
    for path in sorted(Path(folder).glob("*.json")):
        with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        path.unlink()
        renamed[path.name] = f"{path.name}.gz"

    def repoint(node):
        if isinstance(node, dict):
            return {key: (f"{value}.gz" if key == "profile" and isinstance(value, str)
                          and Path(value).name in renamed else repoint(value))
                    for key, value in node.items()}
        if isinstance(node, list):
            return [repoint(item) for item in node]
        return node
    return repoint(result)


def run_one(run, launches, world_size, backend, traces, log):
    """Every launch of `run` in turn, the output into `log`; returns (result, commands).
    Raises LabError (or FileNotFoundError) for the first launch that does not end as it
    should."""
    results, commands = {}, []
    with tempfile.TemporaryDirectory(prefix=f"{run.lab}-") as scratch:
        for launch in launches:
            nproc = launch.nproc or world_size
            args, shown = fill([*launch.args, "--backend", backend], scratch, traces)
            commands.append(reader_command(run.lab, nproc, shown, width=10_000,
                                           max_restarts=launch.max_restarts))
            print(f"    $ {commands[-1]}", flush=True)
            print(f"# {launch.name}" + (f" (meant to fail: {launch.fails_with})"
                                        if launch.fails_with else ""), file=log, flush=True)
            start = time.perf_counter()
            try:
                # echo=True: the command and every line the lab prints go to the log
                with contextlib.redirect_stdout(log):
                    result = run_lab(run.lab, nproc, args, max_restarts=launch.max_restarts,
                                     echo=True, timeout=LAB_TIMEOUT_S)
            except LabError as error:
                if not (launch.fails_with and re.search(launch.fails_with, error.output)):
                    raise
                # failed as meant to: what each rank said, and how long it took
                results[launch.name] = {
                    "failed_as_expected": True, "exit_status": error.returncode,
                    "seconds": round(time.perf_counter() - start, 1),
                    "errors": lab_errors(run.lab, error.output)}
                continue
            if launch.fails_with:
                what = run.lab if launch.name == run.lab else f"{run.lab} {launch.name}"
                raise LabError(f"{what} was meant to fail (its output showing "
                               f"{launch.fails_with!r}) and exited 0")
            results[launch.name] = result
    if len(launches) == 1:
        return next(iter(results.values())), commands
    return results, commands


def merged_outcomes(previous, outcomes, runs):
    """This run's outcomes over the earlier summary's (--labs runs a subset), in the order
    of `runs`, any other lab last."""
    kept = {o["lab"]: o for o in (previous or {}).get("labs", [])}
    kept.update({o["lab"]: o for o in outcomes})
    order = {run.lab: index for index, run in enumerate(runs)}
    return sorted(kept.values(), key=lambda o: order.get(o["lab"], len(order)))


def main(argv=None, runs=RUNS):
    args = parse_args(argv)
    refuse_cpu_references(args)
    facts = gpu_facts()
    if args.backend == "nccl" and not facts["gpus"]:
        sys.exit("gpu_references: no CUDA GPU is visible; --backend gloo runs the same on CPU")
    world_size = args.nproc or (facts["gpus"] if args.backend == "nccl" else 2)
    out = args.out or default_out(facts, world_size)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [run for run in runs if args.labs is None or run.lab in args.labs]
    where = facts["gpu"] if args.backend == "nccl" else "CPU"
    print(f"gpu_references: {len(chosen)} labs on {world_size} x {where} with "
          f"{args.backend}, into {out}", flush=True)

    header = {"gpu": facts["gpu"], "backend": args.backend, "world_size": world_size}
    summary_path = out / "summary.json"
    previous = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if previous and any(previous.get(key) != value for key, value in header.items()):
        # a summary speaks for one box and backend: entries made otherwise are not merged
        print(f"summary.json: its earlier entries were made with {previous.get('backend')} "
              f"on {previous.get('world_size')} x {previous.get('gpu') or 'CPU'}: not kept",
              flush=True)
        previous = None
    outcomes = []

    def record(outcome):
        """One more lab's outcome, into summary.json at once: a run stopped half-way leaves
        a summary that matches the files beside it."""
        outcomes.append(outcome)
        if not outcome["ok"]:   # no earlier result of this lab may pass for a current one
            (out / f"{outcome['lab']}.json").unlink(missing_ok=True)
        summary = {**header, "labs": merged_outcomes(previous, outcomes, runs)}
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")

    for index, run in enumerate(chosen, 1):
        path, log_path = out / f"{run.lab}.json", out / f"{run.lab}.log"
        # the lab's traces are this run's or none: an earlier run's go first
        traces = out / "traces" / run.lab
        shutil.rmtree(traces, ignore_errors=True)
        # the lab runs from the repository root: a folder inside it is given relative to
        # it, so that the commands and results hold no path of this machine's
        if traces.resolve().is_relative_to(REPO):
            traces = traces.resolve().relative_to(REPO)
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        outcome = {"lab": run.lab, "chapter": run.chapter, "date": date,
                   "log": log_path.name}
        start = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                launches = run.launch_list(world_size)
            except NotRun as reason:
                print(f"[{index}/{len(chosen)}] {run.lab} ({run.chapter}): not run: {reason}",
                      flush=True)
                print(f"not run: {reason}", file=log)
                record({**outcome, "ok": False, "not_run": True, "seconds": 0.0,
                        "error": f"not run: {reason}"})
                continue
            print(f"[{index}/{len(chosen)}] {run.lab} ({run.chapter}): "
                  f"{len(launches)} launch{'es' if len(launches) > 1 else ''}, log {log_path}",
                  flush=True)
            try:
                result, commands = run_one(run, launches, world_size, args.backend,
                                           traces, log)
            except (LabError, FileNotFoundError) as error:
                seconds = time.perf_counter() - start
                print(f"[gpu_references] FAILED: {error}", file=log)
                shutil.rmtree(REPO / traces, ignore_errors=True)   # no partial traces
                message = first_error(run.lab, error)
                print(f"FAILED {run.lab} after {seconds:.0f} s: {message}", flush=True)
                record({**outcome, "ok": False, "seconds": round(seconds, 1),
                        "error": message})
                continue
        seconds = time.perf_counter() - start
        if (REPO / traces).is_dir():
            result = compress_traces(REPO / traces, result)
        reference = {**facts, "backend": args.backend, "world_size": world_size,
                     "chapter": run.chapter, "command": "; ".join(commands),
                     "commands": commands, "seconds": round(seconds, 1), "date": date}
        path.write_text(json.dumps({"reference": reference, "result": result}, indent=1) + "\n")
        print(f"    ok in {seconds:.0f} s: {path}", flush=True)
        record({**outcome, "ok": True, "seconds": round(seconds, 1), "file": path.name})

    failed = [o["lab"] for o in outcomes if not o["ok"] and not o.get("not_run")]
    skipped = [o["lab"] for o in outcomes if o.get("not_run")]
    print(f"\nsummary: {len(outcomes) - len(failed) - len(skipped)} of {len(outcomes)} labs "
          f"ran on {world_size} x {where}" + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; not run: {', '.join(skipped)}" if skipped else ""))
    for o in outcomes:
        status = "ok" if o["ok"] else "not run" if o.get("not_run") else "FAILED"
        print(f"  {o['lab']:<18} {status:<7} {o['seconds']:>7.1f} s  "
              f"{o.get('file') or o['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

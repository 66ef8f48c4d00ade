"""Every chapter's GPU reference in one command: each chapter's labs on the GPUs of this box,
with NCCL, one result file per lab, written with what it ran on.

    make gpu-references                                        # every GPU, NCCL
    python benchmarks/gpu_references.py                        # the same
    python benchmarks/gpu_references.py --labs memory,precision
    python benchmarks/gpu_references.py --backend gloo --nproc 2 --out /tmp/refs   # CPU

One torchrun launch per lab, --nproc_per_node equal to the GPU count (a world of one on one
GPU), each lab at the GPU-sized arguments its docstring gives. Among them: peak CUDA memory
(torch.cuda.max_memory_allocated) beside the memory model's prediction for DDP, ZeRO-1 and
FSDP2 (memory); the from-scratch ring and dist.all_reduce, with their bus bandwidths
(ring_allreduce); tensor, pipeline, context (torch's context_parallel, CUDA only) and expert
parallelism; float8 from torchao where it is installed (precision); the mesh at the largest
layout that fits (hybrid).

It writes OUT/<lab>.json for each lab, OUT defaulting to results/<gpu>-x<N>/: the lab's own
result under "result", and under "reference" the GPU, driver, CUDA, NCCL and torch versions,
the date, the command line and the seconds it took. It prints progress as it goes, one line
for each lab that fails (and goes on with the rest), and a summary; OUT/summary.json lists
every lab's outcome. The exit status is 1 if any lab failed.

With --backend gloo the same runs go on CPU: how the tests check this script's paths on a
machine without a GPU. A CPU run's output is not a GPU reference: do not commit it.
"""

import argparse
import dataclasses
import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "labs"))
from labkit.runtime.launch import LabError, reader_command, run_lab  # noqa: E402

# A lab that runs past this is stopped and reported as failed; the others go on
LAB_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class Run:
    """One lab's reference run: the lab, and its arguments given the world size."""
    lab: str
    chapter: str
    args: tuple = ()

    def arguments(self, world_size):
        return list(self.args(world_size) if callable(self.args) else self.args)


def largest_mesh(world_size):
    """dp x pp x tp over every GPU, as many axes above 1 as the count allows: tp 2 inside
    the node first (the fastest link), then pp 2, the rest data-parallel."""
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if (world_size // tp) % 2 == 0 else 1
    return ["--dp", world_size // (tp * pp), "--pp", pp, "--tp", tp]


# Each chapter's labs, at the GPU-sized arguments of their docstrings' "GPU box" lines
RUNS = (
    Run("ranks", "running at scale"),
    Run("grad_averaging", "gradient averaging"),
    Run("ring_allreduce", "collectives", ("--sizes", "1M,64M,1G")),
    Run("memory", "memory", ("measure", "--strategy", "all")),
    Run("mini_ddp", "scaling"),
    Run("scaling", "scaling", ("--strategy", "ddp,fsdp", "--scaling", "weak", "--batch", 8)),
    Run("fsdp", "FSDP and ZeRO"),
    Run("precision", "precision"),
    Run("tensor_parallel", "tensor parallelism", ("--heads", 16, "--hidden", 512, "--seq", 256)),
    Run("pipeline", "pipeline parallelism", ("--microbatches", "8,16", "--layers", 16,
                                             "--hidden", 1024, "--heads", 16, "--seq", 512)),
    Run("context_parallel", "context parallelism", ("--heads", 16, "--hidden", 512,
                                                    "--seq", 4096)),
    Run("expert_parallel", "expert parallelism", ("--experts", 64, "--top-k", 2,
                                                  "--hidden", 256, "--heads", 8)),
    Run("hybrid", "5-D parallelism", largest_mesh),
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
    return REPO / "results" / f"{name}-x{world_size}"


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
                        help="folder for the results (default: results/<gpu>-x<N>)")
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


def main(argv=None, runs=RUNS):
    args = parse_args(argv)
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

    outcomes = []
    for index, run in enumerate(chosen, 1):
        lab_args = [*run.arguments(world_size), "--backend", args.backend]
        command = reader_command(run.lab, world_size, lab_args, width=10_000)   # one line
        print(f"[{index}/{len(chosen)}] {run.lab} ({run.chapter}): {command}", flush=True)
        start = time.perf_counter()
        try:
            result = run_lab(run.lab, world_size, lab_args, echo=False, timeout=LAB_TIMEOUT_S)
        except (LabError, FileNotFoundError) as error:
            seconds = time.perf_counter() - start
            first = next((line for line in str(error).splitlines() if line.strip()), "failed")
            print(f"FAILED {run.lab} after {seconds:.0f} s: {first.strip()}", flush=True)
            outcomes.append({"lab": run.lab, "ok": False, "seconds": round(seconds, 1),
                             "error": first.strip()})
            continue
        seconds = time.perf_counter() - start
        reference = {**facts, "backend": args.backend, "world_size": world_size,
                     "chapter": run.chapter, "command": command,
                     "seconds": round(seconds, 1),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds")}
        path = out / f"{run.lab}.json"
        path.write_text(json.dumps({"reference": reference, "result": result}, indent=1) + "\n")
        print(f"    ok in {seconds:.0f} s: {path}", flush=True)
        outcomes.append({"lab": run.lab, "ok": True, "seconds": round(seconds, 1),
                         "file": path.name})

    (out / "summary.json").write_text(json.dumps(
        {"gpu": facts["gpu"], "backend": args.backend, "world_size": world_size,
         "labs": outcomes}, indent=1) + "\n")
    failed = [o["lab"] for o in outcomes if not o["ok"]]
    print(f"\nsummary: {len(outcomes) - len(failed)} of {len(outcomes)} labs ran on "
          f"{world_size} x {where}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    for o in outcomes:
        print(f"  {o['lab']:<18} {'ok' if o['ok'] else 'FAILED':<7} {o['seconds']:>7.1f} s  "
              f"{o.get('file') or o['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

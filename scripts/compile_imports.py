"""Write the bytecode of what the labs and the book import, once, when the environment is made.

The environment is installed without compiling (`Makefile`: compiling every package would
cost more than the modules used), so Python compiles each module the first time a process
imports it. Without this step the first chapter to import torch._dynamo or distributed
checkpointing pays about 10 s for compiling torch's modules, and its time in units is no longer its
own. Importing them here, in one process, writes their bytecode before any chapter runs.
A package that fails to import is left for the lab that needs it to report.

The packages that only some labs, the book build or the page checks import (COMPILE_ONLY)
are compiled without being imported, by a second process on the other core while this one
imports: importing DeepSpeed, torchao or torchft here would cost more than compiling them
(CUDA and kernel probing), but left to the first import their bytecode is written by every
rank of the launch at once: DeepSpeed with torch._inductor, networkx and Accelerate took
the FSDP chapter's two-rank launch of the libraries 10.2 s, against 6.7 s once compiled.

    .venv/bin/python scripts/compile_imports.py    # make venv runs it
"""

import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

MODULES = [
    "numpy", "matplotlib.pyplot", "ipykernel.kernelapp", "IPython",
    "torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.elastic",
    "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.tensor.parallel", "torch.distributed.device_mesh",
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining", "torch.distributed.algorithms.ddp_comm_hooks",
    "torch.distributed.optim", "torch.profiler", "torch.utils.flop_counter",
    "torch.utils.data", "torch.testing._internal.distributed.fake_pg",
]
# Compiled, not imported, in this order: first what the import above reaches last (torch's
# distributed checkpoint, pipelining and profiler, written here before it gets
# there), then what several ranks would compile at once: the labs' libraries and what they
# pull in, the kernels' debugger, then what the book build and the page checks import
# (each once, in one process)
COMPILE_ONLY = [
    "torch/distributed/checkpoint", "torch/distributed/pipelining", "torch/profiler",
    "torch/_inductor", "torch/_functorch", "torch/_export", "torch/ao", "deepspeed",
    "networkx", "accelerate", "torchao", "torchft", "opentelemetry", "debugpy",
    "sqlalchemy", "sphinx", "docutils", "selenium", "trio", "_pytest",
]
# ... but not their own tests, nor what nothing here imports: selenium's Chrome DevTools
# bindings (one module per protocol release, 6 MB of bytecode; the page checks send their
# DevTools commands by name), torchao's prototypes, SQLAlchemy's dialects but SQLite's
SKIPPED = (r"/(tests?|_tests|testing/suite)/|/selenium/webdriver/common/devtools/"
           r"|/torchao/prototype/(?!mx_formats|quantization|custom_fp_utils|__init__)"
           r"|/sqlalchemy/dialects/(?!sqlite|_typing|__init__)")


def package_folder(path):
    """The folder of a package named as a path ("torch/_inductor"), found without importing
    it; None where it is not installed."""
    top, _, rest = path.partition("/")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / rest
    return folder if folder.is_dir() else None


def start_compiling(paths):
    """compileall over the installed ones of `paths`, in a process of its own; its bytecode
    is what an import writes (timestamps checked, whatever SOURCE_DATE_EPOCH says)."""
    folders = [str(f) for f in map(package_folder, paths) if f is not None]
    return subprocess.Popen(
        [sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "timestamp",
         "-x", SKIPPED, *folders], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    start = time.perf_counter()
    compiling = start_compiling(COMPILE_ONLY)
    failed = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:   # noqa: BLE001 (any failure: the lab will say it)
            failed.append(f"{name} ({type(error).__name__})")
    imported_s = time.perf_counter() - start
    compiling.wait()   # a file that does not compile is left to its import to report
    print(f"compile_imports: the bytecode of {len(sys.modules)} modules written or found in "
          f"{imported_s:.1f} s, and of {len(COMPILE_ONLY)} packages compiled beside them in "
          f"{time.perf_counter() - start:.1f} s"
          + (f"; not imported: {', '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    main()

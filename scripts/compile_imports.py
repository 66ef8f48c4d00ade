"""Write the bytecode of what the labs and the book import, once, when the environment is made.

The environment is installed without compiling (`Makefile`: compiling every package would
cost more than the modules used), so Python compiles each module the first time a process
imports it. Without this step the first chapter to import torch._dynamo or distributed
checkpointing pays about 10 s for compiling torch's modules, and its time in units is no longer its
own. Importing them here, in one process, writes their bytecode before any chapter runs.
A package that fails to import is left for the lab that needs it to report.

    .venv/bin/python scripts/compile_imports.py    # make venv runs it
"""

import importlib
import sys
import time

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
# DeepSpeed, Accelerate, torchao and torchft are left out: their bytecode is about 2.6 s to
# write here, but importing them costs 5.7 s even when written (CUDA and kernel probing),
# which every `make venv` would pay for one chapter's gain


def main():
    start = time.perf_counter()
    failed = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:   # noqa: BLE001 (any failure: the lab will say it)
            failed.append(f"{name} ({type(error).__name__})")
    print(f"compile_imports: the bytecode of {len(sys.modules)} modules written or found in "
          f"{time.perf_counter() - start:.1f} s"
          + (f"; not imported: {', '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    main()

"""What the labs share. The runnable labs are the scripts beside this package
(`labs/<name>.py`); nothing in here is meant to be run on its own.

  distenv        the lab contract: parser and common options, process group, backend
                 choice, per-rank seeds, metadata, the atomic JSON result, one-line errors
  launch         run_lab: a lab under torchrun from a notebook or a test, its JSON back
  timing         timing a distributed operation honestly (barrier, sync, slowest rank)
  activations    the bytes autograd keeps for backward, counted by block
  collectives    the collectives a step issues, counted as torch's dispatcher sees them
  strategies     how a model is wrapped and trained: apply_ddp, apply_fsdp, apply_tp,
                 train_step, the FSDP family's settings and its per-rank batches
  tensor_parallel_layers
                 Megatron-LM's tensor parallelism from scratch: f and g, the column- and
                 row-parallel linears, the vocabulary-parallel embedding and loss
  transformer    the course's small GPT-style model, every tensor countable
  comm_model     communication cost: bytes per rank, bus bandwidth, alpha-beta times
  memory_model   memory cost: ZeRO states, parameters, activations, shard layouts
  time_model     time cost: efficiency, Amdahl, DDP buckets, step time, a layer's FLOPs
  hardware       the GPU node the book's extrapolations assume, with its sources
  planner        the planner of five dimensions (labs/plan.py is its command line)
  sizing         the sizing page's entry point, run in the browser with Pyodide
  arguments      argparse types and the one-line error (torch-free, for plan.py)
  notebook       what a chapter's first cell imports: run_lab, table, glue, formats, plots
"""

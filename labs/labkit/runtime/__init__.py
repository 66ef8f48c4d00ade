"""What runs a lab, and what measures it.

  distenv      the lab contract: parser and common options, process group with a timeout,
               backend choice, per-rank seeds, metadata, the atomic JSON result, one-line
               errors, smaller worlds inside one launch (--sub-worlds)
  launch       run_lab: a lab under torchrun from a notebook or a test, its JSON back, its
               error output raised on failure
  timing       timing a distributed operation honestly (barrier, sync, slowest rank)
  collectives  the collectives a step issues, counted as torch's dispatcher sees them
  activations  the bytes autograd keeps for backward, counted by block
  profiling    --profile DIR: a lab's steps under torch.profiler, a Chrome trace per rank
  notebook     what a chapter's first cell imports: run_lab, table, glue, formats, plots

Imports torch (distenv, timing and the counting) and labkit.predict; never model/ or
parallel/, which build on it.
"""

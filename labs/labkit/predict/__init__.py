"""The predictions: every formula the book computes, written once and called by the labs,
the chapters, the tests and the sizing page.

  comm_model     communication: bytes per rank of each collective and parallelism, bus
                 bandwidth, alpha-beta times
  memory_model   memory: ZeRO states, parameters, activations, shard layouts, stages
  time_model     time: efficiency, Amdahl, DDP's buckets, step time, a layer's FLOPs
  failure_model  failures at scale: how often a job fails, what checkpoints cost, goodput
  hang_model     where each rank of a job out of step waits, and for how long
  precision_model  number formats: their range, the error of rounding to them, of an FP8
                 matrix product and of a sum in bf16, the outlier a scale absorbs; what
                 FP8 changes in a step (the planner's precision)
  trace_reader   a torch.profiler trace read per rank: compute, communication, what no
                 computation hid, idle time, collectives, memory over a step
                 (labs/trace.py is its command line)
  trace_page     the trace page's entry point: the reader's traces per step, the planner's
                 step beside them
  low_communication_model  sending less: the bytes a step sends under compression (bf16,
                 PowerSGD) and fewer syncs (local SGD, DiLoCo, Streaming DiLoCo), and its time
  fault_tolerance_model  keeping a job alive: the quorum's decision each step, the
                 timeouts' order, a heal's bytes and time, the samples a resized data order
                 skips or repeats, per-step fault tolerance's goodput
  hardware       the GPU node the book's extrapolations assume, with its sources
  planner        the planner of five dimensions, a package of one file per concern
                 (labs/plan.py is its command line)
  sizing         the sizing page's entry point: a form's fields in, the planner's answer out
  arguments      argparse types and the one-line error shared by every command line

The rule of this folder: it imports the standard library and itself, nothing else. No
torch (the sizing page copies the folder whole into the site and runs it in the reader's
browser with Pyodide), and nothing from labkit's other folders, which import torch.
tests/test_plan.py imports every module found here with torch made unimportable.
"""

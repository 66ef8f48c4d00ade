"""What the labs share, by role. The runnable labs are the scripts beside this package
(`labs/<name>.py`); nothing in here is meant to be run on its own, and no lab imports
another lab: what two labs share lives here.

  predict/   the predictions: cost models (communication, memory, time, failures, hangs,
             number formats), the hardware they assume, the planner and the sizing page's
             entry point, and the argparse types of the torch-free command lines. It imports no torch and
             nothing outside itself: the sizing page runs this folder, as it is, in the
             reader's browser (Pyodide).
  runtime/   what runs a lab: the lab contract and its process group (distenv), the
             launcher that notebooks and tests use (launch), timing, the counting of what
             a step sends and keeps (collectives, activations), and what a chapter imports
             (notebook). Imports torch, and predict.
  model/     the course's model: a small GPT-style transformer whose every tensor can be
             counted, and its mixture-of-experts block. Imports torch, runtime, predict.
  parallel/  the parallelisms built from scratch (tensor, pipeline, context, expert) and
             each way a model is wrapped, written once (strategies: apply_ddp, apply_fsdp,
             apply_tp, apply_pp), the device mesh, and the FSDP model's sharded
             checkpoint. Imports all of the above.

Each folder imports only from the folders above it in this list (predict from none), so a
new piece goes to the first folder whose role it has: a formula to predict, a way to run
or measure, the network itself, or a way to split it over ranks.
"""

"""A sharded checkpoint of the FSDP lab's model, saved at one world size and resumed at
another: what `labs/checkpoint.py` runs in its save and resume phases, and what
`labs/fsdp.py --checkpoint-dir` runs after its own comparison, in the same processes.

The model and optimizer are strategies' FSDP_FAMILY (fully_shard on every unit, then the
root; SGD with momentum, state the checkpoint must carry). Every step uses the same
GLOBAL_BATCH sequences, split evenly over the ranks, so runs at N = 4 and N = 2 see the
same data and a resumed run can be compared with one that never stopped.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from ..model.transformer import Transformer, random_batch
from ..runtime import distenv
from .strategies import FSDP_FAMILY as SETUP
from .strategies import apply_fsdp, train_step

GLOBAL_BATCH = 12      # sequences per step in all: divides by N = 1, 2, 3, 4
STEPS = 3
FULL_EXPORT = "full_model.pt"


def sharded_model(env, seed):
    torch.manual_seed(seed)   # the same initial weights at every world size
    model = apply_fsdp(Transformer(SETUP.shape, device=env.device), env.device)
    return model, SETUP.optimizer(model.parameters())


def train(model, optimizer, steps, env, seed):
    """Train on `steps` (a range of step numbers): each rank takes its slice of the batch."""
    per_rank = GLOBAL_BATCH // env.world_size
    for step in steps:
        ids, targets = random_batch(SETUP.shape, GLOBAL_BATCH,
                                    distenv.generator(seed, "global batch", step), env.device)
        mine = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
        train_step(model, optimizer, ids[mine], targets[mine])


def full_parameters(model):
    """Every parameter as a full tensor (a collective: all ranks call it)."""
    return {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}


def max_diff(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in a)


def save(directory, steps, seed, env):
    """Train `steps` steps from `seed`, then write the sharded checkpoint and the full export
    into `directory` (a collective: all ranks call it). What `checkpoint.py save` reports."""
    model, optimizer = sharded_model(env, seed)
    train(model, optimizer, range(steps), env, seed)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # DCP plans its writes on the host (shard offsets as CPU tensors, made on the default
    # device); where a process defaults to another device, it must be told
    with torch.device("cpu"):
        dcp.save({"model": model_state, "optimizer": optimizer_state,
                  "progress": {"step": torch.tensor(steps, device="cpu"),
                               "world_size": torch.tensor(env.world_size, device="cpu")}},
                 checkpoint_id=directory)
    # The full export gathers every tensor; rank 0 alone keeps it, on CPU.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if env.is_rank0:
        torch.save(full, directory / FULL_EXPORT)
    dist.barrier()   # every rank's files are written before anyone measures them
    files = [f for f in directory.iterdir() if f.name != FULL_EXPORT]
    return {"step": steps,
            "checkpoint_bytes": sum(f.stat().st_size for f in files),
            "full_export_bytes": (directory / FULL_EXPORT).stat().st_size,
            "param_count": sum(p.numel() for p in model.parameters())}


def resume(directory, steps, seed, env):
    """Load the checkpoint in `directory` into this world's shards, train `steps` more steps,
    and compare with a run that never stopped. What `checkpoint.py resume` reports."""
    if not (directory / ".metadata").is_file():
        distenv.fail(f"--dir {directory}: no checkpoint there (run the save phase first)")
    model, optimizer = sharded_model(env, seed + 1)   # other weights: all must load
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state,
             "progress": {"step": torch.tensor(0, device="cpu"),
                          "world_size": torch.tensor(0, device="cpu")}}
    with torch.device("cpu"):   # its planning is host-side, as in save()
        dcp.load(state, checkpoint_id=directory)   # into this rank's shards: DCP reshards
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    start = int(state["progress"]["step"])

    loaded = full_parameters(model)
    export_diff = None
    if env.is_rank0:   # the export in an ordinary model, no process group involved
        plain = Transformer(SETUP.shape, device="cpu")
        plain.load_state_dict(torch.load(directory / FULL_EXPORT, weights_only=True))
        export_diff = max_diff(dict(plain.named_parameters()), loaded)

    train(model, optimizer, range(start, start + steps), env, seed)
    uninterrupted, uninterrupted_optimizer = sharded_model(env, seed)
    train(uninterrupted, uninterrupted_optimizer, range(start + steps), env, seed)
    return {"saved_world_size": int(state["progress"]["world_size"]),
            "resumed_from_step": start,
            "total_steps": start + steps,
            "max_param_diff_vs_uninterrupted": max_diff(full_parameters(model),
                                                        full_parameters(uninterrupted)),
            "export_max_diff": export_diff,
            "param_count": sum(p.numel() for p in model.parameters())}


def check_world_size(world_size):
    """Every rank takes an equal slice of the global batch, or the lab refuses to start."""
    if GLOBAL_BATCH % world_size:
        distenv.fail(f"the global batch of {GLOBAL_BATCH} sequences does not split over "
                     f"{world_size} ranks; use 1, 2, 3, 4, 6 or 12")

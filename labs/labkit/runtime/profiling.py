"""--profile DIR: a lab's training steps under torch.profiler, one Chrome trace per rank,
for labs/trace.py (labkit.predict.trace_reader) to read against the step-time model.

The profiled steps are extra steps, run after the lab's own measurement and without its
timing (whose barrier and all-reduce of each step's time would show in the trace as
collectives of the step): one warm-up step the profiler discards, then PROFILED_STEPS
recorded ones, each closed by prof.step(), which torch.profiler marks "ProfilerStep#n".

allocator_walk reads a profile_memory=True profile as an allocator's ledger: the memory and
FSDP labs measure what c10's CPU allocator (or CUDA's) holds with it.
"""

from pathlib import Path

import torch
import torch.distributed as dist

PROFILED_STEPS = 2


def add_profile_arg(parser):
    parser.add_argument("--profile", type=Path, metavar="DIR", default=None,
                        help=f"then profile {PROFILED_STEPS} more training steps (after one "
                             f"warm-up) and write a Chrome trace per rank to DIR, for "
                             f"labs/trace.py analyze")


def profile_steps(directory, name, device, step, steps=PROFILED_STEPS):
    """Run step() 1 + steps times under torch.profiler (CPU, and CUDA on a GPU), the first
    as its warm-up, and write DIR/<name>-rank<r>.json (r the global rank). Returns its
    path."""
    from torch.profiler import ProfilerActivity, profile, schedule
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    path = Path(directory) / f"{name}-rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # one cycle (repeat=1): the warm-up, then the kept steps; profile_memory adds every
    # allocation and free, for trace_reader.memory_timeline
    with profile(activities=activities,
                 schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 profile_memory=True,
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
        for _ in range(1 + steps):
            step()
            if device.type == "cuda":   # the step's kernels end inside its annotation
                torch.cuda.synchronize(device)
            prof.step()
    return path


def allocator_walk(profiler, mark_prefix, device_type=None, also=lambda name: False):
    """A profile taken with profile_memory=True read as the allocator's ledger: its
    allocations (+bytes) and frees (-bytes), on `device_type` if given (a
    torch.autograd.DeviceType), the marks (record_function names starting with
    `mark_prefix`) and the other events whose name `also` accepts, in the order of the
    profiler's clock (at one instant, an allocation before a mark). Returns [(ns, event,
    bytes held after it)], the bytes counted from the profile's start: the profiler knows
    the size only of what was allocated while it ran (a block from before, freed meanwhile,
    goes uncounted), so it must be open before what it measures is built."""
    def kept(event):
        name = event.name()
        if name == "[memory]":
            return device_type is None or event.device_type() == device_type
        return name.startswith(mark_prefix) or also(name)
    events = sorted(((e.start_ns(), e.name() != "[memory]", e)
                     for e in profiler.profiler.kineto_results.events() if kept(e)),
                    key=lambda item: item[:2])
    held, ledger = 0, []
    for ns, _, event in events:
        if event.name() == "[memory]":
            held += event.nbytes()
        ledger.append((ns, event, held))
    return ledger

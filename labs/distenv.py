"""Process-group setup shared by every lab: the lab contract in one place.

A lab uses it like this:

    parser = distenv.ArgumentParser(description=__doc__)
    distenv.add_common_args(parser)              # --backend --out --seed --timeout
    args = parser.parse_args()
    with distenv.initialize(args) as env:        # process group up, device chosen
        metrics = ...                            # the lab's own work
        env.write_result("my_lab", args, metrics)  # rank 0 only, atomically

It works the same under `torchrun` (any number of processes and nodes) and under plain
`python labs/<lab>.py` (a world of one, no port needed).
"""

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120  # a missing peer fails after this long instead of hanging

# The flat-buffer collectives of sharded training: all_gather_single(output, input) fills
# a tensor N times the input; reduce_scatter_single(output, input) sums and keeps 1/N.
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now
# warn); torch 2.6 has only the old names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class LabInputError(SystemExit):
    """Bad input: the process exits non-zero with one clear line on stderr."""


def fail(message):
    """Exit with one line, `<lab>: error: <message>`, and a non-zero status."""
    lab = Path(sys.argv[0]).stem or "lab"
    raise LabInputError(f"{lab}: error: {message}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad input as one line, `<lab>: error: ...`, without usage."""

    def error(self, message):
        fail(message)


def add_common_args(parser):
    """The options every lab has (the lab contract)."""
    group = parser.add_argument_group("common lab options")
    group.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                       help="auto: NCCL when every local rank has its own GPU, else gloo on CPU")
    group.add_argument("--out", type=Path, default=None,
                       help="write the results as JSON to this path (rank 0, atomically)")
    group.add_argument("--seed", type=int, default=0, help="seed for model and data")
    group.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="seconds a collective may wait for a peer before failing")
    return parser


def choose_backend(requested, local_world_size, gpus_available):
    """Return (backend, reason). `reason` is None when nothing needs saying.

    NCCL needs one GPU per local rank: it refuses two ranks on one GPU.
    """
    if requested == "gloo":
        return "gloo", None
    enough_gpus = gpus_available >= local_world_size
    if requested == "nccl":
        if gpus_available == 0:
            fail("--backend nccl needs CUDA GPUs, and none is available here; use --backend gloo")
        if not enough_gpus:
            fail(f"--backend nccl needs one GPU per local rank: {local_world_size} ranks, "
                 f"{gpus_available} GPUs; use --backend gloo or fewer processes")
        return "nccl", None
    if gpus_available == 0:
        return "gloo", "backend auto -> gloo on CPU: no CUDA GPU available"
    if not enough_gpus:
        return "gloo", (f"backend auto -> gloo on CPU: {local_world_size} local ranks but only "
                        f"{gpus_available} GPUs (NCCL needs one GPU per rank)")
    return "nccl", None


def hardware_description(device):
    """Where a measurement was made, in words: the GPU model, or the CPU model and cores."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} GPUs visible)"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"CPU: {cpu} ({os.cpu_count()} cores)"


@dataclasses.dataclass
class DistEnv:
    """Who this process is in the job, and what it computes on."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    simulated: bool = False  # rank 0 of a fake process group; the other ranks do not exist

    @property
    def is_rank0(self):
        return self.rank == 0

    def print0(self, *parts, **kwargs):
        """Print on rank 0 only, so a run's output is one copy, not N."""
        if self.is_rank0:
            print(*parts, **kwargs, flush=True)

    def progress(self, message):
        """Rank 0, on a terminal only: a one-line status that overwrites itself.
        In a notebook or a log (not a TTY) it prints nothing, so outputs stay short."""
        if self.is_rank0 and sys.stderr.isatty():
            print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)

    def metadata(self, lab, args):
        """The fields every result JSON carries (the lab contract)."""
        nccl = torch.cuda.nccl.version() if self.backend == "nccl" else None
        return {
            "lab": lab,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "num_nodes": None if self.simulated else self.world_size // self.local_world_size,
            "simulated": self.simulated,
            "backend": self.backend,
            "device": str(self.device),
            "hardware": hardware_description(self.device),
            "torch_version": torch.__version__,
            "nccl_version": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "python_version": platform.python_version(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }

    def write_result(self, lab, args, metrics):
        """On rank 0: metadata + metrics, written to --out atomically. Returns the dict."""
        if not self.is_rank0:
            return None
        result = {**self.metadata(lab, args), **metrics}
        if args.out is not None:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            # Write beside the target, then rename: a reader never sees half a file.
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            os.replace(tmp, out)
        return result


def max_param_diff(params, reference, device):
    """Largest |difference| between two lists of tensors, over all of them and all ranks
    (a collective: every rank calls it)."""
    diff = max((p.detach() - r.detach()).abs().max().item() for p, r in zip(params, reference))
    worst = torch.tensor([diff], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _init_fake_group(world_size, timeout):
    """Rank 0 of a world of `world_size` in this one process: torch's fake process group.

    Its collectives return at once without moving data, so everything a rank allocates
    (its shards, its buckets) is real while the other ranks do not exist.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size,
                            timeout=timeout)


@contextlib.contextmanager
def initialize(args, simulate_world_size=None):
    """Create the process group for this process, yield a DistEnv, destroy it on exit.

    With `simulate_world_size` N, this one process is rank 0 of a world of N through the
    fake process group (collectives are no-ops): for measuring what one rank holds.
    """
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if simulate_world_size is not None:
        if under_launcher:
            fail("--simulate-world-size runs in one process: start it with python, not torchrun")
        if simulate_world_size < 1:
            fail(f"--simulate-world-size must be at least 1, got {simulate_world_size}")
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, reason = choose_backend(args.backend, local_world_size, gpus)
    if reason and rank == 0 and simulate_world_size is None:
        print(reason, flush=True)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        if simulate_world_size is not None:
            _init_fake_group(simulate_world_size, timeout)
            backend, world_size = "fake", simulate_world_size
        elif under_launcher:
            # torchrun has set MASTER_ADDR/MASTER_PORT (or its own store): use them.
            dist.init_process_group(backend, timeout=timeout)
        else:
            # A world of one needs no rendezvous at all: an in-process store, no port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    except dist.DistStoreError as error:
        first_line = str(error).strip().splitlines()[0]
        fail(f"rank {rank}: the process group of {world_size} did not form within "
             f"--timeout {args.timeout:g} s ({first_line})")
    torch.manual_seed(args.seed)
    env = DistEnv(rank, world_size, local_rank, local_world_size, backend, device,
                  simulated=simulate_world_size is not None)
    try:
        yield env
    finally:
        # Free what the lab left behind while the group is alive. A DDP reducer that
        # outlived the group would destroy it on its own, holding the GIL while gloo's
        # worker threads wait for it: a deadlock at exit, seen in about one run in twelve.
        gc.collect()
        dist.destroy_process_group()

"""The lab contract in one place: parser, common options, process group, seeds, results.

A lab uses it like this:

    parser = distenv.lab_parser(__doc__)         # --backend --out --seed --timeout added
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS)
    args = parser.parse_args()
    with distenv.initialize(args) as env:        # process group up, device chosen
        metrics = ...                            # the lab's own work
        env.write_result(args, metrics)          # rank 0 only, atomically

It works the same under `torchrun` (any number of processes and nodes) and under plain
`python labs/<lab>.py` (a world of one, no port needed).
"""

import argparse
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import inspect
import json
import os
import platform
import re
import socket
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..predict.arguments import (ArgumentParser, LabInputError, at_least,  # noqa: F401
                                 choice_list, fail, int_list, lab_name, number_above, positive_int)

DEFAULT_TIMEOUT_S = 120  # a missing peer fails after this long instead of hanging
# LABS_DEVICE_GUARD=1, on CPU: tensors made without a device go to `meta` (see initialize)
DEVICE_GUARD = "LABS_DEVICE_GUARD"

# The flat-buffer collectives of sharded training: all_gather_single(output, input) fills
# a tensor N times the input; reduce_scatter_single(output, input) sums and keeps 1/N.
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now
# warn); torch 2.6 has only the old names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def lab_parser(docstring, common=True):
    """A lab's parser, made from its docstring: the first paragraph is the description,
    the rest (what it measures, its launch lines, its JSON) follows the options in
    --help. With `common`, the options every lab has are added too."""
    description, _, details = docstring.strip().partition("\n\n")
    parser = ArgumentParser(description=description, epilog=details or None,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    if common:
        add_common_args(parser)
    return parser


def derived_seed(seed, *keys):
    """The one rule for every seed a lab derives from --seed: a hash of (seed, *keys).

    Keys say what the seed is for, e.g. ("batch", step, rank): every (step, rank) gets its
    own stream, the same in every run and every implementation, whatever N is, and no
    two purposes share one by accident (as seed + rank and seed + step would).
    """
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1   # 63 bits: any torch seed


def generator(seed, *keys):
    """A CPU torch.Generator seeded with derived_seed(seed, *keys)."""
    return torch.Generator().manual_seed(derived_seed(seed, *keys))


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


def choose_backend(requested, ranks_on_host, gpus_available):
    """Return (backend, reason). `reason` is None when nothing needs saying.

    `ranks_on_host`: the ranks on this machine that see the same GPUs, from every torchrun
    agent there (two agents on one host each count their ranks from 0). NCCL needs one GPU
    per such rank: it refuses two ranks on one GPU ("Duplicate GPU detected").
    """
    if requested == "gloo":
        return "gloo", None
    enough_gpus = gpus_available >= ranks_on_host
    if requested == "nccl":
        if gpus_available == 0:
            fail("--backend nccl needs CUDA GPUs, and none is available here; use --backend gloo")
        if not enough_gpus:
            fail(f"--backend nccl needs one GPU per rank on this host: {ranks_on_host} ranks, "
                 f"{gpus_available} GPUs; use --backend gloo or fewer processes")
        return "nccl", None
    if gpus_available == 0:
        return "gloo", "backend auto -> gloo on CPU: no CUDA GPU available"
    if not enough_gpus:
        return "gloo", (f"backend auto -> gloo on CPU: {ranks_on_host} ranks on this host but "
                        f"only {gpus_available} GPUs (NCCL needs one GPU per rank)")
    return "nccl", None


def gpu_index(local_rank, local_world_size, ranks_on_host, slot):
    """The GPU a rank takes: its LOCAL_RANK when its agent is alone on the host; else its
    `slot` on the host (0 .. ranks_on_host - 1), since several agents' LOCAL_RANKs repeat."""
    return local_rank if ranks_on_host == local_world_size else slot


def count_ranks_on_host(store, world_size, host_key):
    """(ranks whose `host_key` is this rank's, this rank's slot among them), through the
    rendezvous store: two adds, one wait and one get per rank, whatever the world size."""
    slot = store.add(f"ranks-on/{host_key}", 1) - 1
    # the last rank to arrive opens the gate: every host's count is final by then
    if store.add("ranks-counted", 1) == world_size:
        store.set("ranks-counted-all", "1")
    store.wait(["ranks-counted-all"])
    return store.add(f"ranks-on/{host_key}", 0), slot


def this_start(store, rank, world_size, timeout):
    """(a store private to this start of the group, the job's restart count), agreed by all
    ranks through the rendezvous store.

    torchrun's agent keeps its store for the whole job (torch >= 2.5 shares it with the
    workers), so a group started again finds the keys of the start before: the peers' old
    addresses, which gloo would try to reach (pytorch#135712). Nor can the keys be put under
    TORCHELASTIC_RESTART_COUNT: torchrun counts restarts per agent, and an agent whose
    workers were stopped because another node failed (a membership change) does not count
    it, so two nodes' ranks would look under two prefixes and never meet.

    So rank 0 names this start afresh (a random id) and says so under a fixed key; every
    other rank answers under that id with a random id of its own and waits for rank 0 to
    reply under its id. A rank that read the name of a start before (its rank 0 died with
    it) gets no reply, reads the name again until it changes and answers the new one: no
    key of an earlier start can reply to an id made in this process. The answers carry
    each rank's restart count; rank 0 replies with the largest, the restarts of the agent
    that has spent most of its --max-restarts budget, the same number on every rank.
    """
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        start = uuid.uuid4().hex
        store.set("lab/start", start)
        answers = [f"lab/{start}/answer/{peer}" for peer in range(1, world_size)]
        store.wait(answers, timeout)   # raises DistStoreError after --timeout
        mine = [store.get(key).decode().split() for key in answers]
        job_restarts = max([restarts] + [int(count) for _, count in mine])
        for me, _ in mine:
            store.set(f"lab/{start}/reply/{me}", str(job_restarts))
        return dist.PrefixStore(f"lab/{start}", store), job_restarts
    me, deadline = uuid.uuid4().hex, time.monotonic() + timeout.total_seconds()
    start = None
    while True:
        named = store.get("lab/start").decode()   # waits for the key up to --timeout
        if named != start:   # a first name, or a new one: the one read before was dead
            start = named
            store.set(f"lab/{start}/answer/{rank}", f"{me} {restarts}")
        if store.check([f"lab/{start}/reply/{me}"]):
            break
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"no reply from rank 0 within {timeout}")
        time.sleep(0.02)   # polled, not waited on: a wait that times out warns each time
    job_restarts = int(store.get(f"lab/{start}/reply/{me}"))
    return dist.PrefixStore(f"lab/{start}", store), job_restarts


def host_key():
    """This machine and the GPUs this process sees: ranks with the same key share GPUs."""
    return f"{socket.gethostname()}:{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}"


def process_group_backend(backend, cpu_group=False):
    """The backend string for init_process_group. cpu_group on NCCL adds gloo for CPU
    tensors ("cpu:gloo,cuda:nccl"): what dcp.async_save's staged CPU copy needs."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" and cpu_group else backend


def exact_fp32():
    """fp32 matmuls and convolutions in IEEE fp32, not TF32: the labs compare results to
    1e-5 and better, which TF32's 10-bit mantissa breaks. NGC containers set
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1; torch reads it when it is imported, so the launcher
    sets it to 0 for the ranks, and this turns TF32 off in a process that already read it.
    Returns the settings in force, for the result's metadata."""
    os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}


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
    lab: str = dataclasses.field(default_factory=lab_name)
    fp32: dict = dataclasses.field(default_factory=dict)   # exact_fp32()'s settings
    group: object = None   # the process group the lab runs on: None is the world
    # torchrun's restarts of this job, the same on every rank: the largest of its agents'
    # counts (TORCHELASTIC_RESTART_COUNT is per agent; see this_start)
    restarts: int = 0

    def within(self, group):
        """This rank as one of `group`'s (a --sub-worlds group, of ranks 0 to k-1): its rank
        and size there, and the group its collectives take (env.group)."""
        return dataclasses.replace(self, rank=dist.get_rank(group),
                                   world_size=dist.get_world_size(group), group=group)

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

    def metadata(self, args):
        """The fields every result JSON carries (the lab contract)."""
        nccl = torch.cuda.nccl.version() if self.backend == "nccl" else None
        return {
            "lab": self.lab,
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
            **self.fp32,
            **({"device_guard": True} if device_guard_on() else {}),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }

    def write_result(self, args, metrics):
        """On rank 0: metadata + metrics, written to --out atomically. Returns the dict."""
        if not self.is_rank0:
            return None
        result = {**self.metadata(args), **metrics}
        if args.out is not None:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            # Write beside the target, then rename: a reader never sees half a file.
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            os.replace(tmp, out)
        return result


def dtensor_class():
    """torch's DTensor class if anything has loaded it, else None: no DTensor can exist
    before its module is imported, and importing it costs a process about a second."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def local_tensor(tensor):
    """The part of `tensor` this rank holds: a DTensor's own shard, any other tensor whole."""
    dtensor = dtensor_class()
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def local_bytes(tensors):
    """Bytes of the part of each tensor this rank holds (local_tensor), summed."""
    total = 0
    for t in tensors:
        local = local_tensor(t)
        total += local.numel() * local.element_size()
    return total


def max_param_diff(params, reference, device, group=None):
    """Largest |difference| between two lists of tensors, over all of them and all ranks
    of `group` (a collective: each of them calls it)."""
    diff = max((p.detach() - r.detach()).abs().max().item() for p, r in zip(params, reference))
    worst = torch.tensor([diff], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item()


# How long a rank done early (left out of a lab's sub-worlds, or of its side-by-side
# layouts) waits for the others. Never what ends a run: a rank that fails or stops
# answering ends it at its own --timeout, and torchrun then stops every rank.
WAIT_FOR_ALL = datetime.timedelta(hours=1)


def waiting_group():
    """A gloo group of the whole world for wait_for_all. Every rank creates it, in the same
    place among the lab's other groups."""
    return dist.new_group(backend="gloo", timeout=WAIT_FOR_ALL)


def wait_for_all(group):
    """Every rank waits here (on a waiting_group) until the last one is done. A rank done
    early must not exit before: its shutdown, a second of CPU, would land in the others'
    measurement. A gloo barrier sleeps in its receive (an NCCL one would spin a core, and
    its watchdog would end the wait at --timeout)."""
    dist.barrier(group=group)


def add_sub_worlds_arg(parser):
    """--sub-worlds: the lab's measurement again inside the same launch, in a world of each
    size k on the first k ranks (measure_with_sub_worlds)."""
    parser.add_argument("--sub-worlds", type=int_list(1), default=[], metavar="K[,K...]",
                        help="then the same again on the first k ranks alone, for each k "
                             "below the world's size (comma-separated, e.g. 2 or 2,1)")


def sub_worlds(sizes):
    """The process groups of a lab's --sub-worlds: ({k: the group of ranks 0 to k-1}, largest
    k first, and the waiting_group of wait_for_all). Largest first: a rank left out of one
    sub-world is left out of every later one, so it only ever waits at the end. Every rank
    creates every group, in the same order, since creating one takes the whole world."""
    groups = {k: dist.new_group(list(range(k))) for k in sorted(set(sizes), reverse=True)}
    return groups, waiting_group()


def run_sub_worlds(env, groups, measure):
    """measure(env) again in each of sub_worlds' groups, by its ranks alone (the others go
    on to wait_for_all): [its result with its world_size], largest first."""
    return [dict(measure(env.within(group)) if env.rank < k else {}, world_size=k)
            for k, group in groups.items()]


def measure_with_sub_worlds(env, sizes, measure, check=None):
    """measure(env) on the whole world, then again in each --sub-worlds group (sub_worlds,
    run_sub_worlds), every rank waiting for the last: the world's result, with the others
    under `sub_worlds`. Before anything runs, it refuses in one line a k as large as the
    world (measured anyway: its files and results would be written twice under one name),
    and check(size), for the world's size and each k, one the lab cannot split its work
    over."""
    n = env.world_size
    if any(k > n for k in sizes):
        fail(f"--sub-worlds {max(sizes)}: the world has only {n} rank{'s' * (n > 1)}")
    if n in sizes:
        fail(f"--sub-worlds {n}: that is the whole world, measured anyway; "
             + (f"give sizes below {n}" if n > 1 else "a world of one has no smaller one"))
    if check:
        for size in [n, *sizes]:
            check(size)
    groups, done = sub_worlds(sizes)
    result = measure(env)
    result["sub_worlds"] = run_sub_worlds(env, groups, measure)
    wait_for_all(done)
    return result


def bound_device(backend, device):
    """init_process_group's device_id on NCCL, from torch 2.10: the communicator is created
    at once on this GPU, and each new_group is split from it (ncclCommSplit) instead of
    bootstrapping a communicator of its own on first use. torch has device_id since 2.3,
    but until 2.9 split_group shared the parent group's NCCL options with every split,
    so each DeviceMesh dimension overwrote the world group's timeout and members
    (pytorch#167125, fixed in 2.10): on those versions groups are created lazily, as before."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if backend != "nccl" or (major, minor) < (2, 10) or "device_id" not in inspect.signature(
            dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


def device_guard_on():
    """Whether this run checks the labs' devices on CPU (LABS_DEVICE_GUARD=1).

    A CPU run cannot tell host from device: a model never moved to env.device, or a tensor
    made without device=, is on the CPU like everything else, and the lab works. On a GPU
    the same line mixes devices and fails. Under the guard, the process's default device is
    `meta` while env.device stays the CPU, so such a tensor holds no data and fails at its
    first use beside the lab's own (an operation, a collective, .item()). What stays on the
    host on purpose must then say device="cpu", which is right on a GPU too. What it cannot
    see: an explicit .cpu() or device="cpu" where env.device was meant (on a CPU they are
    the same memory), and anything only CUDA checks (kernels' dtype and layout rules).
    """
    return os.environ.get(DEVICE_GUARD) == "1"


class _MixedDevices(TorchDispatchMode):
    """Under the device guard: an operation given a meta tensor beside a real one, or a
    collective given a meta tensor, fails at once, naming the devices. Many meta kernels would accept the pair and return meta,
    and the tensor that was never moved would fail only later, far from its cause, or
    not at all. A 0-dim CPU tensor beside a device tensor is allowed, as CUDA allows it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)
                   and not (t.device.type == "cpu" and t.dim() == 0)}
        # c10d's collectives have meta kernels that do nothing: a meta tensor sent alone
        # would pass silently, where NCCL refuses a host tensor
        if "meta" in devices and (len(devices) > 1 or func.namespace == "c10d"):
            raise RuntimeError(
                f"device guard: {func} was given tensors on {sorted(devices)}: one of them was "
                f"made without device= (or never moved to env.device), and would be on the "
                f"host while the others are on the GPU")
        return func(*args, **kwargs)


class VariantNotRun(Exception):
    """A variant that cannot run on this box, raised by the lab itself with its reason."""


def try_variant(env, name, measure, group=None, local=False):
    """measure()'s result, or {"not_run": reason} where the variant cannot run on this box
    (a kernel that refuses a dtype, an API this torch lacks): the lab records why and goes
    on with its other variants instead of losing them all.

    Every rank of `group` (default: env.group, the lab's world or its --sub-worlds group)
    agrees (one all_gather_object): a variant that failed on one rank is not run on all. `local=True`: measure() runs on this rank alone (rank 0's products),
    and nothing is exchanged. Bad input (LabInputError) and a broken process group
    (torch.distributed.DistError: a peer gone, a collective timed out) still end the lab:
    after them no collective can be trusted. A variant that fails on one rank between two
    collectives leaves its peers waiting until --timeout, and ends the lab then.
    """
    try:
        result, error = measure(), None
    except (LabInputError, dist.DistError):
        raise
    except VariantNotRun as reason:
        result, error = None, str(reason)
    except Exception as failure:   # noqa: BLE001 (any failure of the variant's own code)
        lines = str(failure).strip().splitlines()
        error = f"{type(failure).__name__}: {lines[0] if lines else ''}".strip(": ")
        result = None
    if not local:
        group = group if group is not None else env.group   # a --sub-worlds group's ranks
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed and error is None:
            error = f"rank {failed[0][0]}: {failed[0][1]}"
    if error is None:
        return result
    env.print0(f"{name}: not run ({error})")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()   # what the failed variant left cached
    return {"not_run": error}


def _init_fake_group(world_size, timeout):
    """Rank 0 of a world of `world_size` in this one process: torch's fake process group.

    Its collectives return at once without moving data, so everything a rank allocates
    (its shards, its buckets) is real while the other ranks do not exist.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size,
                            timeout=timeout)


@contextlib.contextmanager
def initialize(args, simulate_world_size=None, cpu_group=False):
    """Create the process group for this process, yield a DistEnv, destroy it on exit.

    With `simulate_world_size` N, this one process is rank 0 of a world of N through the
    fake process group (collectives are no-ops, on the calling thread), N = 1 included:
    for measuring what one rank holds.
    With `cpu_group`, an NCCL group also gets gloo for CPU tensors (process_group_backend).
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
    fp32 = exact_fp32()

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    timeout = datetime.timedelta(seconds=args.timeout)
    store, ranks_on_host, slot = None, local_world_size, local_rank
    restarts = 0
    try:
        if under_launcher and simulate_world_size is None:
            # torchrun's store (or MASTER_ADDR/MASTER_PORT), seen through a namespace of
            # this start of the group alone (this_start: torchrun may keep the store of
            # the start before, and counts restarts per node)
            store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
            store, restarts = this_start(store, rank, world_size, timeout)
            if args.backend != "gloo" and gpus:
                # Another agent on this host numbers its ranks from 0 too: count them all
                # before giving each a GPU (only where NCCL is possible; costs milliseconds).
                ranks_on_host, slot = count_ranks_on_host(store, world_size, host_key())
        backend, reason = choose_backend(args.backend, ranks_on_host, gpus)
        if reason and rank == 0 and simulate_world_size is None:
            print(reason, flush=True)
        if backend == "nccl":
            device = torch.device("cuda", gpu_index(local_rank, local_world_size,
                                                    ranks_on_host, slot))
            torch.cuda.set_device(device)   # before the group: NCCL binds to this GPU
        else:
            device = torch.device("cpu")
        if simulate_world_size is not None:
            _init_fake_group(simulate_world_size, timeout)
            backend, world_size = "fake", simulate_world_size
        else:
            if store is None:   # a world of one needs no rendezvous: an in-process store
                store, rank, world_size = dist.HashStore(), 0, 1
            dist.init_process_group(process_group_backend(backend, cpu_group), store=store,
                                    rank=rank, world_size=world_size, timeout=timeout,
                                    **bound_device(backend, device))
    except dist.DistStoreError as error:
        first_line = str(error).strip().splitlines()[0]
        fail(f"rank {rank}: the process group of {world_size} did not form within "
             f"--timeout {args.timeout:g} s ({first_line})", every_rank=True)
    torch.manual_seed(args.seed)
    if device_guard_on() and device.type == "cpu":
        # Everything the lab makes without naming a device now lands on `meta`, which holds
        # no data: a model never moved to env.device, or a tensor made without device=,
        # fails at its first use beside the lab's real tensors, as it would on a GPU.
        torch.set_default_device("meta")
        _MixedDevices().__enter__()   # for the rest of the process
    env = DistEnv(rank, world_size, local_rank, local_world_size, backend, device,
                  simulated=simulate_world_size is not None, fp32=fp32, restarts=restarts)
    # Importing torch leaves about a million objects for the garbage collector to scan on
    # every full collection (0.1 s each, here). None of them will ever be garbage: frozen,
    # they are skipped, and the collections below look only at what the lab made.
    gc.freeze()
    try:
        yield env
    finally:
        # Free what the lab left behind while the group is alive. A DDP reducer that
        # outlived the group would destroy it on its own, holding the GIL while gloo's
        # worker threads wait for it: a deadlock at exit, seen in about one run in twelve.
        gc.collect()
        dist.destroy_process_group()
        # What came after the freeze above (torch._dynamo, imported by a first optimizer
        # or DDP wrap, is most of it) would be scanned again by the collections of the
        # interpreter's exit, about 0.15 s of CPU per process: none of it is garbage.
        gc.freeze()

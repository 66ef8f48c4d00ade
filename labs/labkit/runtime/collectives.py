"""The collectives a piece of code issues, counted as torch's dispatcher sees them.

    counter = comm_model.CollectiveCounter(world_size)
    with CountCollectives(counter):
        loss.backward()                # or a whole training step
    counter.counts, counter.sent       # {op: how many}, bytes this rank sent (ring volumes)

Every collective passes through the dispatcher, whether a lab calls it (torch.distributed's
c10d ops) or torch issues it inside DTensor, FSDP2 or a backward pass (the functional
collectives), so one mode counts them all, forward and backward alike.
"""

import time

import torch
from torch._C._distributed_c10d import Work
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

from .distenv import dtensor_class
from .timing import wait_for_work

# op name (as the dispatcher names it, without namespace and overload) ->
# (collective, how to get the full tensor's bytes from the op's arguments)
_nbytes = lambda t: t.numel() * t.element_size()   # noqa: E731
_COLLECTIVES = {
    # c10d ops: what torch.distributed's functions call
    "allreduce_": ("all_reduce", lambda args: sum(_nbytes(t) for t in args[0])),
    "_allgather_base_": ("all_gather", lambda args: _nbytes(args[0])),          # output
    "_reduce_scatter_base_": ("reduce_scatter", lambda args: _nbytes(args[1])), # input
    "broadcast_": ("broadcast", lambda args: sum(_nbytes(t) for t in args[0])),
    # functional collectives: what DTensor and FSDP2 issue
    "all_reduce": ("all_reduce", lambda args: _nbytes(args[0])),
    "all_gather_into_tensor": ("all_gather", lambda args: _nbytes(args[0]) * args[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda args: _nbytes(args[0])),
    "all_to_all_single": ("all_to_all", lambda args: _nbytes(args[0])),
    # dist.all_to_all_single: with uneven splits a rank sends what its splits give the
    # others, not (N-1)/N of its input, so it is counted exactly (_alltoall_sent)
    "alltoall_base_": ("all_to_all", None),
    # point-to-point: what a pipeline's isend/irecv (and batch_isend_irecv on gloo) call
    "send": ("send", lambda args: sum(_nbytes(t) for t in args[0])),
    "recv_": ("recv", lambda args: sum(_nbytes(t) for t in args[0])),
}


def _alltoall_sent(args):
    """Bytes this rank sends in c10d's alltoall_base_(output, input, group, output_splits,
    input_splits): every row of its input but those its own split keeps."""
    output, tensor, group, _, input_splits = args[:5]
    group = ProcessGroup.unbox(group)
    rows = tensor.shape[0] if tensor.dim() else tensor.numel()
    row_bytes = _nbytes(tensor) // rows if rows else 0
    if not input_splits:   # equal splits: 1/N kept
        return _nbytes(tensor) - _nbytes(tensor) // group.size()
    return (sum(input_splits) - input_splits[group.rank()]) * row_bytes


def _group_name(func, args):
    """The name of the process group a collective runs on: c10d ops carry the group
    itself, functional collectives its name."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return ProcessGroup.unbox(arg).group_name
    return next((arg for arg in args if isinstance(arg, str)), None)


class CountCollectives(TorchDispatchMode):
    """While active, add every collective to `counter` (a comm_model.CollectiveCounter).
    `by_group` {process group name: counter} counts the collectives of those groups there
    instead (the dimensions of a device mesh, say), each with its own group's size."""

    def __init__(self, counter, by_group=None):
        super().__init__()
        self.counter, self.by_group = counter, by_group or {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        dtensor = dtensor_class()
        if dtensor is not None and any(issubclass(t, dtensor) for t in types):
            # Let DTensor run first, with this mode still active: the collectives it turns
            # the op into (a partial gradient reduced in the optimizer's step, say) come
            # back through here. (torch's CommDebugMode does the same.)
            return NotImplemented
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            name = func.__name__.split(".")[0]
            if name in _COLLECTIVES:
                op, nbytes = _COLLECTIVES[name]
                counter = self.counter
                if self.by_group:
                    counter = self.by_group.get(_group_name(func, args), counter)
                before = counter.sent
                if nbytes is None:
                    counter.add_sent(op, _alltoall_sent(args))
                else:
                    counter.add_bytes(op, nbytes(args))
                self.before_issue(counter.sent - before)
            elif name not in ("wait_tensor", "_wrap_tensor_autograd", "barrier"):
                raise NotImplementedError(f"cannot count the collective {func}")
        return func(*args, **(kwargs or {}))

    def before_issue(self, sent_bytes):
        """Called with the bytes this rank is about to send in a collective, before it is
        issued (SlowLink waits here)."""


class SlowLink(CountCollectives):
    """CountCollectives on a link slowed on purpose: before each collective is issued, the
    thread that issues it sleeps ns_per_byte for every byte this rank sends in it (the
    ring's bytes), and the collective completes before that thread goes on. Nothing
    overlaps: a link whose transfers hold up the work that issued them, one after another.
    ns_per_byte = 0 only counts.

    Completing each collective at once also keeps the count whole: a communication hook
    such as torch's PowerSGD issues its next all-reduce in a callback of the last one's
    future, which would otherwise run on gloo's own thread, where no mode is active; on a
    completed future the callback runs here. (NCCL marks a work's future complete when it
    is enqueued, so there the callbacks run inline anyway; its wait() only orders the
    stream, so the host waits for the work itself, timing.wait_for_work.)"""

    def __init__(self, counter, ns_per_byte, by_group=None):
        super().__init__(counter, by_group)
        self.ns_per_byte = ns_per_byte

    def before_issue(self, sent_bytes):
        if self.ns_per_byte > 0 and sent_bytes > 0:
            time.sleep(float(sent_bytes) * self.ns_per_byte * 1e-9)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.namespace == "c10d" and isinstance(out, tuple) and out:
            work = out[-1]
            if isinstance(work, torch.ScriptObject):
                work = Work.unbox(work)
                tensors = [t for t in out[0] if isinstance(t, torch.Tensor)] \
                    if isinstance(out[0], (list, tuple)) else []
                if tensors and tensors[0].is_cuda:
                    # NCCL's wait() only orders the stream: the host waits as the labs do
                    wait_for_work(work, tensors[0].device)
                else:
                    work.wait()
        return out

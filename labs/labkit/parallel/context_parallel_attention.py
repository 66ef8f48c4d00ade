"""Causal attention over a sequence split across ranks, three ways, built from scratch.

Every function takes this rank's queries, keys and values, (b, heads, n, head size) for its
n = s/N tokens, and `positions`, an (N, n) tensor: the global position of every token of
every rank (the layout, time_model.context_parallel_chunks). It returns this rank's
attention output, (b, heads, n, head size), equal to the rows of full causal attention
that belong to its tokens.

  ring_attention       K and V blocks travel around the ring by point-to-point sends; each
                       block's partial result is merged with the log-sum-exp rescaling
  allgather_attention  K and V all-gathered (Llama 3), their gradients reduce-scattered
  ulysses_attention    all-to-all to whole heads, full attention, all-to-all back

Forward and backward go through autograd: the communication steps are autograd Functions
whose backward sends the gradients the other way. `group` is the context-parallel group
(None: the whole world).
"""

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ..runtime import distenv
from ..predict.time_model import context_parallel_chunks

_noted = None   # while counting: {storage pointer: tensor} of attention probabilities made


def note_attention_matrix(probs):
    if _noted is not None:
        _noted[probs.untyped_storage().data_ptr()] = probs


def attention_matrix_bytes(forward):
    """Run `forward()` and return the bytes of attention probabilities that autograd keeps
    for backward: tensors the attention code made as probabilities (note_attention_matrix)
    and that a saved-tensor hook saw being saved, each storage once."""
    global _noted
    _noted, saved = {}, {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in _noted:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = forward()
    finally:
        _noted = None
    del result
    return sum(saved.values())


class LogSumExp(torch.autograd.Function):
    """log sum_k exp(scores), whose gradient is the softmax the caller has already made:
    reusing it keeps no second (n x keys) matrix for backward."""

    @staticmethod
    def forward(ctx, scores, probs):
        ctx.save_for_backward(probs)
        return scores.logsumexp(-1)

    @staticmethod
    def backward(ctx, grad):
        probs, = ctx.saved_tensors
        return grad[..., None] * probs, None


def block_attention(q, k, v, future):
    """softmax(q k^T / sqrt(d)) v with the pairs where `future` is True masked out, and the
    log-sum-exp of each query's scores, for merging with other blocks."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if future is not None:
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(-1)
    note_attention_matrix(probs)
    return probs @ v, LogSumExp.apply(scores, probs)


def merge(out, lse, block_out, block_lse, rescale=True):
    """Online softmax: two partial results over disjoint keys, each normalised by its own
    sum of exponentials, become one normalised by the sum over both. Each is weighted by
    its share of the total, exp(lse_part - lse_total). rescale=False adds them as they
    are: the bug of forgetting that each block was normalised on its own."""
    if out is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    if not rescale:
        return out + block_out, total
    return (out * torch.exp(lse - total)[..., None]
            + block_out * torch.exp(block_lse - total)[..., None]), total


def _peers(group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, size, to_global((rank + 1) % size), to_global((rank - 1) % size)


def _exchange(tensor, send_to, receive_from, group):
    """Start sending `tensor` and receiving one like it; return (buffer, works). Both in
    one batch_isend_irecv, so that NCCL pairs every send with its receive (a ring of
    blocking sends deadlocks)."""
    buffer = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, send_to, group),
                                    dist.P2POp(dist.irecv, buffer, receive_from, group)])
    return buffer, works


class RingPass(torch.autograd.Function):
    """Forward: send this block to the next rank, receive the previous rank's, without
    waiting (the caller computes on the block it holds meanwhile, then waits on `pending`).
    Backward: the gradient goes the other way, to the previous rank."""

    @staticmethod
    def forward(ctx, block, group, pending):
        ctx.group = group
        _, _, following, preceding = _peers(group)
        buffer, works = _exchange(block.contiguous(), following, preceding, group)
        pending.extend(works)
        return buffer

    @staticmethod
    def backward(ctx, grad):
        _, _, following, preceding = _peers(ctx.group)
        buffer, works = _exchange(grad.contiguous(), preceding, following, ctx.group)
        for work in works:
            work.wait()
        return buffer, None, None


def ring_attention(q, k, v, positions, chunks, group=None, rescale=True):
    """Ring attention (Liu et al., 2023): N steps; at step t this rank holds the K and V
    of rank (r - t) mod N, sends it on and computes on it while the next arrives. Work is
    done per pair of chunks (`chunks` per rank: 1 contiguous, 2 zig-zag): a key chunk
    wholly after a query chunk is skipped, the diagonal one masked. Autograd keeps every
    block received (the whole sequence's K and V), and RingPass's backward sends their
    gradients back N - 1 hops: comm_model.ring_attention_layer_bytes("lab"). Liu et al.'s
    and torch's rings keep only their own block and pass K and V round again in backward."""
    rank, size, _, _ = _peers(group)
    queries = q.chunk(chunks, dim=2)
    query_positions = positions[rank].chunk(chunks)
    out, lse = [None] * chunks, [None] * chunks
    kv = torch.stack((k, v))
    for step in range(size):
        source, pending = (rank - step) % size, []
        if step < size - 1:
            incoming = RingPass.apply(kv, group, pending)
        keys, values = kv[0].chunk(chunks, dim=2), kv[1].chunk(chunks, dim=2)
        for i, query_pos in enumerate(query_positions):
            for j, key_pos in enumerate(positions[source].chunk(chunks)):
                future = key_pos[None, :] > query_pos[:, None]
                if future.all():
                    continue   # wholly in the future: no work at all
                block = block_attention(queries[i], keys[j], values[j],
                                        future if future.any() else None)
                out[i], lse[i] = merge(out[i], lse[i], *block, rescale=rescale)
        for work in pending:
            work.wait()
        if step < size - 1:
            kv = incoming
    return torch.cat(out, dim=2)


class GatherSequence(torch.autograd.Function):
    """All-gather along the tokens (dimension 3 of (2, b, heads, n, d)) in rank order;
    backward, reduce-scatter: each rank gets the sum over ranks of its tokens' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        local = x.movedim(3, 0).contiguous()
        full = local.new_empty((size * local.shape[0], *local.shape[1:]))
        distenv.all_gather_single(full, local, group=group)
        return full.movedim(0, 3)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        full = grad.movedim(3, 0).contiguous()
        local = full.new_empty((full.shape[0] // size, *full.shape[1:]))
        distenv.reduce_scatter_single(local, full, group=ctx.group)
        return local.movedim(0, 3), None


def allgather_attention(q, k, v, positions, group=None):
    """Llama 3's form (Dubey et al., 2024, 3.3.2): gather every rank's K and V, attend with
    this rank's queries over the whole sequence, masked by global positions."""
    rank = dist.get_rank(group)
    kv = GatherSequence.apply(torch.stack((k, v)), group)
    key_pos = positions.flatten()   # the gathered tokens, rank by rank
    future = key_pos[None, :] > positions[rank][:, None]
    return block_attention(q, kv[0], kv[1], future)[0]


class AllToAll(torch.autograd.Function):
    """x of (N, ...): part j goes to rank j; part j of the result came from rank j. The
    operation is its own adjoint: backward is the same all-to-all on the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return AllToAll.exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.exchange(grad, ctx.group), None

    @staticmethod
    def exchange(x, group):
        out = funcol.all_to_all_single(x.contiguous(), None, None,
                                       group if group is not None else dist.group.WORLD)
        return funcol.wait_tensor(out)


def ulysses_attention(q, k, v, positions, group=None):
    """DeepSpeed-Ulysses (Jacobs et al., 2023): from s/N tokens of every head to all s tokens
    of a/N heads, full causal attention on them, and back. Needs N to divide the heads."""
    size = dist.get_world_size(group)
    b, heads, n, d = q.shape
    qkv = torch.stack((q, k, v)).view(3, b, size, heads // size, n, d).movedim(2, 0)
    qkv = AllToAll.apply(qkv, group)   # (N, 3, b, a/N, n, d): rank j's tokens, my heads
    qkv = qkv.movedim(0, 3).reshape(3, b, heads // size, size * n, d)
    every = positions.flatten()        # the gathered tokens, rank by rank
    out = block_attention(qkv[0], qkv[1], qkv[2], every[None, :] > every[:, None])[0]
    out = out.view(b, heads // size, size, n, d).movedim(2, 0)   # (N, b, a/N, n, d)
    out = AllToAll.apply(out, group)   # rank j's heads, my tokens
    return out.movedim(0, 1).reshape(b, heads, n, d)


def layout_positions(seq, cp, layout, device):
    """(N, s/N): the global position of each token of each rank in `layout`."""
    chunks = context_parallel_chunks(cp, layout)
    c = seq // (cp * len(chunks[0]))
    return torch.tensor([[chunk * c + i for chunk in mine for i in range(c)] for mine in chunks],
                        device=device)


def block_forward(block, x, attend):
    """The course's Block (transformer.py) with its attention replaced by attend(q, k, v)."""
    qkv = block.qkv(block.norm1(x))
    b, n, _ = qkv.shape
    q, k, v = qkv.view(b, n, 3, -1, block.head_dim).permute(2, 0, 3, 1, 4)
    x = x + block.proj(attend(q, k, v).transpose(1, 2).reshape(b, n, -1))
    return x + block.fc2(F.gelu(block.fc1(block.norm2(x))))

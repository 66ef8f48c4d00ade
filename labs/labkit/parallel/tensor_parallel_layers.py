"""Megatron-LM's tensor parallelism built from scratch: the communication operators f and g
as autograd functions, the column- and row-parallel linears, the vocabulary-parallel
embedding and cross-entropy, and the course's transformer split with them
(TensorParallelTransformer).

Every piece takes the process group of its tensor-parallel ranks (`group`; None is the
whole world), so that the same layers serve inside a larger mesh. Tensors are (batch,
sequence, hidden); sequence parallelism splits dimension 1, the tokens.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime import distenv
from .strategies import allreduce_gradients, qkv_rows_of_rank


# The communication operators

class Copy(torch.autograd.Function):
    """f: identity forward; backward, the sum over ranks of each rank's partial gradient.
    reduce_backward=False leaves the sum out: a bug, shown by the lab."""

    @staticmethod
    def forward(ctx, x, group, reduce_backward=True):
        ctx.group, ctx.reduce_backward = group, reduce_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.reduce_backward:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class Reduce(torch.autograd.Function):
    """g: the sum over ranks of each rank's partial result forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_tokens(shard, group):
    """All ranks' slices of the tokens, (b, s/t, h) -> (b, s, h)."""
    t = dist.get_world_size(group)
    local = shard.transpose(0, 1).contiguous()
    full = local.new_empty((t * local.shape[0], *local.shape[1:]))
    distenv.all_gather_single(full, local, group=group)
    return full.transpose(0, 1)


def scatter_sum_tokens(full, group):
    """The sum over ranks, keeping this rank's slice of the tokens: (b, s, h) -> (b, s/t, h)."""
    t = dist.get_world_size(group)
    summed = full.transpose(0, 1).contiguous()
    shard = summed.new_empty((summed.shape[0] // t, *summed.shape[1:]))
    distenv.reduce_scatter_single(shard, summed, group=group)
    return shard.transpose(0, 1)


class ReduceScatter(torch.autograd.Function):
    """g with sequence parallelism: sum over ranks, keep this rank's tokens; backward,
    gather every rank's tokens."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return scatter_sum_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_tokens(grad, ctx.group), None


class GatherLinear(torch.autograd.Function):
    """f with sequence parallelism, fused with the column-parallel linear after it: gather
    every rank's tokens and multiply. Only this rank's tokens are saved; backward gathers
    them again for the weight's gradient, and reduce-scatters the input's."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        ctx.save_for_backward(shard, weight)
        ctx.has_bias, ctx.group = bias is not None, group
        return F.linear(gather_tokens(shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        grad_input = scatter_sum_tokens(grad @ weight, ctx.group)
        full = gather_tokens(shard, ctx.group)
        grad_weight = grad.flatten(0, 1).t() @ full.flatten(0, 1)
        grad_bias = grad.sum((0, 1)) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


# The parallel layers: each holds its rank's slice of a full layer, and gives it back whole.

def unsplit(local, index, dim, group):
    """The full tensor from every rank's slice along `dim` at rows `index` (a collective)."""
    t = dist.get_world_size(group)
    pieces = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    index = index.to(local.device)   # NCCL gathers device tensors only
    indices = [torch.empty_like(index) for _ in range(t)]
    dist.all_gather(indices, index, group=group)
    shape = list(local.shape)
    shape[dim] *= t
    full = local.new_empty(shape)
    full.index_copy_(dim, torch.cat(indices), torch.cat(pieces, dim))
    return full


class ColumnParallel(nn.Module):
    """y = x W^T + b with W's rows (the outputs) at `rows` on this rank: each rank computes
    its own outputs, after f."""

    def __init__(self, full, rows, group, sequence_parallel=False, reduce_backward=True):
        super().__init__()
        self.rows, self.group, self.sequence_parallel = rows, group, sequence_parallel
        self.reduce_backward = reduce_backward
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x):
        if self.sequence_parallel:
            return GatherLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(Copy.apply(x, self.group, self.reduce_backward), self.weight, self.bias)

    def full(self, name):
        """{parameter name in the full model: the full tensor}; a collective."""
        parts = {"weight": self.weight, "bias": self.bias}
        return {f"{name}.{key}": unsplit(value, self.rows, 0, self.group)
                for key, value in parts.items() if value is not None}


class RowParallel(nn.Module):
    """y = x W^T + b with W's columns (the inputs) at `columns` on this rank: each rank adds
    its share of every output, g sums them, and the bias, replicated, is added once after."""

    def __init__(self, full, columns, group, sequence_parallel=False):
        super().__init__()
        self.columns, self.group, self.sequence_parallel = columns, group, sequence_parallel
        self.weight = nn.Parameter(full.weight.detach()[:, columns].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        partial = F.linear(x, self.weight)
        reduce = ReduceScatter if self.sequence_parallel else Reduce
        return reduce.apply(partial, self.group) + self.bias

    def full(self, name):
        return {f"{name}.weight": unsplit(self.weight, self.columns, 1, self.group),
                f"{name}.bias": self.bias.detach()}


class VocabParallelEmbedding(nn.Module):
    """Tokens from a 1/t slice of the vocabulary: each rank looks up the ids it holds and
    zeros the rest; g (or its reduce-scatter) sums the ranks' rows. Positions replicated."""

    def __init__(self, full, group, sequence_parallel=False):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        vocab = full.tokens.num_embeddings
        self.rows = torch.arange(rank * vocab // t, (rank + 1) * vocab // t,
                                 device=full.tokens.weight.device)
        self.tokens = nn.Parameter(full.tokens.weight.detach()[self.rows].clone())
        self.positions = copy.deepcopy(full.positions)
        self.group, self.sequence_parallel, self.rank = group, sequence_parallel, rank

    def forward(self, ids, positions=None):
        """`positions`: the tokens' places in their sequences, when they are not 0, 1, ...
        (a context-parallel rank's share of them)."""
        local = ids - self.rows[0]
        outside = (local < 0) | (local >= len(self.rows))
        x = F.embedding(local.masked_fill(outside, 0), self.tokens)
        x = x.masked_fill(outside[..., None], 0)
        reduce = ReduceScatter if self.sequence_parallel else Reduce
        x = reduce.apply(x, self.group)
        if positions is None:
            start = self.rank * x.shape[1] if self.sequence_parallel else 0
            positions = torch.arange(start, start + x.shape[1], device=x.device)
        return x + self.positions(positions)

    def full(self, name):
        return {f"{name}.tokens.weight": unsplit(self.tokens, self.rows, 0, self.group),
                f"{name}.positions.weight": self.positions.weight.detach()}


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean next-token loss from each rank's 1/t of the logits, its words from `first`
    on: three all-reduces of one value per token (the largest logit, the sum of the
    exponentials, the target's logit) instead of gathering the logits."""

    @staticmethod
    def forward(ctx, logits, targets, first, group):
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top[..., None]
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        local = targets - first
        mine = (local >= 0) & (local < logits.shape[-1])
        target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0]
        target = target * mine
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exp / total[..., None], local, mine)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        onehot = torch.zeros_like(softmax)
        onehot.scatter_(-1, local.clamp(0, softmax.shape[-1] - 1)[..., None],
                        mine[..., None].to(softmax.dtype))
        return (softmax - onehot) * grad / local.numel(), None, None, None


class TensorParallelTransformer(nn.Module):
    """The course's transformer split over the ranks of `group` as in Megatron-LM, from a
    full copy of it (the same on every rank): in each block QKV (whole heads per rank) and
    fc1 column-parallel, proj and fc2 row-parallel; the vocabulary split in the embedding,
    the head and the loss. reduce_backward=False and qkv_by_heads=False are the lab's two
    pitfalls."""

    def __init__(self, full, group=None, sequence_parallel=False, reduce_backward=True,
                 qkv_by_heads=True):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        h, heads, ffn = full.shape.hidden, full.shape.heads, 4 * full.shape.hidden
        sp = sequence_parallel
        device = full.head.norm.weight.device   # the index rows on the weights' device
        contiguous = lambda n: torch.arange(rank * n // t, (rank + 1) * n // t,  # noqa: E731
                                            device=device)
        self.embed = VocabParallelEmbedding(full.embed, group, sp)
        self.blocks = copy.deepcopy(full.blocks)
        for block in self.blocks:
            qkv_rows = qkv_rows_of_rank(h, heads, rank, t, device) if qkv_by_heads else contiguous(3 * h)
            block.qkv = ColumnParallel(block.qkv, qkv_rows, group, sp, reduce_backward)
            block.proj = RowParallel(block.proj, contiguous(h), group, sp)
            block.fc1 = ColumnParallel(block.fc1, contiguous(ffn), group, sp, reduce_backward)
            block.fc2 = RowParallel(block.fc2, contiguous(ffn), group, sp)
        self.norm = copy.deepcopy(full.head.norm)
        self.out = ColumnParallel(full.head.out, contiguous(full.shape.vocab), group, sp,
                                  reduce_backward)
        self.group, self.sequence_parallel = group, sp

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))   # this rank's slice of the vocabulary's logits

    def loss(self, ids, targets):
        return VocabParallelCrossEntropy.apply(self(ids), targets, self.out.rows[0], self.group)

    def replicated_gradients(self):
        """Parameters that every rank holds whole but that, under sequence parallelism, see
        only this rank's tokens: their gradients are partial sums, to be all-reduced."""
        if not self.sequence_parallel:
            return []
        params = [self.embed.positions.weight, *self.norm.parameters()]
        for block in self.blocks:
            params += [*block.norm1.parameters(), *block.norm2.parameters(),
                       block.proj.bias, block.fc2.bias]
        return params

    def reduce_replicated_gradients(self):
        """All-reduce the partial gradients of replicated_gradients(), as one flat buffer."""
        allreduce_gradients(self.replicated_gradients(), self.group)

    @property
    def head(self):
        """The final LayerNorm and the vocabulary-parallel output layer, as one module: the
        last piece of a pipeline (pipeline_schedules.split_pieces)."""
        return nn.Sequential(self.norm, self.out)

    def full_parameters(self):
        """{name: full tensor}, named as in the full model (a collective)."""
        result = self.embed.full("embed")
        for i, block in enumerate(self.blocks):
            for name, module in block.named_children():
                if hasattr(module, "full"):
                    result.update(module.full(f"blocks.{i}.{name}"))
                else:
                    result.update({f"blocks.{i}.{name}.{k}": v.detach()
                                   for k, v in module.named_parameters()})
        result.update({f"head.norm.{k}": v.detach() for k, v in self.norm.named_parameters()})
        result.update(self.out.full("head.out"))
        return result

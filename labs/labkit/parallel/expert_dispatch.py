"""Expert parallelism: the experts of each MoE layer sharded over a group of ranks, and two
ways of getting every token to its experts and back.

  AllToAllExperts   dispatch: each rank sorts its kept slots by expert (so by rank, experts
                    being contiguous), tells the others how many it sends to each of their
                    experts (an all-to-all of E counts) and sends the rows with
                    `all_to_all_single` and uneven splits; each rank runs its experts on
                    what it received; combine: the same all-to-all with the splits swapped
                    returns the outputs, which the sender puts back in its tokens' order
                    and weights with its gates. Backward is the same two all-to-alls the
                    other way (a `torch.autograd.Function`).
  AllGatherExperts  an all-gather dispatcher: every rank gathers every rank's tokens and
                    their k gates and expert ids, computes its own experts' slots, weights
                    them, zeroes the rest, and a reduce-scatter sums each token's outputs
                    and hands it back to its rank. Megatron-Core's
                    MoEAllGatherTokenDispatcher (megatron/core/transformer/moe/
                    token_dispatcher.py) has the same shape but gathers, over TP x EP, the
                    dense [T, E] probabilities and a [T, E] boolean routing map instead of
                    the k gates and ids.

The all-to-all needs its split sizes on the host: `all_to_all_single` takes them as Python
lists, so `.tolist()` waits for the router's counts to reach the CPU (on a GPU, a
device-to-host copy and a synchronisation per layer, which Megatron-Core's
MoEAlltoAllTokenDispatcher places at a chosen `cuda_sync_point`).

Each rank routes its own tokens (its own batch: the ranks are data-parallel for everything
but the experts), and the capacity is per rank's group of tokens, as in GShard.
"""

import torch
import torch.distributed as dist

from ..runtime.distenv import all_gather_single, reduce_scatter_single


class AllToAll(torch.autograd.Function):
    """Rows to other ranks: input_splits[j] rows to rank j, output_splits[j] from it."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        # the gradient of what was received goes back to whoever sent it
        return AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


class Gather(torch.autograd.Function):
    """All-gather along rows; backward: reduce-scatter (each rank's rows were used by all)."""

    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        out = rows.new_empty((dist.get_world_size(group) * rows.shape[0], *rows.shape[1:]))
        all_gather_single(out, rows.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return ScatterSum.apply(grad, ctx.group), None


class ScatterSum(torch.autograd.Function):
    """Reduce-scatter along rows; backward: all-gather."""

    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        out = rows.new_empty((rows.shape[0] // dist.get_world_size(group), *rows.shape[1:]))
        reduce_scatter_single(out, rows.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return Gather.apply(grad, ctx.group), None


def shard_experts(model, dispatcher):
    """Keep only this rank's experts in every MoE layer, reached through `dispatcher`."""
    per_rank = model.config.experts // dispatcher.size
    for layer in model.moe_layers():
        layer.keep_experts(dispatcher.rank * per_rank, per_rank)
        layer.dispatcher = dispatcher


class AllToAllExperts:
    """`combine_in_order=False` is a pitfall: the outputs are used in the order they were
    dispatched (sorted by expert) instead of the tokens' own order."""

    def __init__(self, group, combine_in_order=True):
        self.group, self.combine_in_order = group, combine_in_order
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sent = []   # per layer call: tokens this rank sent to each rank

    def __call__(self, layer, tokens, routing):
        experts, n = layer.config.experts, self.size
        token, expert, gate = routing.assignments()
        order = torch.argsort(expert, stable=True)             # grouped by expert, so by rank
        per_expert = torch.bincount(expert, minlength=experts)
        from_each = torch.empty_like(per_expert)               # [source rank, my expert]
        dist.all_to_all_single(from_each, per_expert, group=self.group)
        send = per_expert.view(n, -1).sum(1).tolist()
        receive = from_each.view(n, -1).sum(1).tolist()
        self.sent.append(send)
        received = AllToAll.apply(tokens[token[order]], receive, send, self.group)
        local = torch.arange(experts // n, device=tokens.device).repeat(n)
        ids = layer.first_expert + local.repeat_interleave(from_each)   # both on the device
        returned = AllToAll.apply(layer.run_experts(received, ids), send, receive, self.group)
        if self.combine_in_order:
            returned = returned[torch.argsort(order)]          # back to the slots' order
        return tokens.new_zeros(tokens.shape).index_add(0, token, gate[:, None] * returned)


class AllGatherExperts:
    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, layer, tokens, routing):
        every_token = Gather.apply(tokens, self.group)                    # [N T, h]
        gates = Gather.apply(routing.gates, self.group)                   # [N T, k]
        with torch.no_grad():   # expert ids, -1 where dropped: no gradient
            idx = torch.where(routing.kept, routing.idx, -1)
            idx = Gather.apply(idx, self.group)
        top_k = idx.shape[1]
        # first choices first, tokens in order, as on one process
        token = torch.arange(idx.shape[0], device=idx.device).repeat(top_k)
        expert, gate = idx.T.reshape(-1), gates.T.reshape(-1)
        mine = ((expert >= layer.first_expert)
                & (expert < layer.first_expert + len(layer.experts))).nonzero().squeeze(1)
        token, expert, gate = token[mine], expert[mine], gate[mine]
        out = layer.run_experts(every_token[token], expert)
        partial = every_token.new_zeros(every_token.shape).index_add(
            0, token, gate[:, None] * out)                                # others' rows: 0
        return ScatterSum.apply(partial, self.group)

"""Tensor parallelism: Megatron-LM's split of a transformer built from scratch, beside torch's
DTensor, every collective counted.

The world's N ranks form one tensor-parallel group of t = N. Each variant splits the
course's transformer t ways, trains it for --steps steps on the same batches on every rank
(tensor-parallel ranks share their data), and is compared with one process that trains the
whole model on those batches.

  scratch        Megatron-LM's split with autograd functions of its own: QKV (whole heads
                 per rank) and fc1 column-parallel, proj and fc2 row-parallel, f (identity
                 forward, all-reduce backward) before each column-parallel linear and g
                 (all-reduce forward, identity backward) after each row-parallel one; the
                 vocabulary split too, in the embedding, the head and the cross-entropy
  scratch_sp     + sequence parallelism: outside attention and MLP each rank holds s/t of
                 the tokens, g becomes a reduce-scatter and f an all-gather (the gathered
                 input is not kept: backward gathers it again, as Megatron-LM does)
  dtensor        torch's parallelize_module, ColwiseParallel / RowwiseParallel on a 1-D
                 DeviceMesh (embedding and head replicated)
  dtensor_sp     + torch's SequenceParallel on the LayerNorms
  no_f_backward  pitfall: f without its backward all-reduce: the gradient that reaches the
                 replicated input is one rank's part of it only
  qkv_by_rows    pitfall: the fused QKV weight cut into t blocks of rows, not by heads

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/tensor_parallel.py \\
                          --out tp4.json
  one process:          python labs/tensor_parallel.py --variants scratch
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/tensor_parallel.py \\
                          --heads 16 --hidden 512 --seq 256 --out tp8.json
  two nodes (run on each, HOST = node 0's address; t spans both, which is slow):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=tp labs/tensor_parallel.py --heads 16 --hidden 512 --out tp16.json

JSON: `variants` {name: {max_param_diff, expected_equal, comm_bytes_per_rank,
predicted_comm_bytes_per_rank, collectives {op: count}, predicted_collectives}}, counted
over one training step, forward, backward and the optimizer's step; `param_bytes_per_rank`
and `predicted_param_bytes_per_rank`, and `activation_bytes_per_rank` (one layer's, counted
with saved-tensor hooks) and `predicted_activation_bytes_per_rank` (Korthikanti et al.'s
count plus the LayerNorms' statistics), each {variant: bytes}; `shape`, `batch`, `tp`.
"""

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import comm_model, distenv, memory_model
from labkit.activations import count_activation_bytes
from labkit.collectives import CountCollectives
from labkit.strategies import apply_tp, group_qkv_by_rank, qkv_rows_of_rank, rank_batch
from labkit.transformer import Shape, Transformer, next_token_loss

# heads 12 and every width divisible by 1, 2, 3 and 4: the ranks split whole heads at each
SHAPE = Shape(layers=2, hidden=48, heads=12, seq=24, vocab=120)
BATCH = 2             # sequences per step, the same on every rank
STEPS = 2
LEARNING_RATE = 0.1   # plain SGD: the result depends on the gradients alone
VARIANTS = ("scratch", "scratch_sp", "dtensor", "dtensor_sp", "no_f_backward", "qkv_by_rows")
PITFALLS = ("no_f_backward", "qkv_by_rows")


# The communication operators, as autograd functions. Tensors are (batch, sequence, hidden);
# sequence parallelism splits dimension 1.

class Copy(torch.autograd.Function):
    """f: identity forward; backward, the sum over ranks of each rank's partial gradient."""

    @staticmethod
    def forward(ctx, x, reduce_backward):
        ctx.reduce_backward = reduce_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.reduce_backward:
            dist.all_reduce(grad)
        return grad, None


class Reduce(torch.autograd.Function):
    """g: the sum over ranks of each rank's partial result forward; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _gather_tokens(shard):
    """All ranks' token slices, (b, s/t, h) -> (b, s, h)."""
    t = dist.get_world_size()
    local = shard.transpose(0, 1).contiguous()
    full = local.new_empty((t * local.shape[0], *local.shape[1:]))
    distenv.all_gather_single(full, local)
    return full.transpose(0, 1)


def _scatter_sum_tokens(full):
    """The sum over ranks, keeping this rank's slice of tokens: (b, s, h) -> (b, s/t, h)."""
    t = dist.get_world_size()
    summed = full.transpose(0, 1).contiguous()
    shard = summed.new_empty((summed.shape[0] // t, *summed.shape[1:]))
    distenv.reduce_scatter_single(shard, summed)
    return shard.transpose(0, 1)


class ReduceScatter(torch.autograd.Function):
    """g with sequence parallelism: sum over ranks, keep this rank's tokens; backward,
    gather every rank's tokens."""

    @staticmethod
    def forward(ctx, x):
        return _scatter_sum_tokens(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad)


class GatherLinear(torch.autograd.Function):
    """f with sequence parallelism, fused with the column-parallel linear after it: gather
    every rank's tokens and multiply. Only this rank's tokens are saved; backward gathers
    them again for the weight's gradient, and reduce-scatters the input's."""

    @staticmethod
    def forward(ctx, shard, weight, bias):
        ctx.save_for_backward(shard, weight)
        ctx.has_bias = bias is not None
        return F.linear(_gather_tokens(shard), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        grad_input = _scatter_sum_tokens(grad @ weight)
        full = _gather_tokens(shard)
        grad_weight = grad.flatten(0, 1).t() @ full.flatten(0, 1)
        grad_bias = grad.sum((0, 1)) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias


# The parallel layers: each holds its rank's slice of a full layer, and gives it back whole.

class ColumnParallel(nn.Module):
    """y = x W^T + b with W's rows (outputs) split: each rank computes its own outputs."""

    def __init__(self, full, rows, sequence_parallel, reduce_backward=True):
        super().__init__()
        self.rows, self.sequence_parallel = rows, sequence_parallel
        self.reduce_backward = reduce_backward
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x):
        if self.sequence_parallel:
            return GatherLinear.apply(x, self.weight, self.bias)
        return F.linear(Copy.apply(x, self.reduce_backward), self.weight, self.bias)

    def full(self, name):
        """{parameter name in the full model: the full tensor}; a collective."""
        parts = {"weight": self.weight, "bias": self.bias}
        return {f"{name}.{key}": _unsplit(value, self.rows, 0)
                for key, value in parts.items() if value is not None}


class RowParallel(nn.Module):
    """y = x W^T + b with W's columns (inputs) split: each rank adds its share of every
    output, g sums them, and the bias, replicated, is added once after."""

    def __init__(self, full, columns, sequence_parallel):
        super().__init__()
        self.columns, self.sequence_parallel = columns, sequence_parallel
        self.weight = nn.Parameter(full.weight.detach()[:, columns].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        partial = F.linear(x, self.weight)
        summed = ReduceScatter.apply(partial) if self.sequence_parallel else Reduce.apply(partial)
        return summed + self.bias

    def full(self, name):
        return {f"{name}.weight": _unsplit(self.weight, self.columns, 1),
                f"{name}.bias": self.bias.detach()}


def _unsplit(local, index, dim):
    """The full tensor from every rank's slice along `dim` at `index` (a collective)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local.detach().contiguous())
    indices = [torch.empty_like(index) for _ in pieces]
    dist.all_gather(indices, index)
    shape = list(local.shape)
    shape[dim] *= len(pieces)
    full = local.new_empty(shape)
    full.index_copy_(dim, torch.cat(indices), torch.cat(pieces, dim))
    return full


class VocabParallelEmbedding(nn.Module):
    """Tokens from a 1/t slice of the vocabulary: each rank looks up the ids it holds and
    zeros the rest; g (or its reduce-scatter) sums the ranks' rows. Positions replicated."""

    def __init__(self, full, rank, tp, sequence_parallel):
        super().__init__()
        self.rows = torch.arange(rank * full.tokens.num_embeddings // tp,
                                 (rank + 1) * full.tokens.num_embeddings // tp)
        self.tokens = nn.Parameter(full.tokens.weight.detach()[self.rows].clone())
        self.positions = copy.deepcopy(full.positions)
        self.sequence_parallel, self.rank = sequence_parallel, rank

    def forward(self, ids):
        local = ids - self.rows[0]
        outside = (local < 0) | (local >= len(self.rows))
        x = F.embedding(local.masked_fill(outside, 0), self.tokens).masked_fill(outside[..., None], 0)
        x = ReduceScatter.apply(x) if self.sequence_parallel else Reduce.apply(x)
        start = self.rank * x.shape[1] if self.sequence_parallel else 0
        return x + self.positions(torch.arange(start, start + x.shape[1], device=x.device))

    def full(self, name):
        return {f"{name}.tokens.weight": _unsplit(self.tokens, self.rows, 0),
                f"{name}.positions.weight": self.positions.weight.detach()}


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean next-token loss from each rank's 1/t of the logits: three all-reduces of one
    value per token (the maximum, the sum of exponentials, the target's logit)."""

    @staticmethod
    def forward(ctx, logits, targets, first):
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top[..., None]
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total)
        local = targets - first
        mine = (local >= 0) & (local < logits.shape[-1])
        target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0]
        target = target * mine
        dist.all_reduce(target)
        ctx.save_for_backward(exp / total[..., None], local, mine)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        onehot = torch.zeros_like(softmax)
        onehot.scatter_(-1, local.clamp(0, softmax.shape[-1] - 1)[..., None],
                        mine[..., None].to(softmax.dtype))
        return (softmax - onehot) * grad / local.numel(), None, None


class ScratchTP(nn.Module):
    """The course's transformer split tp ways from scratch, from a full copy of it."""

    def __init__(self, full, rank, tp, sequence_parallel=False, reduce_backward=True,
                 qkv_by_heads=True):
        super().__init__()
        h, heads, ffn = full.shape.hidden, full.shape.heads, 4 * full.shape.hidden
        sp = sequence_parallel
        contiguous = lambda n: torch.arange(rank * n // tp, (rank + 1) * n // tp)  # noqa: E731
        self.embed = VocabParallelEmbedding(full.embed, rank, tp, sp)
        self.blocks = copy.deepcopy(full.blocks)
        for block in self.blocks:
            qkv_rows = (qkv_rows_of_rank(h, heads, rank, tp) if qkv_by_heads
                        else contiguous(3 * h))
            block.qkv = ColumnParallel(block.qkv, qkv_rows, sp, reduce_backward)
            block.proj = RowParallel(block.proj, contiguous(h), sp)
            block.fc1 = ColumnParallel(block.fc1, contiguous(ffn), sp, reduce_backward)
            block.fc2 = RowParallel(block.fc2, contiguous(ffn), sp)
        self.norm = copy.deepcopy(full.head.norm)
        self.out = ColumnParallel(full.head.out, contiguous(full.shape.vocab), sp, reduce_backward)
        self.sequence_parallel = sp

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))   # this rank's slice of the vocabulary's logits

    def loss(self, ids, targets):
        return VocabParallelCrossEntropy.apply(self(ids), targets, self.out.rows[0])

    def replicated_gradients(self):
        """Parameters that every rank holds whole but that, under sequence parallelism, see
        only this rank's tokens: their gradients are partial sums."""
        if not self.sequence_parallel:
            return []
        params = [self.embed.positions.weight, *self.norm.parameters()]
        for block in self.blocks:
            params += [*block.norm1.parameters(), *block.norm2.parameters(),
                       block.proj.bias, block.fc2.bias]
        return params

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


# torch's own: DTensor, with the fused QKV regrouped so that each rank's rows hold whole heads

class TorchTP(nn.Module):
    def __init__(self, full, env, sequence_parallel):
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        self.model = copy.deepcopy(full)
        self.order = group_qkv_by_rank(self.model, env.world_size)
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        apply_tp(self.model, mesh, sequence_parallel)
        self.blocks = self.model.blocks

    def forward(self, ids):
        return self.model(ids)

    def loss(self, ids, targets):
        return next_token_loss(self(ids), targets)

    def replicated_gradients(self):
        return []   # DTensor reduces the gradients of the parameters it replicates

    def full_parameters(self):
        result = {}
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if name.endswith(("qkv.weight", "qkv.bias")):   # back to [Q; K; V]
                full = torch.empty_like(full).index_copy_(0, self.order, full)
            result[name] = full.detach()
        return result


def build(name, full, env):
    """The variant's model; each has loss(ids, targets), replicated_gradients() and
    full_parameters()."""
    rank, tp = env.rank, env.world_size
    if name.startswith("dtensor"):
        return TorchTP(full, env, sequence_parallel=name == "dtensor_sp")
    return ScratchTP(full, rank, tp, sequence_parallel=name == "scratch_sp",
                     reduce_backward=name != "no_f_backward",
                     qkv_by_heads=name != "qkv_by_rows")


def predicted_collectives(name, shape, batch, tp):
    sequence_parallel = name.endswith("_sp")
    if name.startswith("dtensor"):
        return comm_model.torch_tensor_parallel_collectives(
            shape.layers, shape.seq, batch, shape.hidden, tp, sequence_parallel)
    return comm_model.tensor_parallel_collectives(
        shape.layers, shape.seq, batch, shape.hidden, tp, sequence_parallel,
        f_backward=name != "no_f_backward")


def predicted_activation_bytes(name, shape, batch, tp):
    """One layer's bytes kept for backward on a rank: Korthikanti et al.'s count for this
    model (fp32, no dropout), torch's gathered inputs under its SequenceParallel, and the
    LayerNorms' statistics, which the count leaves out."""
    sequence_parallel = name.endswith("_sp")
    return (memory_model.tensor_parallel_activation_bytes_per_layer(
                shape.seq, batch, shape.hidden, shape.heads, tp, sequence_parallel,
                value_bytes=4, dropout=False, gathered_inputs_kept=name == "dtensor_sp")
            + memory_model.layer_norm_statistics_bytes(
                shape.seq, batch, tokens_split=tp if sequence_parallel else 1))


def step(model, optimizer, ids, targets):
    loss = model.loss(ids, targets)
    loss.backward()
    partial = [p.grad for p in model.replicated_gradients()]
    if partial:   # one all-reduce for all of them, as one flat buffer
        flat = torch.cat([g.flatten() for g in partial])
        dist.all_reduce(flat)
        for g, part in zip(partial, flat.split([g.numel() for g in partial])):
            g.copy_(part.view_as(g))


def reference(shape, args, env):
    """One process, the whole model, the same batches: {name: parameter}."""
    torch.manual_seed(args.seed)
    model = Transformer(shape).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for s in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, s, 0, env.device)
        next_token_loss(model(ids), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def run_variant(name, shape, args, env, expected):
    torch.manual_seed(args.seed)
    model = build(name, Transformer(shape).to(env.device), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    counter = comm_model.CollectiveCounter(env.world_size)
    for s in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, s, 0, env.device)
        counter.reset()   # the last step is counted, the optimizer's step included
        with CountCollectives(counter):
            step(model, optimizer, ids, targets)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    full = model.full_parameters()
    names = sorted(expected)
    plan = predicted_collectives(name, shape, args.batch, env.world_size)
    predicted_sent, predicted_counts = comm_model.collectives_summary(plan, env.world_size)
    kept = count_activation_bytes(model, lambda: model.loss(ids, targets))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {
        "max_param_diff": distenv.max_param_diff([full[n] for n in names],
                                                 [expected[n] for n in names], env.device),
        "expected_equal": name not in PITFALLS or env.world_size == 1,
        "comm_bytes_per_rank": round(counter.sent),
        "predicted_comm_bytes_per_rank": round(predicted_sent),
        "collectives": counter.counts,
        "predicted_collectives": predicted_counts,
        "param_bytes": sum(p.numel() * p.element_size() for p in local),
        "activation_bytes": kept[0],
    }


def run(args, env):
    shape = Shape(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    expected = reference(shape, args, env)
    variants, params, activations = {}, {}, {}
    for name in args.variants:
        result = run_variant(name, shape, args, env, expected)
        params[name] = result.pop("param_bytes")
        activations[name] = result.pop("activation_bytes")
        variants[name] = result
        verdict = "as expected" if ((result["max_param_diff"] <= 1e-5)
                                    == result["expected_equal"]) else "UNEXPECTED"
        env.print0(f"{name:>13}: max |p - ref| {result['max_param_diff']:.1e} ({verdict}), "
                   f"sent {result['comm_bytes_per_rank']:,} B (predicted "
                   f"{result['predicted_comm_bytes_per_rank']:,})")
    t, s, b, h = env.world_size, shape.seq, args.batch, shape.hidden
    return {
        "tp": t, "shape": dataclasses.asdict(shape), "batch": b, "variants": variants,
        "param_bytes_per_rank": params,
        "predicted_param_bytes_per_rank": {
            name: 4 * memory_model.tensor_parallel_params_per_rank(
                shape.layers, h, shape.vocab, s, t, vocab_parallel=not name.startswith("dtensor"))
            for name in variants},
        "activation_bytes_per_rank": activations,
        "predicted_activation_bytes_per_rank": {
            name: predicted_activation_bytes(name, shape, b, t) for name in variants},
    }


def check_split(shape, variants, tp):
    """Every width the variants split must divide by t, or the lab refuses to start."""
    needs = {"--heads": shape.heads, "--vocab": shape.vocab}
    if any(name.endswith("_sp") for name in variants):
        needs["--seq"] = shape.seq   # sequence parallelism splits the tokens
    for option, value in needs.items():
        if value % tp:
            distenv.fail(f"{option} {value} does not split over {tp} tensor-parallel ranks")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--variants", type=distenv.choice_list(VARIANTS), default=list(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}; or all")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS, help="training steps")
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="sequences per step (every rank the same)")
    for field in ("layers", "hidden", "heads", "seq", "vocab"):
        parser.add_argument(f"--{field}", type=distenv.positive_int,
                            default=getattr(SHAPE, field), help=f"model {field}")
    args = parser.parse_args(argv)
    problem = Shape(args.layers, args.hidden, args.heads, args.seq, args.vocab).check()
    if problem:
        distenv.fail(problem)
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        shape = Shape(args.layers, args.hidden, args.heads, args.seq, args.vocab)
        check_split(shape, args.variants, env.world_size)
        env.print0(f"tensor-parallel size {env.world_size} ({env.backend}), {shape}")
        env.write_result(args, run(args, env))


if __name__ == "__main__":
    main()

"""Tensor parallelism: Megatron-LM's split of a transformer built from scratch, beside torch's
DTensor, every collective counted.

The world's N ranks form one tensor-parallel group of t = N (then, with --sub-worlds, its
first k ranks form one of t = k, for each k). Each variant splits the
course's transformer t ways, trains it for --steps steps on the same batches on every rank
(tensor-parallel ranks share their data), and is compared with one process that trains the
whole model on those batches.

  scratch        Megatron-LM's split built from scratch (labkit/parallel/tensor_parallel_layers.py):
                 QKV (whole heads per rank) and fc1 column-parallel, proj and fc2
                 row-parallel, f (identity forward, all-reduce backward) before each
                 column-parallel linear and g (all-reduce forward, identity backward)
                 after each row-parallel one; the vocabulary split too, in the embedding,
                 the head and the cross-entropy
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
  t = 4, then t = 2:    torchrun --standalone --nproc_per_node=4 labs/tensor_parallel.py \\
                          --sub-worlds 2
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
count plus the LayerNorms' statistics), each {variant: bytes}; `shape`, `batch`, `tp`;
`sub_worlds`, a result like this one (from `tp` on, and its `world_size`) for each
--sub-worlds size, largest first.
"""

import copy
import dataclasses

import torch
from torch import nn

from labkit.predict import comm_model, memory_model
from labkit.runtime import distenv
from labkit.runtime.activations import count_activation_bytes
from labkit.runtime.collectives import CountCollectives
from labkit.parallel.strategies import apply_tp, group_qkv_by_rank, rank_batch, world_mesh
from labkit.parallel.tensor_parallel_layers import TensorParallelTransformer
from labkit.model.transformer import (Shape, Transformer, add_shape_args, next_token_loss,
                                      shape_from_args)

# heads 12 and every width divisible by 1, 2, 3 and 4: the ranks split whole heads at each
SHAPE = Shape(layers=2, hidden=48, heads=12, seq=24, vocab=120)
BATCH = 2             # sequences per step, the same on every rank
STEPS = 2
LEARNING_RATE = 0.1   # plain SGD: the result depends on the gradients alone
VARIANTS = ("scratch", "scratch_sp", "dtensor", "dtensor_sp", "no_f_backward", "qkv_by_rows")
PITFALLS = ("no_f_backward", "qkv_by_rows")


# torch's own: DTensor, with the fused QKV regrouped so that each rank's rows hold whole heads

class TorchTP(nn.Module):
    def __init__(self, full, env, sequence_parallel):
        super().__init__()
        self.model = copy.deepcopy(full)
        self.order = group_qkv_by_rank(self.model, env.world_size)
        apply_tp(self.model, world_mesh(env.device, env.group), sequence_parallel)
        self.blocks = self.model.blocks

    def forward(self, ids):
        return self.model(ids)

    def loss(self, ids, targets):
        return next_token_loss(self(ids), targets)

    def reduce_replicated_gradients(self):
        pass   # DTensor reduces the partial gradients of the parameters it replicates

    def full_parameters(self):
        result = {}
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if name.endswith(("qkv.weight", "qkv.bias")):   # back to [Q; K; V]
                full = torch.empty_like(full).index_copy_(0, self.order.to(full.device), full)
            result[name] = full.detach()
        return result


def build(name, full, env):
    """The variant's model; each has loss(ids, targets), reduce_replicated_gradients() and
    full_parameters()."""
    if name.startswith("dtensor"):
        return TorchTP(full, env, sequence_parallel=name == "dtensor_sp")
    return TensorParallelTransformer(full, env.group, sequence_parallel=name == "scratch_sp",
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


def step(model, ids, targets):
    """Forward, backward and the gradients complete: what the optimizer needs."""
    model.loss(ids, targets).backward()
    model.reduce_replicated_gradients()


def reference(shape, args, env):
    """One process, the whole model, the same batches: {name: parameter}."""
    torch.manual_seed(args.seed)
    model = Transformer(shape, device=env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for s in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, s, 0, env.device)
        next_token_loss(model(ids), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def run_variant(name, shape, args, env, expected):
    torch.manual_seed(args.seed)
    model = build(name, Transformer(shape, device=env.device), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    counter = comm_model.CollectiveCounter(env.world_size)
    for s in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, s, 0, env.device)
        counter.reset()   # the last step is counted, the optimizer's step included
        with CountCollectives(counter):
            step(model, ids, targets)
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
                                                 [expected[n] for n in names], env.device,
                                                 env.group),
        "expected_equal": name not in PITFALLS or env.world_size == 1,
        "comm_bytes_per_rank": round(counter.sent),
        "predicted_comm_bytes_per_rank": round(predicted_sent),
        "collectives": counter.counts,
        "predicted_collectives": predicted_counts,
        "param_bytes": sum(p.numel() * p.element_size() for p in local),
        "activation_bytes": kept[0],
    }


def run(args, env):
    shape = shape_from_args(args)
    env.print0(f"tensor-parallel size {env.world_size} ({env.backend}), {shape}")
    expected = reference(shape, args, env)
    variants, params, activations = {}, {}, {}
    for name in args.variants:
        result = distenv.try_variant(env, name,
                                     lambda: run_variant(name, shape, args, env, expected))
        if "not_run" in result:
            variants[name] = result
            continue
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
    distenv.add_sub_worlds_arg(parser)
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(argv)
    shape_from_args(args)   # refuses a shape the model cannot have
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        shape = shape_from_args(args)
        env.write_result(args, distenv.measure_with_sub_worlds(
            env, args.sub_worlds, lambda world: run(args, world),
            check=lambda size: check_split(shape, args.variants, size)))


if __name__ == "__main__":
    main()

"""Context parallelism: one sequence split over the ranks, causal attention computed three
ways from scratch (ring, all-gather, Ulysses) and by torch's context_parallel, each
against one process training the whole sequence.

The world's N ranks form one context-parallel group (then, with --sub-worlds, its first k
ranks form one of k, for each k). Every rank holds all the weights and
s/N of each sequence's tokens in the zig-zag layout (the sequence cut into 2N chunks, rank
i holding chunks i and 2N-1-i); everything but attention acts on its tokens alone. Each
variant trains the course's transformer for --steps steps on the same batches, sums the
gradients over the ranks, and is compared with one process that trains on whole sequences.

  ring             K and V blocks passed around the ring (batch_isend_irecv), merged with
                   the log-sum-exp rescaling; future blocks skipped (labkit/
                   context_parallel_attention.py)
  allgather        K and V all-gathered, their gradients reduce-scattered (Llama 3)
  ulysses          all-to-all to whole heads, full attention, all-to-all back (needs N to
                   divide --heads)
  torch_cp         torch's context_parallel around the model with SDPA attention; CUDA
                   only (torch 2.13 has no CPU sharding rule for SDPA): skipped on CPU
  ring_no_rescale  pitfall: the blocks' outputs added without the log-sum-exp rescaling
  ring_local_mask  pitfall: the causal mask built from each rank's local positions

It also measures each rank's attention FLOPs (torch's FlopCounterMode around one ring
forward) in the contiguous and the zig-zag layout.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/context_parallel.py \\
                          --out cp4.json
  one process:          python labs/context_parallel.py
  N = 4, then N = 2:    torchrun --standalone --nproc_per_node=4 labs/context_parallel.py \\
                          --sub-worlds 2
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/context_parallel.py \\
                          --heads 16 --hidden 512 --seq 4096 --out cp8.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=cp labs/context_parallel.py --heads 16 --seq 8192 --out cp16.json

JSON: `variants` {name: {max_param_diff, expected_equal, comm_bytes_per_rank,
predicted_comm_bytes_per_rank, collectives, predicted_collectives, activation_bytes_per_rank
and predicted_activation_bytes_per_rank ([rank r's] bytes of attention probabilities
autograd keeps over the L layers, counted by a saved-tensor hook)}}, the bytes and
collectives of the last training step, forward, backward and the gradients' all-reduce;
`skipped` {name: why}; `attention_flops_by_rank` and `predicted_attention_flops_by_rank`
{layout: [rank r's forward attention FLOPs]}; `shape`, `batch`, `cp`, `layout`;
`sub_worlds`, a result like this one (from `cp` on, and its `world_size`) for each
--sub-worlds size, largest first.
"""

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from labkit.predict import comm_model, memory_model, time_model
from labkit.runtime import distenv
from labkit.parallel import context_parallel_attention as cpa
from labkit.runtime.collectives import CountCollectives
from labkit.parallel.strategies import allreduce_gradients, rank_batch, world_mesh
from labkit.model.transformer import (Shape, Transformer, add_shape_args, next_token_loss,
                                      shape_from_args)

# heads 12 and 24 tokens: whole heads and 2N chunks at N = 1, 2, 3 and 4
SHAPE = Shape(layers=2, hidden=48, heads=12, seq=24, vocab=64)
BATCH = 2
STEPS = 2
LEARNING_RATE = 0.1
LAYOUT = "zigzag"   # the variants train in it; the ring's FLOPs are measured in both
VARIANTS = ("ring", "allgather", "ulysses", "torch_cp", "ring_no_rescale", "ring_local_mask")
PITFALLS = ("ring_no_rescale", "ring_local_mask")
TORCH_CP_ON_CPU = ("torch 2.13's context_parallel runs on CUDA only: on CPU, aten._scaled_dot_"
                   "product_flash_attention_for_cpu.default does not have a sharding strategy "
                   "registered")


def attention_of(name, positions, group=None):
    """attend(q, k, v) for the variant: this rank's rows of causal attention."""
    chunks = 2   # zig-zag: two chunks per rank
    local = torch.arange(positions.shape[1], device=positions.device).expand_as(positions)
    return {
        "ring": lambda q, k, v: cpa.ring_attention(q, k, v, positions, chunks, group),
        "allgather": lambda q, k, v: cpa.allgather_attention(q, k, v, positions, group),
        "ulysses": lambda q, k, v: cpa.ulysses_attention(q, k, v, positions, group),
        "ring_no_rescale": lambda q, k, v: cpa.ring_attention(q, k, v, positions, chunks,
                                                              group, rescale=False),
        "ring_local_mask": lambda q, k, v: cpa.ring_attention(q, k, v, local, chunks, group),
    }[name]


class ContextParallelModel(nn.Module):
    """A full copy of the model that runs on this rank's tokens (`mine`: their global
    positions) with a distributed attention."""

    def __init__(self, full, attend, mine):
        super().__init__()
        self.model, self.attend, self.mine = copy.deepcopy(full), attend, mine
        self.blocks = self.model.blocks

    def loss(self, ids, targets):
        """This rank's share of the mean loss over all b s tokens: summed over the ranks
        (with the gradients), it is the whole sequence's mean."""
        x = self.model.embed.tokens(ids[:, self.mine]) + self.model.embed.positions(self.mine)
        for block in self.blocks:
            x = cpa.block_forward(block, x, self.attend)
        logits = self.model.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets[:, self.mine].flatten(),
                               reduction="sum") / targets.numel()


def sdpa_loss(model, ids, targets, positions, total):
    """The same model with F.scaled_dot_product_attention, on whatever tokens torch's
    context_parallel left this rank (its positions sharded alike)."""
    x = model.embed.tokens(ids) + model.embed.positions(positions)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for block in model.blocks:
        x = cpa.block_forward(block, x, sdpa)
    return F.cross_entropy(model.head(x).flatten(0, 1), targets.flatten(), reduction="sum") / total


def reference(shape, args, env):
    """One process, whole sequences, the same batches: {name: parameter}."""
    torch.manual_seed(args.seed)
    model = Transformer(shape, device=env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for s in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, s, 0, env.device)
        next_token_loss(model(ids), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def train(name, shape, args, env):
    """(model's parameters {name: tensor}, counter of the last step, attention bytes)."""
    torch.manual_seed(args.seed)
    full = Transformer(shape, device=env.device)
    positions = cpa.layout_positions(shape.seq, env.world_size, LAYOUT, env.device)
    if name == "torch_cp":
        from torch.distributed.tensor.experimental import context_parallel
        mesh, model = world_mesh(env.device, env.group), full
    else:
        model = ContextParallelModel(full, attention_of(name, positions, env.group),
                                     positions[env.rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    counter = comm_model.CollectiveCounter(env.world_size)
    for s in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, s, 0, env.device)
        counter.reset()   # the last step is counted
        with CountCollectives(counter):
            if name == "torch_cp":
                # torch shards the buffers in place, in its own head-tail (zig-zag) order
                buffers = [ids.clone(), targets.clone(),
                           torch.arange(shape.seq, device=env.device).expand_as(ids).clone()]
                with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                      no_restore_buffers=set(buffers)):
                    sdpa_loss(model, *buffers, total=ids.numel()).backward()
            else:
                model.loss(ids, targets).backward()
            allreduce_gradients(list(model.parameters()), env.group)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    kept = None if name == "torch_cp" else cpa.attention_matrix_bytes(
        lambda: model.loss(ids, targets))
    params = model.model if name != "torch_cp" else model
    return dict(params.named_parameters()), counter, kept


def by_rank(value, env):
    """[value of rank r] on every rank (a collective)."""
    mine = torch.tensor([value], device=env.device, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(env.world_size)]
    torch.distributed.all_gather(every, mine, group=env.group)
    return [int(x.item()) for x in every]


def run_variant(name, shape, args, env, expected):
    params, counter, kept = train(name, shape, args, env)
    names = sorted(expected)
    n, s, b, h = env.world_size, shape.seq, args.batch, shape.hidden
    psi = sum(p.numel() for p in params.values())
    method = "ring" if name.startswith("ring") else name
    result = {
        "max_param_diff": distenv.max_param_diff([params[k] for k in names],
                                                 [expected[k] for k in names], env.device,
                                                 env.group),
        "expected_equal": name not in PITFALLS or (name == "ring_local_mask" and n == 1),
        "comm_bytes_per_rank": round(counter.sent),
        "collectives": counter.counts,
    }
    if name == "torch_cp":   # torch's own plan is not modelled: its bytes are reported only
        return {**result, "predicted_comm_bytes_per_rank": None, "predicted_collectives": None,
                "activation_bytes_per_rank": None, "predicted_activation_bytes_per_rank": None}
    plan = comm_model.context_parallel_collectives(method, shape.layers, s, b, h, n, psi)
    sent, counts = comm_model.collectives_summary(plan, n)
    predicted_kept = None
    if name != "ring_local_mask":   # the bug's blocks follow its wrong mask, not a model
        predicted_kept = [shape.layers * x for x in memory_model.
                          context_parallel_attention_matrix_bytes(method, s, b, shape.heads, n)]
    return {**result, "predicted_comm_bytes_per_rank": round(sent),
            "predicted_collectives": counts, "activation_bytes_per_rank": by_rank(kept, env),
            "predicted_activation_bytes_per_rank": predicted_kept}


def attention_flops(shape, batch, layout, env):
    """[FLOPs rank r's ring attention forward performs], counted by torch's FlopCounterMode."""
    n = env.world_size
    positions = cpa.layout_positions(shape.seq, n, layout, env.device)
    generator = distenv.generator(0, "flops", env.rank)
    q, k, v = torch.randn(3, batch, shape.heads, shape.seq // n, shape.hidden // shape.heads,
                          generator=generator, device="cpu").to(env.device)
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        cpa.ring_attention(q, k, v, positions, 1 if layout == "contiguous" else 2, env.group)
    return by_rank(flops.get_total_flops(), env)


def run(args, env):
    shape = shape_from_args(args)
    env.print0(f"context-parallel size {env.world_size} ({env.backend}), {shape}")
    expected = reference(shape, args, env)
    variants, skipped = {}, {}
    for name in args.variants:
        if name == "torch_cp" and env.device.type != "cuda":
            skipped[name] = TORCH_CP_ON_CPU
            env.print0(f"{name:>15}: skipped ({TORCH_CP_ON_CPU})")
            continue
        result = variants[name] = distenv.try_variant(
            env, name, lambda: run_variant(name, shape, args, env, expected))
        if "not_run" in result:
            continue
        verdict = "as expected" if ((result["max_param_diff"] <= 1e-5)
                                    == result["expected_equal"]) else "UNEXPECTED"
        env.print0(f"{name:>15}: max |p - ref| {result['max_param_diff']:.1e} ({verdict}), "
                   f"sent {result['comm_bytes_per_rank']:,} B (predicted "
                   f"{result['predicted_comm_bytes_per_rank']})")
    measured = {layout: attention_flops(shape, args.batch, layout, env)
                for layout in time_model.CP_LAYOUTS}
    predicted = {layout: time_model.ring_attention_flops_by_rank(
        shape.seq, args.batch, shape.hidden, env.world_size, layout)
        for layout in time_model.CP_LAYOUTS}
    env.print0(f"ring attention FLOPs by rank: {measured}")
    return {"cp": env.world_size, "layout": LAYOUT, "shape": dataclasses.asdict(shape),
            "batch": args.batch, "variants": variants, "skipped": skipped,
            "attention_flops_by_rank": measured, "predicted_attention_flops_by_rank": predicted}


def check_split(shape, variants, cp, layout=LAYOUT):
    """The layout needs s in 2N chunks (zig-zag) or N (contiguous); Ulysses whole heads."""
    chunks = 2 * cp if layout == "zigzag" else cp
    if shape.seq % chunks:
        distenv.fail(f"--seq {shape.seq} does not split into {chunks} equal chunks "
                     f"(the {layout} layout over {cp} ranks)")
    if "ulysses" in variants and shape.heads % cp:
        distenv.fail(f"--heads {shape.heads} does not split over {cp} ranks: ulysses gives "
                     f"each rank whole heads (leave it out with --variants)")


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

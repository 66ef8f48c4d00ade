"""Expert parallelism: a mixture-of-experts transformer with its experts sharded over the
ranks, tokens sent to them by all-to-all or by all-gather, every byte counted.

Every rank trains on its own batch (the ranks are data-parallel for all but the experts).
Each variant trains the same model for --steps steps with plain SGD and is compared with
`dense`, which trains one copy holding every expert on all the ranks' batches (each
rank's batch a group of its own: its own capacity, its own load-balancing loss).

  dense                      one process holds every expert: the reference
  alltoall                   E/N experts per rank; dispatch and combine with
                             all_to_all_single and uneven splits (labkit/parallel/expert_dispatch.py)
  allgather                  an all-gather dispatcher: every rank gets every token (with
                             its k gates and expert ids), computes its experts' slots, and
                             a reduce-scatter returns the sums (the lab's form of
                             Megatron-Core's MoEAllGatherTokenDispatcher)
  ep_dp                      EP x DP: ep = N/2 ranks share the experts, dp = 2 replicas of
                             them (N odd: dp = 1); the rest averaged over all N ranks, each
                             expert's gradient over its dp replicas (no ZeRO-1 here)
  combine_in_dispatch_order  pitfall: the returned outputs used in the order they were sent
                             (sorted by expert), not put back in the tokens' order
  capacity_too_small         pitfall: all-to-all with a capacity factor of 0.5: tokens
                             dropped that `dense` keeps, and counted

After them, rank 0 trains `dense` with a router biased towards two experts for
--balance-steps steps, left alone, with the load-balancing loss, and with DeepSeek-V3's
auxiliary-loss-free balancing (a bias per expert, for choosing only, stepped after each
step), and records the load imbalance (the busiest expert's tokens over the mean) at each
step.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/expert_parallel.py \\
                          --out ep4.json
  one process:          python labs/expert_parallel.py
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/expert_parallel.py \\
                          --experts 64 --top-k 2 --hidden 256 --heads 8 --out ep8.json
  two nodes (run on each, HOST = node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=ep labs/expert_parallel.py --experts 64 --out ep16.json

JSON: `variants` {name: {ep, dp, max_param_diff, expected_equal, comm_bytes_per_rank and
predicted_comm_bytes_per_rank (a list, one per rank: uneven routing sends uneven bytes),
collectives {op: count}, sent_tokens (per layer, [from rank][to rank]), tokens_per_expert
(per layer, all ranks' routed slots), dropped_tokens, param_bytes_per_rank,
predicted_param_bytes_per_rank}}, counted over the last training step; `load_balance`
{aux_loss_weight, bias_speed, imbalance: {none, aux_loss, expert_bias: [imbalance per
step]}}; `shape`, `batch`, `tokens_per_rank`, `capacity`.
"""

import dataclasses

import torch
import torch.distributed as dist

from labkit.predict import comm_model, memory_model
from labkit.runtime import distenv
from labkit.runtime.collectives import CountCollectives
from labkit.parallel.expert_dispatch import AllGatherExperts, AllToAllExperts, shard_experts
from labkit.model.moe import MoEConfig, MoETransformer
from labkit.parallel.strategies import allreduce_gradients, rank_batch
from labkit.model.transformer import Shape, add_shape_args, next_token_loss, shape_from_args

SHAPE = Shape(layers=2, hidden=16, heads=2, seq=8, vocab=64)
BATCH = 2                 # sequences per rank per step
EXPERTS = 12              # divisible by 1, 2, 3, 4 and 6
TOP_K = 2
CAPACITY_FACTOR = 3.0
EXPERT_HIDDEN = 32
STEPS = 2
LEARNING_RATE = 0.1
AUX_LOSS_WEIGHT = 0.01
SMALL_CAPACITY_FACTOR = 0.5
BALANCE_STEPS, BALANCE_LR, BALANCE_AUX_WEIGHT, ROUTER_BIAS = 12, 0.5, 0.1, 2.0
BALANCE_BIAS_SPEED = 0.02     # the expert bias's step (DeepSeek-V3: 0.001 over far more steps)
VARIANTS = ("dense", "alltoall", "allgather", "ep_dp", "combine_in_dispatch_order",
            "capacity_too_small")
PITFALLS = ("combine_in_dispatch_order", "capacity_too_small")


def layout(name, world_size):
    """(ep, dp) of a variant: EP x DP puts 2 replicas of the experts where N is even."""
    if name == "dense":
        return 1, 1
    dp = 2 if name == "ep_dp" and world_size % 2 == 0 else 1
    return world_size // dp, dp


def groups(ep, dp, rank):
    """This rank's expert-parallel group (ranks d ep .. d ep + ep - 1) and data-parallel
    group (its place in every expert group); every rank creates every group."""
    if dp == 1:
        return dist.group.WORLD, None
    mine = {}
    for d in range(dp):
        ranks = list(range(d * ep, (d + 1) * ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ep"] = group
    for e in range(ep):
        ranks = list(range(e, ep * dp, ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["dp"] = group
    return mine["ep"], mine["dp"]


def build(args, shape, device, capacity_factor=None):
    """The model, built on `device` (every variant and the reference from the same seed)."""
    torch.manual_seed(args.seed)
    config = MoEConfig(args.experts, args.top_k, capacity_factor or args.capacity_factor,
                       args.expert_hidden)
    with torch.device(device):
        return MoETransformer(shape, config)


def loss_of(model, ids, targets, aux_weight, scale):
    return (next_token_loss(model(ids), targets) + aux_weight * model.aux_loss()) * scale


def routed(model):
    """(slots routed to each expert per layer, slots dropped) of the last forward."""
    counts = torch.stack([layer.routing.counts for layer in model.moe_layers()])
    dropped = sum(int((~layer.routing.kept).sum()) for layer in model.moe_layers())
    return counts, dropped


def reference(args, shape, env):
    """`dense`: every rank's batch through one model holding every expert."""
    model = build(args, shape, env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(args.steps):
        counts, dropped = 0, 0
        for r in range(env.world_size):
            ids, targets = rank_batch(shape, args.batch, args.seed, step, r, env.device)
            loss_of(model, ids, targets, args.aux_loss_weight, 1 / env.world_size).backward()
            c, d = routed(model)
            counts, dropped = counts + c, dropped + d
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, counts, dropped


def run_variant(name, args, shape, env, ref):
    ep, dp = layout(name, env.world_size)
    ep_group, dp_group = groups(ep, dp, env.rank)
    small = SMALL_CAPACITY_FACTOR if name == "capacity_too_small" else None
    model = build(args, shape, env.device, small)
    dispatcher = (AllGatherExperts(ep_group) if name == "allgather" else
                  AllToAllExperts(ep_group, combine_in_order=name != "combine_in_dispatch_order"))
    shard_experts(model, dispatcher)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    world = comm_model.CollectiveCounter(env.world_size)
    by_group = {} if dp == 1 else {ep_group.group_name: comm_model.CollectiveCounter(ep),
                                   dp_group.group_name: comm_model.CollectiveCounter(dp)}
    for step in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, step, env.rank, env.device)
        world.reset()
        for counter in by_group.values():
            counter.reset()
        if hasattr(dispatcher, "sent"):
            dispatcher.sent.clear()
        with CountCollectives(world, by_group):   # the last step's collectives
            loss_of(model, ids, targets, args.aux_loss_weight, 1 / env.world_size).backward()
            allreduce_gradients(model.shared_parameters())          # sum of the 1/N shares
            if dp_group is not None:
                allreduce_gradients(model.expert_parameters(), group=dp_group)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, dispatcher, [world, *by_group.values()], (ep, dp)


def report(name, model, dispatcher, counters, layout_, args, shape, env, ref):
    ep, dp = layout_
    ref_params = dict(ref.named_parameters())
    first = model.moe_layers()[0].first_expert
    mine, theirs = [], []
    for pname, param in model.named_parameters():
        if ".experts." in pname:   # local expert i is the reference's expert first + i
            head, rest = pname.split(".experts.")
            i, tail = rest.split(".", 1)
            pname = f"{head}.experts.{first + int(i)}.{tail}"
        mine.append(param)
        theirs.append(ref_params[pname])
    diff = distenv.max_param_diff(mine, theirs, env.device)
    counts, dropped = routed(model)
    dist.all_reduce(counts)
    dropped_total = torch.tensor([dropped], device=env.device)
    dist.all_reduce(dropped_total)
    sent_matrix = None
    h = shape.hidden
    shared = sum(p.numel() for p in model.shared_parameters())
    experts_local = sum(p.numel() for p in model.expert_parameters())
    predicted = [comm_model.bytes_sent_per_rank("all_reduce", 4 * shared, env.world_size)
                 + comm_model.bytes_sent_per_rank("all_reduce", 4 * experts_local, dp)] * env.world_size
    if isinstance(dispatcher, AllToAllExperts):
        every = [None] * env.world_size
        dist.all_gather_object(every, dispatcher.sent)   # [rank][layer][to]
        sent_matrix = [[every[r][layer] for r in range(env.world_size)]
                       for layer in range(shape.layers)]
        counts_bytes = comm_model.bytes_sent_per_rank("all_to_all", 8 * args.experts, ep)
        for layer in range(shape.layers):
            for g in range(dp):   # each expert group's all-to-alls among its own ranks
                block = [every[g * ep + i][layer] for i in range(ep)]
                for i, b in enumerate(comm_model.alltoall_dispatch_bytes(block, h, 4, counts_bytes)):
                    predicted[g * ep + i] += b
    else:
        tokens = args.batch * shape.seq
        per_layer = comm_model.allgather_dispatch_bytes(tokens, h, args.top_k, ep)
        predicted = [p + shape.layers * per_layer for p in predicted]
    sent = torch.tensor([float(sum(c.sent for c in counters))], device=env.device)
    every_sent = [torch.zeros_like(sent) for _ in range(env.world_size)]
    dist.all_gather(every_sent, sent)
    collectives = {}
    for counter in counters:
        for op, n in counter.counts.items():
            collectives[op] = collectives.get(op, 0) + n
    return {
        "ep": ep, "dp": dp,
        "max_param_diff": diff,
        "expected_equal": name not in PITFALLS,
        "comm_bytes_per_rank": [round(t.item()) for t in every_sent],
        "predicted_comm_bytes_per_rank": [round(p) for p in predicted],
        "collectives": collectives,
        "sent_tokens": sent_matrix,
        "tokens_per_expert": counts.tolist(),
        "dropped_tokens": int(dropped_total.item()),
        "param_bytes_per_rank": 4 * sum(p.numel() for p in model.parameters()),
        "predicted_param_bytes_per_rank": 4 * memory_model.moe_transformer_params(
            shape.layers, h, shape.vocab, shape.seq, args.experts, args.expert_hidden,
            args.experts // ep),
    }


def load_balance(args, shape, env):
    """max/mean slots per expert at each step from a router whose bias favours experts 0
    and 1 (mean over the layers): left alone, with the load-balancing loss, and with
    DeepSeek-V3's bias per expert instead of a loss (labkit/model/moe.py)."""
    imbalances = {}
    for name, weight, speed in (("none", 0.0, 0.0), ("aux_loss", BALANCE_AUX_WEIGHT, 0.0),
                                ("expert_bias", 0.0, BALANCE_BIAS_SPEED)):
        model = build(args, shape, env.device)
        for layer in model.moe_layers():
            with torch.no_grad():
                layer.router.bias[:2] += ROUTER_BIAS
        optimizer = torch.optim.SGD(model.parameters(), lr=BALANCE_LR)
        imbalance = []
        for step in range(args.balance_steps):
            ids, targets = rank_batch(shape, args.batch * env.world_size, args.seed, step,
                                      "balance", env.device)
            loss_of(model, ids, targets, weight, 1.0).backward()
            counts = routed(model)[0].double()
            imbalance.append((counts.max(1).values / counts.mean(1)).mean().item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if speed:
                for layer, layer_counts in zip(model.moe_layers(), counts):
                    layer.update_expert_bias(layer_counts, speed)
        imbalances[name] = imbalance
    return {"aux_loss_weight": BALANCE_AUX_WEIGHT, "bias_speed": BALANCE_BIAS_SPEED,
            "imbalance": imbalances}


def run(args, env):
    shape = shape_from_args(args)
    ref, ref_counts, ref_dropped = reference(args, shape, env)
    variants = {}
    for name in args.variants:
        if name == "dense":
            total = memory_model.moe_transformer_params(
                shape.layers, shape.hidden, shape.vocab, shape.seq, args.experts,
                args.expert_hidden)
            variants[name] = {"ep": 1, "dp": 1, "max_param_diff": 0.0, "expected_equal": True,
                              "comm_bytes_per_rank": [0] * env.world_size,
                              "predicted_comm_bytes_per_rank": [0] * env.world_size,
                              "collectives": {}, "sent_tokens": None,
                              "tokens_per_expert": ref_counts.tolist(),
                              "dropped_tokens": ref_dropped,
                              "param_bytes_per_rank": 4 * sum(p.numel() for p in ref.parameters()),
                              "predicted_param_bytes_per_rank": 4 * total}
            continue
        v = variants[name] = distenv.try_variant(
            env, name, lambda: report(name, *run_variant(name, args, shape, env, ref),
                                      args, shape, env, ref))
        if "not_run" in v:
            continue
        verdict = "as expected" if ((v["max_param_diff"] <= 1e-5)
                                    == v["expected_equal"]) else "UNEXPECTED"
        env.print0(f"{name:>25}: max |p - dense| {v['max_param_diff']:.1e} ({verdict}), "
                   f"rank 0 sent {v['comm_bytes_per_rank'][0]:,} B (predicted "
                   f"{v['predicted_comm_bytes_per_rank'][0]:,}), dropped {v['dropped_tokens']}")
    tokens = args.batch * shape.seq
    return {"shape": dataclasses.asdict(shape), "batch": args.batch, "tokens_per_rank": tokens,
            "capacity": comm_model.expert_capacity(tokens, args.experts, args.top_k,
                                                   args.capacity_factor),
            "variants": variants,
            "load_balance": load_balance(args, shape, env) if env.is_rank0 else None}


def check_split(experts, world_size, variants):
    """Every variant's expert-parallel size must divide E, or the lab refuses to start."""
    for name in variants:
        ep, _ = layout(name, world_size)
        if experts % ep:
            distenv.fail(f"--experts {experts} does not split over {ep} expert-parallel ranks"
                         f" ({name})")


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--variants", type=distenv.choice_list(VARIANTS), default=list(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}; or all")
    parser.add_argument("--experts", type=distenv.positive_int, default=EXPERTS,
                        help="experts per MoE layer (E)")
    parser.add_argument("--top-k", type=int, choices=(1, 2), default=TOP_K,
                        help="experts per token (k)")
    parser.add_argument("--capacity-factor", type=distenv.number_above(0), default=CAPACITY_FACTOR,
                        help="slots per expert = ceil(factor x k x tokens / E)")
    parser.add_argument("--expert-hidden", type=distenv.positive_int, default=EXPERT_HIDDEN,
                        help="each expert's MLP width")
    parser.add_argument("--aux-loss-weight", type=float, default=AUX_LOSS_WEIGHT,
                        help="weight of the load-balancing loss in training")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS, help="training steps")
    parser.add_argument("--balance-steps", type=distenv.positive_int, default=BALANCE_STEPS,
                        help="steps of the load-balance comparison")
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="sequences per rank per step")
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(argv)
    shape_from_args(args)
    if args.top_k > args.experts:
        distenv.fail(f"--top-k {args.top_k} needs at least as many experts, got {args.experts}")
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        check_split(args.experts, env.world_size, args.variants)
        env.print0(f"expert-parallel lab: {env.world_size} ranks ({env.backend}), "
                   f"E = {args.experts}, k = {args.top_k}, C = {args.capacity_factor:g}")
        env.write_result(args, run(args, env))


if __name__ == "__main__":
    main()

"""Data x pipeline x context x tensor parallelism on one device mesh, checked against one
process.

The world's N = dp x pp x cp x tp ranks form a mesh with tp innermost, then cp, then pp,
and dp outermost (labkit/parallel/mesh.py); without --cp it is the 3-D mesh dp x pp x tp, and rank
r sits at d = r // (pp tp), p = r // tp % pp, t = r % tp. Every rank
builds the course's transformer from the same seed, splits each layer over its
tensor-parallel group as Megatron-LM does (labkit/parallel/tensor_parallel_layers.py), keeps the
contiguous layers of its pipeline stage (p of pp), and trains them with the 1F1B (or
GPipe) schedule from scratch (labkit/parallel/pipeline_schedules.py) on its data-parallel share of
each step's batch, cut into --microbatches micro-batches. With --cp c, each of the c ranks
of a context-parallel group takes 1/c of every sequence's tokens (two zig-zag chunks, so
that causal attention's work is even) and its attention passes keys and values round the
group's ring (labkit/parallel/context_parallel_attention.py, as in the context-parallel chapter);
the c ranks hold the same weights, and average their gradients over cp as over dp. Over dp
(--data-parallel):

  ddp   every rank keeps its stage's slices whole; after the last micro-batch the gradients
        are averaged over the data-parallel group in one all-reduce, as Megatron-LM's DDP
        does under a pipeline
  fsdp  torch's FSDP2 shards them over the data-parallel group (fully_shard on the stage,
        on the mesh's dp dimension): parameters gathered before each micro-batch's forward
        and again before its backward, gradients reduce-scattered after it (ZeRO-3; with
        tp, the FSDP2 x TP layout of torchtitan)

and SGD with momentum steps.

The trained parameters, put back together, are compared with one process that trains
the whole model on the whole batch. Every collective of the first step is counted by the
process group it runs on, so the bytes of each dimension are measured apart and set
beside the cost models: tensor parallelism's all-reduces (comm_model.
tensor_parallel_collectives, for the layers, embedding and head a stage holds), the
pipeline's sends (pipeline_p2p_bytes_per_rank), the ring's sends and the gradients'
all-reduce over cp (context_parallel_collectives) and the data-parallel collectives
(data_parallel_step_collectives, with FSDP2's padding, memory_model.fsdp2_gathered_numel).
The parameters, gradients and momentum each rank holds are counted beside
memory_model.stage_params_per_rank (and, sharded, fsdp2_shard_numel).

Launch lines (from the repository root):
  laptop, gloo on CPU, 8 ranks:  torchrun --standalone --nproc_per_node=8 labs/hybrid.py \\
                                   --dp 2 --pp 2 --tp 2 --out hybrid.json
  an odd degree:                 torchrun --standalone --nproc_per_node=3 labs/hybrid.py \\
                                   --dp 1 --pp 1 --tp 3
  2-D, FSDP2 x TP:               torchrun --standalone --nproc_per_node=4 labs/hybrid.py \\
                                   --dp 2 --tp 2 --data-parallel fsdp
  with context parallelism:      torchrun --standalone --nproc_per_node=8 labs/hybrid.py \\
                                   --pp 2 --cp 2 --tp 2
  three layouts in one launch:   torchrun --standalone --nproc_per_node=8 labs/hybrid.py \\
                                   --dp 2 --pp 2 --tp 2 \\
                                   --then dp=2,tp=2,data-parallel=fsdp cp=2,tp=2
  GPU box, NCCL (tp inside the node):  torchrun --standalone --nproc_per_node=8 \\
                                   labs/hybrid.py --dp 2 --pp 2 --tp 2 --out hybrid.json
  two nodes (run on each, HOST = node 0's address; dp spans the nodes):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --rdzv-id=hybrid labs/hybrid.py --dp 4 --pp 2 --tp 2 --out hybrid.json

JSON: `dp`, `pp`, `cp`, `tp`, `data_parallel`, `shape`, `batch`, `microbatches`, `schedule`;
`mesh` [{rank, dp, pp, cp, tp}]; `groups` {dp, pp, cp, tp: [[ranks]]}, checked against
torch's own DeviceMesh's groups (`groups_match_init_device_mesh`: init_device_mesh for the
first layout, a DeviceMesh on its block of ranks for each --then layout); `max_param_diff`;
`state_bytes_per_rank` and `predicted_state_bytes_per_rank` [{params, grads, optimizer,
total}, one per rank]; `comm_bytes_per_rank` and `predicted_comm_bytes_per_rank` {dp, pp,
cp, tp: [bytes each rank sends in one step, one per rank]}; `first_rank` and `ranks`, where
the layout's ranks start and how many; `then`, a result like this one for each --then
layout, in order.
"""

import contextlib
import copy
import dataclasses

import torch
import torch.distributed as dist

from labkit.predict import comm_model, memory_model
from labkit.runtime import distenv
from labkit.parallel import mesh
from labkit.parallel import context_parallel_attention as cpa
from labkit.runtime.collectives import CountCollectives
from labkit.parallel.pipeline_schedules import OpClock, run_schedule, schedule_order, split_pieces
from labkit.parallel.strategies import allreduce_gradients, apply_fsdp_unit, rank_batch
from labkit.parallel.tensor_parallel_layers import (TensorParallelTransformer,
                                                    VocabParallelCrossEntropy)
from labkit.model.transformer import (Shape, Transformer, add_shape_args, next_token_loss,
                                      shape_from_args)

# 6 heads and a vocabulary of 48 split over tp = 1, 2, 3 (and 6); 4 layers fill pp = 1..4
SHAPE = Shape(layers=4, hidden=24, heads=6, seq=8, vocab=48)
BATCH = 24            # sequences per step: divisible by dp x m for dp = 1..4 and m = 1, 2
MICROBATCHES = 2
STEPS = 2             # the first is counted; the second shows the momentum is right too
LEARNING_RATE, MOMENTUM = 0.1, 0.9
VALUE_BYTES = 4       # fp32 throughout


def reference(shape, args, device):
    """One process, the whole model, the whole batch: {name: trained parameter}."""
    torch.manual_seed(args.seed)
    model = Transformer(shape, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    for step in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, step, 0, device)
        next_token_loss(model(ids), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def own_names(name, stage, stages, layers):
    """Whether full-model parameter `name` belongs to pipeline stage `stage`."""
    start = sum(memory_model.stage_layers(layers, stages)[:stage])
    count = memory_model.stage_layers(layers, stages)[stage]
    if name.startswith("embed."):
        return stage == 0
    if name.startswith("head."):
        return stage == stages - 1
    return start <= int(name.split(".")[1]) < start + count


def layout_size(layout):
    return layout.dp * layout.pp * layout.cp * layout.tp


def device_meshes(layouts, env):
    """[(first rank, torch's DeviceMesh of (dp, pp, cp, tp), a group of all its ranks)], one
    per layout, on the blocks of ranks that first_ranks gives: the first over the whole
    world with init_device_mesh. Every rank builds every mesh, since creating a process
    group takes the whole world. Fails if a mesh's groups are not the ones labkit.parallel.mesh lays
    out."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    meshes = []
    for index, (layout, first) in enumerate(zip(layouts, first_ranks(layouts, env.world_size))):
        size, dims = layout_size(layout), (layout.dp, layout.pp, layout.cp, layout.tp)
        if index == 0:
            device_mesh, everyone = init_device_mesh(
                env.device.type, dims, mesh_dim_names=mesh.DIMENSIONS), None
        else:
            device_mesh = DeviceMesh(env.device.type, torch.arange(first, first + size).view(dims),
                                     mesh_dim_names=mesh.DIMENSIONS)
            everyone = dist.new_group(list(range(first, first + size)))
        inside = device_mesh.get_coordinate() is not None
        mine = {dim: dist.get_process_group_ranks(device_mesh.get_group(dim))
                for dim in mesh.DIMENSIONS} if inside else None
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, mine)
        theirs = {dim: sorted({tuple(ranks[dim]) for ranks in gathered if ranks is not None})
                  for dim in mesh.DIMENSIONS}
        expected = offset_groups(layout, first)
        if any([list(g) for g in theirs[dim]] != expected[dim] for dim in mesh.DIMENSIONS):
            raise RuntimeError(f"torch's DeviceMesh made groups {theirs}, labkit.parallel.mesh expects "
                               f"{expected}")
        meshes.append((first, device_mesh, everyone))
    return meshes


def first_ranks(layouts, world_size):
    """Where each layout's block of ranks starts. The first layout takes the whole world; the
    --then layouts follow side by side from rank 0, and one that does not fit in the ranks
    left starts again at rank 0. A rank runs its layouts in order, so a block that starts
    again waits for the layouts before it on its ranks."""
    firsts, next_free = [0], 0
    for layout in layouts[1:]:
        if next_free + layout_size(layout) > world_size:
            next_free = 0
        firsts.append(next_free)
        next_free += layout_size(layout)
    return firsts


def offset_groups(layout, first):
    """labkit.parallel.mesh's groups of a layout whose ranks start at `first`."""
    return {dim: [[first + r for r in group] for group in groups]
            for dim, groups in mesh.groups(layout.dp, layout.pp, layout.tp, layout.cp).items()}


def measured_state(piece, optimizer):
    """{params, grads, optimizer, total} bytes this rank holds, counted tensor by tensor
    (of a DTensor, its own shard)."""
    params = list(piece.parameters())
    state = [v for p in params for v in optimizer.state[p].values() if torch.is_tensor(v)]
    row = {"params": distenv.local_bytes(params),
           "grads": distenv.local_bytes(p.grad for p in params if p.grad is not None),
           "optimizer": distenv.local_bytes(state)}
    row["total"] = sum(row.values())
    return row


def predictions(shape, args, stage, local_shapes=None, dp_rank=0):
    """(state {params, grads, optimizer, total}, comm {dp, pp, cp, tp}) bytes for a rank
    of pipeline stage `stage`, from the cost models. Under FSDP2 the exact shards depend on
    the shapes of the rank's tensor-parallel slices (`local_shapes`) and its dp rank."""
    dp, pp, cp, tp, m = args.dp, args.pp, args.cp, args.tp, args.microbatches
    micro, seq = args.batch // (dp * m), shape.seq // cp   # a rank's tokens: s / cp each
    params = memory_model.stage_params_per_rank(shape.layers, shape.hidden, shape.vocab,
                                                shape.seq, pp, tp, stage)
    if args.data_parallel == "ddp":
        state = memory_model.state_bytes_per_gpu(params, dp, "ddp", "momentum", "fp32")
        dp_plan = comm_model.data_parallel_step_collectives("ddp", params, m)
    else:   # FSDP2: each tensor's dim 0 split in ceil(d0 / dp) rows, one unit per stage
        shard = sum(memory_model.fsdp2_shard_numel(s, dp, dp_rank) for s in local_shapes)
        state = {"params": 4 * shard, "grads": 4 * shard, "optimizer": 4 * shard}
        state["total"] = sum(state.values())
        dp_plan = comm_model.data_parallel_step_collectives(
            "zero3", memory_model.fsdp2_gathered_numel(local_shapes, dp), m)
    layers = memory_model.stage_layers(shape.layers, pp)[stage]
    tp_plan = comm_model.tensor_parallel_collectives(
        layers, seq, micro, shape.hidden, tp, embedding=stage == 0, head=stage == pp - 1)
    # the ring passes this rank's heads' K and V (h / tp wide) in every micro-batch; the
    # gradients of the weights all cp ranks hold are averaged over cp once per step
    *ring, gradients = comm_model.context_parallel_collectives(
        "ring", layers, shape.seq, micro, shape.hidden // tp, cp, params)
    comm = {"dp": comm_model.collectives_summary(dp_plan, dp, VALUE_BYTES)[0],
            "pp": comm_model.pipeline_p2p_bytes_per_rank(pp, m, micro * seq * shape.hidden,
                                                         value_bytes=VALUE_BYTES)[stage],
            "cp": (m * comm_model.collectives_summary(ring, cp, VALUE_BYTES)[0]
                   + comm_model.collectives_summary([gradients], cp, VALUE_BYTES)[0]),
            "tp": m * comm_model.collectives_summary(tp_plan, tp, VALUE_BYTES)[0]}
    return state, comm


class ContextParallelEmbedding(torch.nn.Module):
    """The embedding of this rank's tokens of each sequence, at their own positions."""

    def __init__(self, embed, mine):
        super().__init__()
        self.embed, self.mine = embed, mine

    def forward(self, ids):
        return self.embed(ids[:, self.mine], positions=self.mine)


class ContextParallelBlock(torch.nn.Module):
    """A block whose attention is the ring's over the context-parallel group."""

    def __init__(self, block, attend):
        super().__init__()
        self.block, self.attend = block, attend

    def forward(self, x):
        return cpa.block_forward(self.block, x, self.attend)


class ContextParallelPieces(torch.nn.Module):
    """The tensor-parallel model as pieces of a pipeline (embed, blocks, head) that run on
    this rank's tokens: what split_pieces cuts."""

    def __init__(self, model, positions, group, rank):
        super().__init__()
        mine = positions[rank]
        attend = lambda q, k, v: cpa.ring_attention(q, k, v, positions, 2, group)  # noqa: E731
        self.embed = ContextParallelEmbedding(model.embed, mine)
        self.blocks = torch.nn.ModuleList(ContextParallelBlock(b, attend) for b in model.blocks)
        self.head = model.head


def run(args, env, first_rank, device_mesh, everyone):
    """Train one layout on its ranks, from first_rank on (`everyone`, their group; None:
    the whole world), and return what it measured, the same on each of them."""
    shape = shape_from_args(args)
    size = layout_size(args)
    groups = {**{dim: device_mesh.get_group(dim) for dim in mesh.DIMENSIONS},
              "dp_mesh": device_mesh["dp"]}   # the 1-D mesh FSDP2 shards over
    here = mesh.coordinates(env.rank - first_rank, args.dp, args.pp, args.tp, args.cp)
    stage, m = here["pp"], args.microbatches
    first, last = stage == 0, stage == args.pp - 1

    torch.manual_seed(args.seed)   # the reference's initial weights, on every rank
    model = TensorParallelTransformer(Transformer(shape, device=env.device), groups["tp"])
    mine = slice(None)                       # the tokens of each sequence this rank keeps
    pieces = model
    if args.cp > 1:
        positions = cpa.layout_positions(shape.seq, args.cp, "zigzag", env.device)
        mine = positions[here["cp"]]
        pieces = ContextParallelPieces(model, positions, groups["cp"], here["cp"])
    piece = split_pieces(pieces, args.pp)[stage]
    local_shapes = [tuple(p.shape) for p in piece.parameters()]
    if args.data_parallel == "fsdp":
        apply_fsdp_unit(piece, groups["dp_mesh"])
    optimizer = torch.optim.SGD(piece.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    # each rank's mean over its tokens: averaged over cp with the gradients, the mean over all
    loss_fn = lambda logits, targets: VocabParallelCrossEntropy.apply(  # noqa: E731
        logits, targets[:, mine], model.out.rows[0], groups["tp"])
    micro = args.batch // (args.dp * m)
    stride = args.cp * args.tp   # ranks between neighbouring pipeline stages
    order = schedule_order(args.schedule, args.pp, stage, m)
    counters = {dim: comm_model.CollectiveCounter(dist.get_world_size(groups[dim]))
                for dim in mesh.DIMENSIONS}
    elsewhere = comm_model.CollectiveCounter(size)

    for step in range(args.steps):
        ids, targets = rank_batch(shape, args.batch, args.seed, step, 0, env.device)
        ids, targets = ids.chunk(args.dp)[here["dp"]], targets.chunk(args.dp)[here["dp"]]
        counting = CountCollectives(elsewhere, {groups[dim].group_name: counters[dim]
                                                for dim in mesh.DIMENSIONS})
        with counting if step == 0 else contextlib.nullcontext():
            run_schedule(piece, order, stage, args.pp, ids.chunk(m), targets.chunk(m), loss_fn,
                         clock=OpClock(hide_modes=False, device=env.device),
                         prev_rank=env.rank - stride, next_rank=env.rank + stride,
                         activation_shape=(micro, shape.seq // args.cp, shape.hidden),
                         device=env.device, timeout_s=args.timeout, group=groups["pp"])
            if args.data_parallel == "ddp":
                allreduce_gradients(piece.parameters(), groups["dp"], average=True)
            if args.cp > 1:
                allreduce_gradients(piece.parameters(), groups["cp"], average=True)
        optimizer.step()
        if step == 0:
            state = measured_state(piece, optimizer)
        optimizer.zero_grad(set_to_none=True)
    if elsewhere.counts:
        raise RuntimeError(f"collectives outside the mesh's groups: {elsewhere.counts}")

    expected = reference(shape, args, env.device)
    if args.data_parallel == "fsdp":
        piece.unshard()   # the whole tensor-parallel slices, gathered over dp
    full = model.full_parameters()   # every rank of a tp group, the same order
    diff = max((full[name] - expected[name].detach()).abs().max().item()
               for name in full if own_names(name, stage, args.pp, shape.layers))
    worst = torch.tensor([diff], device=env.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=everyone)

    predicted_state, predicted_comm = predictions(shape, args, stage, local_shapes, here["dp"])
    mine = {"coords": here, "state": state, "predicted_state": predicted_state,
            "comm": {dim: counters[dim].sent for dim in mesh.DIMENSIONS},
            "predicted_comm": predicted_comm}
    ranks = [None] * size
    dist.all_gather_object(ranks, mine, group=everyone)
    exact = lambda value: int(value) if value == int(value) else float(value)  # noqa: E731
    per_dim = lambda key: {dim: [exact(r[key][dim]) for r in ranks]  # noqa: E731
                           for dim in mesh.DIMENSIONS}
    return {"dp": args.dp, "pp": args.pp, "cp": args.cp, "tp": args.tp,
            "data_parallel": args.data_parallel,
            "shape": dataclasses.asdict(shape),
            "batch": args.batch, "microbatches": m, "schedule": args.schedule,
            "first_rank": first_rank, "ranks": size,
            "mesh": [{"rank": first_rank + rank, **r["coords"]} for rank, r in enumerate(ranks)],
            "groups": offset_groups(args, first_rank),
            "groups_match_init_device_mesh": True,
            "max_param_diff": worst.item(),
            "state_bytes_per_rank": [r["state"] for r in ranks],
            "predicted_state_bytes_per_rank": [{k: exact(v) for k, v in r["predicted_state"].items()}
                                               for r in ranks],
            "comm_bytes_per_rank": per_dim("comm"),
            "predicted_comm_bytes_per_rank": per_dim("predicted_comm")}


def report(env, result):
    last = result["first_rank"] + result["ranks"] - 1
    env.print0(f"dp {result['dp']} x pp {result['pp']} x cp {result['cp']} x tp {result['tp']} "
               f"({result['data_parallel']}), ranks {result['first_rank']} to {last}:")
    env.print0(f"{'rank':>4} {'dp':>3} {'pp':>3} {'cp':>3} {'tp':>3} {'state B':>8} "
               f"{'dp sent':>8} {'pp sent':>8} {'cp sent':>8} {'tp sent':>8}")
    for index, (entry, state) in enumerate(zip(result["mesh"], result["state_bytes_per_rank"])):
        rank, sent = entry["rank"], result["comm_bytes_per_rank"]
        env.print0(f"{rank:>4} {entry['dp']:>3} {entry['pp']:>3} {entry['cp']:>3} "
                   f"{entry['tp']:>3} {state['total']:>8,} {sent['dp'][index]:>8,} "
                   f"{sent['pp'][index]:>8,} {sent['cp'][index]:>8,} {sent['tp'][index]:>8,}")
    exact = (result["comm_bytes_per_rank"] == result["predicted_comm_bytes_per_rank"]
             and result["state_bytes_per_rank"] == result["predicted_state_bytes_per_rank"])
    env.print0("every state and byte count " + ("equals its prediction" if exact else
                                                "does NOT equal its prediction"))
    for dim in mesh.DIMENSIONS:
        env.print0(f"{dim} groups: {result['groups'][dim]}")
    env.print0(f"max |parameter - one process| {result['max_param_diff']:.1e}")


def ranks(count):
    return f"{count} rank" + ("" if count == 1 else "s")


def check(args, world_size, where=""):
    """Degrees that the world and the model can be split by, or one line saying why not
    (after `where`: which --then layout, for one of those)."""
    fail = lambda message: distenv.fail(where + message)  # noqa: E731
    model_ranks = args.pp * args.cp * args.tp
    if args.dp is None:
        if world_size % model_ranks:
            fail(f"a world of {ranks(world_size)} is not a multiple of --pp {args.pp} "
                         f"x --cp {args.cp} x --tp {args.tp}")
        args.dp = world_size // model_ranks
    if args.dp * model_ranks != world_size:
        fail(f"--dp {args.dp} x --pp {args.pp} x --cp {args.cp} x --tp {args.tp} = "
                     f"{args.dp * model_ranks}, but the world has {ranks(world_size)}")
    if args.cp > 1 and args.seq % (2 * args.cp):
        fail(f"--seq {args.seq} does not cut into 2 x --cp {args.cp} equal chunks")
    if args.cp > 1 and args.data_parallel == "fsdp":
        fail("--cp with --data-parallel fsdp is not built here: FSDP2 would shard "
                     "over dp x cp; use ddp")
    for what, value in (("--heads", args.heads), ("--vocab", args.vocab)):
        if value % args.tp:
            fail(f"{what} {value} does not split over --tp {args.tp}")
    if args.layers < args.pp:
        fail(f"--layers {args.layers} cannot give each of --pp {args.pp} stages a layer")
    if args.batch % (args.dp * args.microbatches):
        fail(f"--batch {args.batch} does not divide into --dp {args.dp} x "
                     f"--microbatches {args.microbatches} equal micro-batches")


LAYOUT_KEYS = ("dp", "pp", "cp", "tp", "data-parallel")


def layout(text):
    """argparse type of a --then layout: 'dp=2,tp=2,data-parallel=fsdp' -> {key: value};
    a degree left out is 1, data parallelism ddp."""
    values = {"dp": 1, "pp": 1, "cp": 1, "tp": 1, "data-parallel": "ddp", "text": text}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in LAYOUT_KEYS:
            raise distenv.argparse.ArgumentTypeError(
                f"{item}: a layout is key=value pairs with keys {', '.join(LAYOUT_KEYS)}")
        if key == "data-parallel":
            if value not in ("ddp", "fsdp"):
                raise distenv.argparse.ArgumentTypeError(f"data-parallel={value}: ddp or fsdp")
            values[key] = value
        elif value.isdigit() and int(value) >= 1:
            values[key] = int(value)
        else:
            raise distenv.argparse.ArgumentTypeError(f"{item}: a degree is a whole number, 1 or more")
    return values


def layouts(args, world_size):
    """The main layout (args), then each --then layout: a copy of args with its degrees,
    each checked (one line saying why not), and each within the world."""
    result = [args]
    for then in args.then:
        one = copy.copy(args)
        one.dp, one.pp, one.cp, one.tp = then["dp"], then["pp"], then["cp"], then["tp"]
        one.data_parallel, one.then = then["data-parallel"], []
        check(one, layout_size(one), where=f"--then {then['text']}: ")
        if world_size is not None and layout_size(one) > world_size:
            distenv.fail(f"--then {then['text']}: the layout needs {ranks(layout_size(one))}, "
                         f"but the world has {ranks(world_size)}")
        result.append(one)
    return result


def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--dp", type=distenv.positive_int, default=None,
                        help="data-parallel degree (default: world / (pp x tp))")
    parser.add_argument("--pp", type=distenv.positive_int, default=1, help="pipeline stages")
    parser.add_argument("--tp", type=distenv.positive_int, default=1,
                        help="tensor-parallel degree")
    parser.add_argument("--cp", type=distenv.positive_int, default=1,
                        help="context-parallel degree (zig-zag ring attention)")
    parser.add_argument("--microbatches", type=distenv.positive_int, default=MICROBATCHES,
                        help="micro-batches per step on each data-parallel rank")
    parser.add_argument("--data-parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="over dp: whole replicas and one all-reduce per step, or "
                             "FSDP2's shards (ZeRO-3)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--batch", type=distenv.positive_int, default=BATCH,
                        help="sequences per step, over all data-parallel ranks")
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS, help="training steps")
    parser.add_argument("--then", type=layout, nargs="+", default=[], metavar="LAYOUT",
                        help="after the first layout, more on the same ranks, side by side on "
                             "consecutive blocks from rank 0, and from rank 0 again when one "
                             "does not fit in the ranks left: e.g. dp=2,tp=2,data-parallel=fsdp "
                             "cp=2,tp=2 (a degree left out is 1)")
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    shape_from_args(args)
    layouts(args, None)   # each --then layout on its own, before any process starts a group
    return args


def main():
    args = parse_args()
    with distenv.initialize(args) as env:
        check(args, env.world_size)
        plan = layouts(args, env.world_size)
        meshes = device_meshes(plan, env)
        done = distenv.waiting_group()
        for index, (one, (first, _, _)) in enumerate(zip(plan, meshes)):
            env.print0(f"mesh dp {one.dp} x pp {one.pp} x cp {one.cp} x tp {one.tp} "
                       f"({env.backend}, {one.data_parallel}), {one.microbatches} micro-batches"
                       f" of {one.batch // (one.dp * one.microbatches)} sequences, "
                       f"{one.schedule}" + (f"; then on ranks {first} to "
                                            f"{first + layout_size(one) - 1}" if index else ""))
        results = {}   # {index of a layout: its result}, for the layouts this rank is in
        for index, (one, (first, device_mesh, everyone)) in enumerate(zip(plan, meshes)):
            if index > 0 and not first <= env.rank < first + layout_size(one):
                continue   # a rank outside this layout's block goes on to its next one
            try:
                results[index] = run(one, env, first, device_mesh, everyone)
            except TimeoutError as error:
                distenv.fail(str(error), every_rank=True)   # each stage says what it waited for
        # a rank done early waits asleep for the others, then the first rank of each --then
        # layout brings its result to rank 0
        distenv.wait_for_all(done)
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, [(index, results[index]) for index, (first, _, _)
                                          in enumerate(meshes) if index and first == env.rank])
        then = dict(pair for pairs in gathered for pair in pairs)
        result = dict(results[0], then=[then[index] for index in sorted(then)])
        if env.write_result(args, result) is not None:
            for one in [result, *result["then"]]:
                report(env, one)


if __name__ == "__main__":
    main()

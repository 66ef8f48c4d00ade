"""Communication cost models: how a ring splits a tensor, bytes each rank sends, bus bandwidth,
and the alpha-beta time model with its fit to measured times.

Pure functions, no process group: the chapters compute predictions with them, the labs use
them for the same split, and the tests check them by hand. CollectiveCounter adds up, with
the same formulas, the collectives a lab really issues.
"""

import math
from fractions import Fraction

from . import precision_model

# Bus bandwidth = algorithm bandwidth x this factor (nccl-tests' definitions): it turns
# bytes/time into the bandwidth each link must carry, comparable across world sizes.
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def chunk_bounds(numel, world_size):
    """[start, end) of each rank's chunk: sizes differ by at most one element.

    The first numel % N chunks get one extra element; when numel < N the last chunks are
    empty. Every rank computes the same split, so no sizes need to be exchanged.
    """
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_allreduce_elements_sent(numel, world_size, rank):
    """Elements rank `rank` sends in a ring all-reduce (reduce-scatter, then all-gather).

    Reduce-scatter step s sends chunk (rank - s) mod N, all-gather step s sends chunk
    (rank + 1 - s) mod N, for s = 0 .. N-2: every chunk twice except chunks rank+1 and rank+2.
    """
    if world_size == 1:
        return 0
    size = [end - start for start, end in chunk_bounds(numel, world_size)]
    n = world_size
    reduce_scatter = sum(size[(rank - s) % n] for s in range(n - 1))
    all_gather = sum(size[(rank + 1 - s) % n] for s in range(n - 1))
    return reduce_scatter + all_gather


def ring_allreduce_bytes_sent(numel, world_size, rank, element_size=4):
    """Bytes rank `rank` sends; 2 (N-1)/N x numel x element_size when N divides numel."""
    return element_size * ring_allreduce_elements_sent(numel, world_size, rank)


def bytes_sent_per_rank(op, bytes_, world_size):
    """Bytes a rank sends in the bandwidth-optimal (ring or pipelined chain) algorithm, as
    the mean over the ranks; for the symmetric collectives every rank sends the same.

    `bytes_` is the size of the full tensor: the input of all-reduce, reduce-scatter, reduce,
    broadcast and all-to-all, the output of all-gather. Divisible sizes assumed. A
    `fractions.Fraction` size gives an exact answer (the FSDP lab counts bytes with it).
    Broadcast and reduce are not symmetric: in a pipelined chain every rank but the last
    forwards S (broadcast: the root sends S, the last rank nothing), every rank but the
    root sends its partial sum (reduce): the mean is (N-1)/N x S; bytes_sent_by_root
    gives the root's own share.
    """
    n = world_size
    per_rank = {
        "broadcast": bytes_ * (n - 1) / n,
        "reduce": bytes_ * (n - 1) / n,
        "all_reduce": bytes_ * 2 * (n - 1) / n,
        "reduce_scatter": bytes_ * (n - 1) / n,
        "all_gather": bytes_ * (n - 1) / n,
        "all_to_all": bytes_ * (n - 1) / n,   # keeps 1/N, sends the rest
        "send": bytes_,                       # point-to-point: the tensor, once
        "recv": 0 * bytes_,
    }
    return per_rank[op]


def bytes_sent_by_root(op, bytes_, world_size):
    """What the root of a pipelined chain sends: broadcast S (the whole tensor, once),
    reduce nothing (it receives the sum). With one rank, nothing."""
    if op not in ("broadcast", "reduce"):
        raise ValueError(f"{op} has no root; every rank sends bytes_sent_per_rank")
    return bytes_ if op == "broadcast" and world_size > 1 else 0 * bytes_


def internode_bytes_per_nic(strategy, bytes_, gpus_per_node, nodes):
    """Bytes each network card sends per training step of `bytes_` of parameters (or
    gradients), on nodes of G GPUs with one card per GPU, as NCCL lays its rings out.

    full_shard    ZeRO-3 over all N = G x M ranks: two all-gathers and a reduce-scatter.
                  A ring through all ranks leaves each node once per channel, and NCCL
                  runs one channel per card, so each card carries 1/G of a ring's
                  traffic: 3 (N-1)/N x bytes / G.
    hybrid_shard  ZeRO-3 inside each node (on NVLink), replicas across nodes: each GPU
                  all-reduces its 1/G share of the gradients with the same local rank of
                  the other nodes: 2 (M-1)/M x bytes / G.
    ddp           NCCL's flat ring all-reduce through all N ranks (tuning.cc prices no
                  hierarchical one), one channel per card: 2 (N-1)/N x bytes / G.
    """
    g, m = gpus_per_node, nodes
    n = g * m
    if strategy == "full_shard":
        return 3 * (n - 1) / n * bytes_ / g
    if strategy == "ddp":
        return 2 * (n - 1) / n * bytes_ / g
    if strategy == "hybrid_shard":
        return 2 * (m - 1) / m * bytes_ / g
    raise ValueError(f"unknown strategy {strategy!r}; choose full_shard, hybrid_shard or ddp")


# The collectives one data-parallel training step issues over the whole parameter set:
# DDP all-reduces the gradients once. The ZeRO paper's stages 1 and 2 reduce-scatter the
# gradients and all-gather the updated parameters: DDP's volume. torch's
# ZeroRedundancyOptimizer (its ZeRO-1) keeps DDP's all-reduce and then broadcasts each
# rank's updated partition: 1.5 times. ZeRO-3 gathers the parameters for forward and again
# for backward, and reduce-scatters the gradients: 1.5 times.
DATA_PARALLEL_COLLECTIVES = {
    "ddp": ("all_reduce",),
    "zero1": ("reduce_scatter", "all_gather"),
    "zero2": ("reduce_scatter", "all_gather"),
    "zero1_torch": ("all_reduce", "broadcast"),
    "zero3": ("all_gather", "all_gather", "reduce_scatter"),
}


def data_parallel_bytes_per_rank(strategy, numel, world_size, value_bytes=4, precision=None,
                                 fp8_numel=0):
    """Bytes a rank sends in one training step of `numel` parameters, exactly (a Fraction),
    mean over ranks: DDP and the paper's ZeRO-1/2 2(N-1)/N x numel x b; ZeRO-3 and torch's
    ZeroRedundancyOptimizer 3(N-1)/N x numel x b. For ZeRO-3 numel is the padded count its
    equal shards need (memory_model.padded_numel).

    With `precision` (a recipe of precision_model.RECIPES) each collective carries what the
    recipe sends instead of `value_bytes`: all-gathers the parameters in its gather format
    (`fp8_numel` of them in FP8 where it gathers FP8 weights), reductions the gradients in
    its reduce format."""
    if precision is None:
        sizes = {"all_gather": Fraction(numel * value_bytes)}
        sizes["reduce_scatter"] = sizes["all_reduce"] = sizes["broadcast"] = sizes["all_gather"]
    else:
        reduce = Fraction(numel * precision_model.get_recipe(precision).reduce)
        sizes = {"all_gather": Fraction(precision_model.gathered_bytes(precision, numel,
                                                                       fp8_numel)),
                 "reduce_scatter": reduce, "all_reduce": reduce}
        sizes["broadcast"] = sizes["all_gather"]   # parameters, as an all-gather sends them
    return sum(bytes_sent_per_rank(op, sizes[op], world_size)
               for op in DATA_PARALLEL_COLLECTIVES[strategy])


def data_parallel_step_collectives(strategy, numel, microbatches=1, units=1):
    """[(op, elements)] of one training step's data-parallel collectives over `numel`
    parameters with m micro-batches (gradient accumulation) per step:

      ddp    one all-reduce of the accumulated gradients (no_sync before the last)
      zero1  a reduce-scatter of them and an all-gather of the updated parameters
      zero2  gradients are kept sharded, so each micro-batch's are reduce-scattered as
             they come: m reduce-scatters, then the all-gather
      zero3  parameters are gathered one unit (layer) at a time, before its forward and
             again before its backward, and its gradients reduce-scattered after, for every
             micro-batch: 2 m all-gathers and m reduce-scatters of each of `units` units
    At m = 1 the bytes are data_parallel_bytes_per_rank's; what m adds is the traffic of
    sharded gradients and parameters under accumulation."""
    m = microbatches
    if strategy == "ddp":
        return [("all_reduce", numel)]
    if strategy == "zero1":
        return [("reduce_scatter", numel), ("all_gather", numel)]
    if strategy == "zero2":
        return [("reduce_scatter", numel)] * m + [("all_gather", numel)]
    if strategy == "zero3":
        unit = numel / units
        return ([("all_gather", unit)] * 2 + [("reduce_scatter", unit)]) * (m * units)
    raise ValueError(f"unknown strategy {strategy!r}")


def tensor_parallel_collectives(layers, seq, batch, hidden, tp, sequence_parallel=False,
                                f_backward=True, embedding=True, head=True, microbatches=1,
                                recompute=False):
    """[(op, elements of the full tensor)] one training step (forward, backward and the
    optimizer's step) of the course's transformer issues when it is split tp ways as in
    Megatron-LM, its vocabulary included, with `batch` sequences per micro-batch.

    Per layer, with activations of s*b*h elements:
      tensor parallel    forward: g after the attention's and after the MLP's row-parallel
                         linear, an all-reduce each; backward: f before their column-parallel
                         linears, an all-reduce each (f_backward=False leaves them out: a bug)
      sequence parallel  g becomes a reduce-scatter and f an all-gather, and their backward
                         the other way round; the column-parallel linears keep only their
                         1/t of the input and gather it again in backward for the weight's
                         gradient: one all-gather more each. The replicated parameters that
                         now see 1/t of the tokens (LayerNorms, the row-parallel biases, the
                         positions) have their gradients all-reduced, in one buffer per step.
    Outside the layers: the vocab-parallel embedding reduces its output like g (all-reduce,
    or reduce-scatter); the head, a column-parallel linear over the vocabulary, has an f
    before it (an all-gather, gathered again in backward, with sequence parallelism); the
    vocab-parallel cross-entropy all-reduces the logits' maximum, the sum of their
    exponentials and the target's logit, s*b elements each.
    A pipeline stage holds some of the layers, and the embedding only on the first stage
    (embedding=False elsewhere), the head and the loss only on the last (head=False).
    With m micro-batches (gradient accumulation, or a pipeline's) all of it happens once per
    micro-batch but the replicated gradients' all-reduce, once per step. Full activation
    checkpointing (recompute=True) runs each layer's forward again before its backward, and
    with it the layer's forward collectives: 2 all-reduces, or 2 all-gathers and 2
    reduce-scatters, more per layer.
    """
    sbh, sb = seq * batch * hidden, seq * batch
    replicated = []
    if not sequence_parallel:
        forward = [("all_reduce", sbh)] * 2
        per_layer = forward + [("all_reduce", sbh)] * (2 if f_backward else 0)
        outside = [("all_reduce", sbh)] * (embedding + (head and f_backward))
    else:
        forward = [("all_gather", sbh), ("reduce_scatter", sbh)] * 2     # f and g, forward
        per_layer = forward + [("reduce_scatter", sbh), ("all_gather", sbh)] * 2  # backward
        per_layer += [("all_gather", sbh)] * 2                           # inputs again
        outside = [("reduce_scatter", sbh), ("all_gather", sbh)] * embedding
        outside += [("all_gather", sbh), ("reduce_scatter", sbh), ("all_gather", sbh)] * head
        numel = layers * 6 * hidden + seq * hidden * embedding + 2 * hidden * head
        replicated = [("all_reduce", numel)] if numel else []
    per_layer += forward if recompute else []
    micro_batch = per_layer * layers + outside + [("all_reduce", sb)] * (3 * head)
    return micro_batch * microbatches + replicated


def torch_tensor_parallel_collectives(layers, seq, batch, hidden, tp, sequence_parallel=False):
    """[(op, elements)] one training step issues under torch's tensor parallelism (DTensor,
    strategies.apply_tp): the blocks split as in Megatron-LM, embedding and head replicated.

    tensor parallel    per layer, 2 all-reduces forward (row-parallel outputs) and 2
                       backward (gradients of the column-parallel inputs), of s*b*h each
    sequence parallel  per layer 4 all-gathers and 4 reduce-scatters of s*b*h, forward and
                       backward; the gathered inputs are kept, not gathered again. The
                       LayerNorms' gradients are partial sums, each reduced (4 all-reduces
                       of h per layer) when the optimizer steps. Outside: the first block's
                       input is split (its gradient gathered) and the head's gathered.
    On a mesh of one rank DTensor issues nothing.
    """
    if tp == 1:
        return []
    sbh = seq * batch * hidden
    if not sequence_parallel:
        return [("all_reduce", sbh)] * (4 * layers)
    per_layer = [("all_gather", sbh), ("reduce_scatter", sbh)] * 4 + [("all_reduce", hidden)] * 4
    return per_layer * layers + [("all_gather", sbh)] * 2


def collectives_summary(plan, world_size, value_bytes=4):
    """(bytes a rank sends, exactly, as a Fraction; {op: count}) for [(op, elements)]."""
    sent, counts = Fraction(0), {}
    for op, numel in plan:
        sent += bytes_sent_per_rank(op, Fraction(numel * value_bytes), world_size)
        counts[op] = counts.get(op, 0) + 1
    return sent, counts


class CollectiveCounter:
    """The collectives this rank issued, counted as they are issued: how many of each op,
    and the bytes it sent in them under the ring algorithms (exactly, as a Fraction)."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.reset()

    def reset(self):
        self.sent, self.counts = Fraction(0), {}

    def add(self, op, tensor):
        """Count one `op` on `tensor` (the full tensor: see bytes_sent_per_rank)."""
        self.add_bytes(op, tensor.numel() * tensor.element_size())

    def add_bytes(self, op, nbytes):
        """Count one `op` on a full tensor of `nbytes` bytes."""
        self.sent += bytes_sent_per_rank(op, Fraction(nbytes), self.world_size)
        self.counts[op] = self.counts.get(op, 0) + 1

    def add_sent(self, op, sent_bytes):
        """Count one `op` in which this rank sent exactly `sent_bytes` (an all-to-all with
        uneven splits, whose bytes no full-tensor formula gives)."""
        self.sent += Fraction(sent_bytes)
        self.counts[op] = self.counts.get(op, 0) + 1


def bus_bandwidth(op, bytes_, seconds, world_size):
    """nccl-tests' busbw in bytes/s: algbw (bytes / seconds) times the op's factor."""
    return bytes_ / seconds * BUSBW_FACTORS[op](world_size)


def allreduce_time(bytes_, world_size, alpha_s, beta_bytes_per_s):
    """Alpha-beta model of a ring all-reduce: 2(N-1) latencies + 2(N-1)/N * S / beta."""
    n = world_size
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * bytes_ / beta_bytes_per_s


def tree_allreduce_time(bytes_, world_size, alpha_s, beta_bytes_per_s):
    """A pipelined double binary tree (Sanders et al. 2009; NCCL's tree between nodes): two
    trees each reduce half of the data up and broadcast it down, a rank inner in one and a
    leaf in the other, so each rank receives and sends 2S: 2 ceil(log2 N) latencies + 2 S / beta.
    (A single binary tree would push 3S through an inner rank.)

    Fewer latency terms than the ring (log N instead of N), but 2S through every rank
    whatever N is, against 2(N-1)/N S for the ring. time_model.nccl_tree_allreduce_time is
    the tree as NCCL builds it over nodes of several GPUs.
    """
    n = world_size
    return 2 * math.ceil(math.log2(n)) * alpha_s + 2 * bytes_ / beta_bytes_per_s


def ring_tree_crossover_bytes(world_size, alpha_s, beta_bytes_per_s):
    """Message size above which the ring beats the tree, from the two models above.

    Equal when 2(N-1) a + 2(N-1)/N S/b = 2 ceil(log2 N) a + 2 S/b, i.e.
    S* = N b a ((N-1) - ceil(log2 N)).
    """
    n = world_size
    return n * beta_bytes_per_s * alpha_s * ((n - 1) - math.ceil(math.log2(n)))


def fit_alpha_beta(sizes_bytes, times_s, world_size):
    """Least-squares fit of `allreduce_time` to measured times; returns (alpha_s, beta_bytes_per_s).

    The fit is on relative error (each point weighted by 1/time), so that small, latency-bound
    messages count as much as large ones. alpha is kept >= 0.
    """
    n = world_size
    if n < 2:
        raise ValueError("the alpha-beta model needs at least 2 ranks")
    if len(sizes_bytes) < 2:
        raise ValueError("fitting alpha and beta needs at least two message sizes")
    # T = a + b x with x = 2(N-1)/N * S, a = 2(N-1) alpha, b = 1/beta; weighted by 1/T.
    xs = [2 * (n - 1) / n * s for s in sizes_bytes]
    ws = [1.0 / t for t in times_s]
    sw = sum(w * w for w in ws)
    swx = sum(w * w * x for w, x in zip(ws, xs))
    swy = sum(w * w * t for w, t in zip(ws, times_s))
    swxx = sum(w * w * x * x for w, x in zip(ws, xs))
    swxy = sum(w * w * x * t for w, x, t in zip(ws, xs, times_s))
    det = sw * swxx - swx * swx
    b = (sw * swxy - swx * swy) / det
    a = (swy - b * swx) / sw
    if a < 0:  # no measurable latency: fit the slope alone through the origin
        a, b = 0.0, swxy / swxx
    if b <= 0:
        # Noise larger than the size effect: these times say nothing about bandwidth.
        raise ValueError("the times do not grow with the message size: no bandwidth to fit "
                         "(sweep a wider range of sizes, or more repeats)")
    return a / (2 * (n - 1)), 1.0 / b


def parse_size(text):
    """'4K' -> 4096, '1M' -> 1048576, '2G' -> 2 GiB, '100' -> 100 (bytes). ValueError if bad."""
    units = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    text = text.strip()
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if unit not in units or not number.isdigit():
        raise ValueError(f"bad size {text!r}: use a whole number with an optional K, M or G suffix")
    return int(number) * units[unit]


def pipeline_piece_owner(piece, stages, layout="interleaved"):
    """The rank that holds model piece `piece` of a pipeline over `stages` ranks: piece g on
    rank g mod p when the pieces are dealt in turn ("interleaved", Narayanan et al.'s
    chunks, one piece each when there are p), or down and back up a V of 2p pieces ("v":
    ZB-V's and DualPipeV's, rank r holding pieces r and 2p-1-r)."""
    p = stages
    if layout == "interleaved":
        return piece % p
    if layout == "v":
        return piece if piece < p else 2 * p - 1 - piece
    raise ValueError(f"unknown layout {layout!r}")


def pipeline_p2p_bytes_per_rank(stages, microbatches, activation_numel, chunks=1,
                                value_bytes=4, layout="interleaved"):
    """[bytes each pipeline rank sends in one step]: each piece sends its output forward to
    the next piece and its input's gradient back to the previous one, `activation_numel`
    values (b/m x s x h per micro-batch) each way per micro-batch, unless that piece is on
    the same rank (the tip of a V: nothing crosses there). p v pieces, placed by `layout`
    (pipeline_piece_owner; "v" takes two chunks); every piece but the last sends forward,
    every piece but the first sends back."""
    p, v = stages, chunks
    if layout == "v" and v != 2:
        raise ValueError(f"a V holds two pieces per rank, not {v}")
    owner = [pipeline_piece_owner(g, p, layout) for g in range(p * v)]
    per_rank = []
    for rank in range(p):
        pieces = [g for g in range(p * v) if owner[g] == rank]
        sends = (sum(g < p * v - 1 and owner[g + 1] != rank for g in pieces)
                 + sum(g > 0 and owner[g - 1] != rank for g in pieces))
        per_rank.append(sends * microbatches * activation_numel * value_bytes)
    return per_rank


def layer_boundaries_crossed(layers, devices, placement):
    """How many times one forward pass's activations move between devices when `layers`
    layers run on `devices` devices: contiguous stages cross p-1 boundaries; placing layer l
    on device l mod D, as some tutorials do, crosses one between every pair of layers."""
    if devices == 1:
        return 0
    if placement == "contiguous":
        return min(devices, layers) - 1
    if placement == "round_robin":
        return layers - 1
    raise ValueError(f"unknown placement {placement!r}")


# Tensor parallelism, one transformer layer at a time: what a rank sends, and how that
# compares with the layer's compute (the rule for when a larger t stops paying).

def tensor_parallel_layer_values(seq, batch, hidden, tp, sequence_parallel=False,
                                 regather_inputs=True, recompute=False):
    """Values one rank sends for one transformer layer and one micro-batch, forward and
    backward, under Megatron-LM's split with ring algorithms (activations of s*b*h values).
    Exactly, as a Fraction; multiply by the bytes of a value (2 at 16 bits) for bytes.

      tensor parallel    4 all-reduces (g twice in forward, f twice in backward):
                         8 (t-1)/t sbh
      sequence parallel  4 all-gathers and 4 reduce-scatters, the same 8 (t-1)/t sbh; with
                         regather_inputs (Megatron-LM keeps only its 1/t of each
                         column-parallel linear's input and gathers it again in backward)
                         2 all-gathers more: 10 (t-1)/t sbh, 25 % more
      recompute=True     full activation recomputation runs the forward again before the
                         backward, its two g (and, sequence-parallel, its two f) with it:
                         4 (t-1)/t sbh more, six all-reduces instead of four
    The same per-layer count as tensor_parallel_collectives."""
    units = 8 + (2 if sequence_parallel and regather_inputs else 0) + (4 if recompute else 0)
    return Fraction(units * (tp - 1), tp) * seq * batch * hidden


def layer_matmul_coefficient(hidden, heads, kv_heads=None, ffn_hidden=None, gated=False):
    """c in the forward FLOPs c b s h^2 of one layer's weight multiplications (2 FLOPs per
    weight per token): Q and the output projection 2 h^2 each, K and V 2 h^2 kv_heads/heads
    each, the MLP 2 x (2 or, gated as SwiGLU, 3) x h x ffn_hidden. The defaults, multi-head
    attention and a 4h GeLU MLP, give Narayanan et al.'s 24; Llama 3 70B (64 heads, 8
    key-value heads, a SwiGLU MLP of 28,672) gives 25.5."""
    kv_heads = heads if kv_heads is None else kv_heads
    ffn_hidden = 4 * hidden if ffn_hidden is None else ffn_hidden
    attention = 2 * (2 + 2 * Fraction(kv_heads, heads))
    mlp = 2 * (3 if gated else 2) * Fraction(ffn_hidden, hidden)
    return attention + mlp


def tensor_parallel_comm_to_compute(tp, hidden, flops_per_s, bytes_per_s, value_bytes=2,
                                    matmul_coefficient=24):
    """Seconds of communication over seconds of compute for one layer under t-way tensor
    parallelism, bandwidth terms only, nothing overlapped:

        comm    = 8 (t-1)/t b s h values x value_bytes / beta
        compute = 72 b s h^2 / t / R   (forward 24 b s h^2 in the weight multiplications,
                                        backward twice that; attention's 4 b s^2 h left out)
        ratio   = value_bytes (t-1) R / (9 h beta) = (2/9) (t-1) R / (h beta) at 16 bits

    R is the rate the GPU reaches (peak x utilization), beta the bandwidth each rank sends
    at. b and s cancel: the ratio depends on t, h and the machine only. It grows linearly
    with t and falls as 1/h; latency (alpha) and attention's FLOPs, left out, push it up
    and down respectively. Another layer shape (layer_matmul_coefficient c instead of 24)
    scales the compute, and the ratio by 24/c: the communication, at the layer's
    boundaries where the activations have h values per token, does not change."""
    return (value_bytes * 8 * (tp - 1) * flops_per_s
            / (3 * matmul_coefficient * hidden * bytes_per_s))


def tensor_parallel_break_even_tp(hidden, flops_per_s, bytes_per_s, value_bytes=2):
    """The t at which tensor_parallel_comm_to_compute reaches 1 (communication as long as
    compute): 1 + 9 h beta / (value_bytes R). Past it, doubling t saves less compute than
    it adds communication, unless the communication is hidden."""
    return 1 + 9 * hidden * bytes_per_s / (value_bytes * flops_per_s)


def data_parallel_min_tokens(flops_per_s, bytes_per_s, value_bytes=2):
    """Tokens a data-parallel replica must handle per step for its backward's matrix
    products to outlast its gradients' all-reduce (Austin et al., 2025, "How to Scale Your
    Model", the training chapter's B/X > C/W): backward costs 4 FLOPs per parameter and
    token at `flops_per_s`, the ring all-reduce sends 2 x value_bytes per parameter at
    `bytes_per_s` each way (NCCL's bus bandwidth), so T > value_bytes R / (2 beta). FSDP's
    gathers and reduce-scatters move the same bytes and give the same bound. Austin et
    al. count a bidirectional link's two directions as one bandwidth W, which halves it."""
    return value_bytes * flops_per_s / (2 * bytes_per_s)


def tensor_parallel_max_degree(ffn_hidden, flops_per_s, bytes_per_s, value_bytes=2):
    """The tensor-parallel degree below which an MLP's two matrix products outlast the
    all-gather and reduce-scatter around them (Austin et al., 2025, "How to Scale Your
    Model": Y < F W / C): forward, 4 b s h F / t FLOPs at `flops_per_s` against two ring
    collectives of b s h values, (t-1)/t x value_bytes x b s h bytes each at `bytes_per_s`
    each way, so t < 2 F beta / (value_bytes R) for large t. Austin et al. count a
    bidirectional link's two directions as one bandwidth W, which doubles the bound."""
    return 2 * ffn_hidden * bytes_per_s / (value_bytes * flops_per_s)


# Context parallelism: each rank holds s/N of every sequence's tokens and all the weights.

CP_METHODS = ("ring", "allgather", "ulysses")


def context_parallel_layer_values(method, seq, batch, hidden, cp, kv_hidden=None):
    """Values one rank sends for one layer's attention, forward and backward, exactly (a
    Fraction). h_kv = kv_hidden (key-value heads x head size; h without grouped-query
    attention).
      ring       N-1 steps pass this rank's K and V block (2 b s/N h_kv) on, forward, and
                 their gradients back, backward: 4 (N-1)/N b s h_kv
      allgather  all-gather K and V (2 b s h_kv), reduce-scatter their gradients back:
                 the same 4 (N-1)/N b s h_kv, in two collectives instead of 2 (N-1) sends
      ulysses    all-to-all of Q, K and V to whole heads and of the output back, forward and
                 backward, each rank keeping 1/N: 2 (N-1)/N^2 b s (2 h + 2 h_kv), with the
                 key-value heads split N ways (ulysses_layer_values copies them when fewer)
    The ring is the lab's (context_parallel_attention.ring_attention): autograd keeps every
    block it receives; ring_attention_layer_bytes gives Liu et al.'s and torch's."""
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    if method in ("ring", "allgather"):
        return Fraction(4 * (cp - 1), cp) * batch * seq * kv_hidden
    if method == "ulysses":
        return ulysses_layer_values(seq, batch, hidden, cp, kv_hidden)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(CP_METHODS)}")


def ulysses_layer_values(seq, batch, hidden, cp, kv_hidden=None, kv_heads=None):
    """Values one rank sends for one layer's attention under Ulysses (Jacobs et al. 2023),
    forward and backward: 2 (N-1)/N^2 b s (2 h + 2 h_kv'), where each all-to-all sends
    (N-1)/N of the rank's s/N tokens' Q, K and V (h + 2 h_kv' values a token) on the way
    in and of the output (h) on the way out. With `kv_heads` key-value heads of the h_kv
    width: N dividing them, each rank gets kv_heads/N whole heads and h_kv' = h_kv; fewer
    heads than N (dividing N), each is copied N/kv_heads times before the all-to-all, so
    that every rank receives the one its query heads use: h_kv' = h_kv N / kv_heads.
    kv_heads=None: split N ways, never copied."""
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    if kv_heads is not None and kv_heads < cp:
        if cp % kv_heads:
            raise ValueError(f"{kv_heads} key-value heads can be neither split nor copied "
                             f"evenly over {cp} ranks")
        kv_hidden = Fraction(kv_hidden * cp, kv_heads)
    elif kv_heads is not None and kv_heads % cp:
        raise ValueError(f"{kv_heads} key-value heads do not split over {cp} ranks")
    return Fraction(2 * (cp - 1), cp * cp) * batch * seq * (2 * hidden + 2 * kv_hidden)


RING_IMPLEMENTATIONS = ("lab", "liu", "torch")


def ring_attention_layer_bytes(implementation, seq, batch, cp, kv_hidden, value_bytes=2):
    """Bytes one rank sends for one layer's ring attention, forward and backward, exactly
    (a Fraction), as each implementation's source does it. A hop passes one rank's block on:
    K and V, or their gradients, 2 b (s/N) h_kv values.
      lab    labkit.parallel.context_parallel_attention.ring_attention: N-1 hops of K and V
             forward; autograd keeps every block received, and backward (RingPass.backward)
             sends the summed gradients of K and V back N-1 hops, all `value_bytes` wide:
             4 (N-1)/N b s h_kv values (context_parallel_layer_values' ring)
      liu    Liu et al.'s ringattention/ringattention_jax.py: _ring_attention_fwd permutes
             k and v at each of its N steps (the last brings them home), _ring_attention_bwd
             k, v, dk and dv at each of N: 6 b s h_kv values, `value_bytes` wide (its
             float32_logits=True casts k, and so dk and dv, to fp32: more; not modelled)
      torch  torch's _templated_ring_attention: N-1 blocks of K and V forward (one
             all-gather by default, or N-1 rotations); _templated_ring_attention_backward
             keeps only its own K and V, fetches them again (N-1 blocks) and passes the
             gradients of K and V N hops in fp32 (convert_to_f32, default True):
             4 (N-1)/N b s h_kv values `value_bytes` wide and 2 b s h_kv of 4 bytes
    One rank (N = 1) sends nothing."""
    if implementation not in RING_IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from "
                         f"{', '.join(RING_IMPLEMENTATIONS)}")
    if cp == 1:
        return Fraction(0)
    block = 2 * Fraction(seq, cp) * batch * kv_hidden          # K and V of one rank
    if implementation == "lab":
        return 2 * (cp - 1) * block * value_bytes
    if implementation == "liu":
        return (cp + 2 * cp) * block * value_bytes
    return 2 * (cp - 1) * block * value_bytes + cp * block * 4


def hybrid_context_parallel_layer_values(seq, batch, hidden, ulysses, ring, kv_hidden=None,
                                         kv_heads=None):
    """{"ulysses": values, "ring": values} one rank sends for one layer's attention under
    a ring of Ulysses groups (USP, Fang and Zhao 2024; Megatron-Core's cp_comm_type
    "a2a+p2p"): N = ulysses x ring ranks, each with s/N tokens. An all-to-all over the
    `ulysses` ranks of a group, which hold s/ring tokens, gives each all s/ring tokens of
    1/ulysses of the heads (ulysses_layer_values on s/ring tokens, key-value heads copied
    when fewer than `ulysses`); the ring then passes K and V blocks of s/ring tokens and
    h_kv'/ulysses width over the `ring` groups, as the lab's ring does:
    4 (ring-1)/ring b s h_kv'/ulysses. ulysses = 1 is the ring, ring = 1 Ulysses. USP's own
    ring (yunchang/ring/ring_flash_attn.py, ring_flash_attn_backward) sends what torch's
    does: ring_attention_layer_bytes("torch", seq, batch, ring, h_kv'/ulysses)."""
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    a2a = ulysses_layer_values(Fraction(seq, ring), batch, hidden, ulysses, kv_hidden, kv_heads)
    if kv_heads is not None and kv_heads < ulysses:
        kv_hidden = Fraction(kv_hidden * ulysses, kv_heads)
    passed = context_parallel_layer_values("ring", seq, batch, hidden, ring,
                                           Fraction(kv_hidden, ulysses))
    return {"ulysses": a2a, "ring": passed}


def context_parallel_collectives(method, layers, seq, batch, hidden, cp, params):
    """[(op, elements of the full tensor)] one training step of the course's transformer
    issues under context parallelism of degree cp (context_parallel_layer_values, per
    layer), and the one all-reduce of the `params` gradients that every rank then sums
    (each saw s/N of the tokens). The ring's sends and receives are point-to-point ops of
    one rank's K and V (its receives send nothing); all-to-alls count each rank's input."""
    sbh = seq * batch * hidden
    if method == "ring":
        per_layer = [("send", 2 * sbh // cp), ("recv", 2 * sbh // cp)] * (2 * (cp - 1))
    elif method == "allgather":
        per_layer = [("all_gather", 2 * sbh), ("reduce_scatter", 2 * sbh)]
    elif method == "ulysses":
        per_layer = [("all_to_all", 3 * sbh // cp), ("all_to_all", sbh // cp)] * 2
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(CP_METHODS)}")
    return per_layer * layers + [("all_reduce", params)]


# Mixture of experts: what expert parallelism sends (Shazeer et al. 2017; GShard; Switch).

def expert_capacity(tokens, experts, top_k, capacity_factor):
    """Slots per expert when `tokens` tokens each choose top_k of `experts` experts:
    ceil(capacity_factor x k x T / E) (GShard's and Switch's expert capacity)."""
    exact = Fraction(str(capacity_factor)) * top_k * tokens / experts
    return math.ceil(exact)


def alltoall_dispatch_bytes(sent, hidden, value_bytes=4, counts_bytes=0):
    """Bytes each rank sends in one MoE layer's forward and backward under the all-to-all
    dispatcher, from the routing: sent[i][j] tokens (kept slots) rank i sends to rank j.

    Forward, rank i sends sum_{j != i} sent[i][j] rows of h values (dispatch) and returns
    sum_{j != i} sent[j][i] (combine); backward sends the gradients of the same rows the
    other way: 2 x (sent out + received) x h x bytes. `counts_bytes`: the split sizes each
    rank sends first (its counts per expert, an all-to-all of its own).
    """
    n = len(sent)
    result = []
    for i in range(n):
        out = sum(sent[i][j] for j in range(n) if j != i)
        into = sum(sent[j][i] for j in range(n) if j != i)
        result.append(2 * (out + into) * hidden * value_bytes + counts_bytes)
    return result


def alltoall_uniform_bytes(tokens, hidden, top_k, world_size, value_bytes=4):
    """One all-to-all (one direction) under uniform routing with nothing dropped: each of a
    rank's k T slots stays home with probability 1/N: k (N-1)/N T h bytes."""
    return Fraction(top_k * (world_size - 1), world_size) * tokens * hidden * value_bytes


def allgather_dispatch_bytes(tokens, hidden, top_k, world_size, value_bytes=4,
                             index_bytes=8):
    """Bytes each rank sends in one MoE layer's forward and backward under the lab's
    all-gather dispatcher (labkit/parallel/expert_dispatch.py, AllGatherExperts), whatever
    the routing: forward, all-gather the T x h tokens, the T x k gates and expert ids, and
    reduce-scatter the N T x h outputs; backward, reduce-scatter the tokens' and gates'
    gradients and all-gather the outputs'. Megatron-Core's MoEAllGatherTokenDispatcher
    has the same hidden-state traffic but gathers, over TP x EP, dense T x E
    probabilities and a T x E boolean routing map in place of the k gates and ids."""
    n = world_size
    gather = Fraction(n - 1, n) * n * tokens      # bytes_sent_per_rank of the gathered whole
    hidden_rows = 4 * gather * hidden * value_bytes
    gates = 2 * gather * top_k * value_bytes
    return hidden_rows + gates + gather * top_k * index_bytes


def expected_nodes_reached(experts, nodes, top_k, node_limit=None):
    """Nodes a token's top_k experts sit on, in expectation, when its experts are any k of
    E (uniform routing) spread evenly over `nodes` nodes: each node is missed with
    probability C(E - E/nodes, k) / C(E, k). With node-limited routing (DeepSeek-V3 §2.1.2)
    a token reaches at most `node_limit` of them."""
    per_node = experts // nodes
    missed = Fraction(math.comb(experts - per_node, top_k), math.comb(experts, top_k))
    reached = nodes * (1 - missed)
    return reached if node_limit is None else min(reached, node_limit)


def expected_network_copies(experts, nodes, top_k, node_limit=None, once_per_node=True):
    """Copies of one token a rank sends over the network in one dispatch, in expectation
    under uniform routing over E experts spread evenly over `nodes` nodes, the token's own
    node one of them like any other:

      once_per_node=False  one copy per (token, expert) pair whose expert sits on another
                           node, as an all-to-all of one row per slot sends (the lab's,
                           Megatron-Core's alltoall dispatcher): k (nodes - 1) / nodes
      once_per_node=True   one copy per other node among its experts' nodes, forwarded
                           inside that node over NVLink (DeepSeek-V3 §3.2.2; DeepEP's
                           internode dispatch): expected_nodes_reached x (nodes - 1) /
                           nodes; with node-limited routing at most M (nodes - 1) / nodes
    """
    share_away = Fraction(nodes - 1, nodes)
    if not once_per_node:
        return top_k * share_away
    return expected_nodes_reached(experts, nodes, top_k, node_limit) * share_away


def node_limited_dispatch_bytes(tokens, hidden, top_k, experts, nodes, node_limit=None,
                                value_bytes=2):
    """Bytes one rank sends over the network in one dispatch of its T tokens when each
    token crosses once to each other node its experts sit on (at most node_limit nodes in
    all): T h b x expected_network_copies, under uniform routing."""
    return (tokens * hidden * value_bytes
            * expected_network_copies(experts, nodes, top_k, node_limit))


def node_dispatch_rows(expert_ids, experts, nodes, home_node):
    """Rows one rank sends over the network in one dispatch, counted from its routing:
    each token (a list of its k expert ids in expert_ids) once to each distinct node,
    other than home_node, that holds one of its experts (experts numbered node by node,
    E / nodes on each), as DeepSeek-V3's kernels and DeepEP's internode dispatch send
    it (DeepEP's tests count `rdma_idx = topk_idx // (num_experts // num_nodes)`, made
    unique per token). Node-limited routing makes that at most M - 1 or M per token."""
    per_node = experts // nodes
    return sum(len({e // per_node for e in ids} - {home_node}) for ids in expert_ids)

"""Time cost models: speedup and efficiency, Amdahl's law, DDP's gradient buckets, and the
step time of data-parallel training from its compute time and the alpha-beta model, a
pipeline's schedules (the order of each stage's ops) and its step with handoffs, and the
FLOPs of a transformer layer.

Pure functions, no process group: the scaling chapter computes its predictions with them,
the labs use them for the same numbers, and the tests check them against hand arithmetic.
"""

import math

from . import comm_model

# DDP's bucket caps when bucket_cap_mb is left unset: the first bucket closes at 1 MiB, so
# that the first all-reduce starts early in the backward pass, the rest at 25 MiB. A cap the
# user sets applies to the first bucket too (ddp_bucket_caps).
FIRST_BUCKET_BYTES = 1 << 20
DEFAULT_BUCKET_BYTES = 25 << 20


def speedup(time_1, time_n):
    """How many times faster N workers finish the same work: T(1) / T(N)."""
    return time_1 / time_n


def strong_efficiency(time_1, time_n, world_size):
    """E(N) = T(1) / (N T(N)): the share of the ideal N-fold speedup reached (fixed total work)."""
    return time_1 / (world_size * time_n)


def weak_efficiency(time_1, time_n):
    """E(N) = T(1) / T(N) for work that grows with N (fixed work per worker): 1 is ideal."""
    return time_1 / time_n


def amdahl_speedup(world_size, serial_fraction):
    """Amdahl's law: a share s of the work that does not parallelise caps the speedup at 1/s."""
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / world_size)


def bucket_layout(sizes_bytes, caps_bytes=(FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES),
                  dtypes=None):
    """Group tensors into buckets the way DDP does; returns lists of indices into sizes_bytes.

    Tensors are taken in the order given (DDP passes its parameters last-first, the order
    in which backward produces their gradients). A bucket holds one dtype only (a bucket
    is one flat buffer): each dtype (`dtypes`, one per tensor; all alike if None) fills
    buckets of its own. A bucket closes as soon as it holds at least its cap, so a tensor
    never splits: one larger than the cap closes the bucket it joins, with whatever smaller
    tensors that bucket held before it. A dtype's k-th bucket has cap caps_bytes[k], and
    the last cap repeats. The buckets are listed by the first tensor each holds.

    This is the layout DDP rebuilds after its first iteration (Reducer::rebuild_buckets),
    from the order in which the gradients arrived, unless find_unused_parameters=True and
    static_graph=False: then it never rebuilds (should_rebuild_buckets in reducer.hpp), and
    keeps the layout it built at construction, in reversed registration order. Otherwise
    the first iteration runs with a single bucket, since the order is not known yet
    (torch/nn/parallel/distributed.py, compute_bucket_size_limits).
    """
    dtypes = dtypes or [None] * len(sizes_bytes)
    buckets, open_buckets = [], {}   # dtype -> (indices, bytes filled, buckets closed)
    for index, (size, dtype) in enumerate(zip(sizes_bytes, dtypes)):
        current, filled, closed = open_buckets.get(dtype, ([], 0, 0))
        current, filled = current + [index], filled + size
        if filled >= caps_bytes[min(closed, len(caps_bytes) - 1)]:
            buckets.append(current)
            current, filled, closed = [], 0, closed + 1
        open_buckets[dtype] = (current, filled, closed)
    buckets += [current for current, _, _ in open_buckets.values() if current]
    return sorted(buckets, key=lambda bucket: bucket[0])


def bucket_bytes(sizes_bytes, caps_bytes=(FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES),
                 dtypes=None):
    """Bytes in each of DDP's buckets, in the order they are all-reduced."""
    return [sum(sizes_bytes[i] for i in bucket)
            for bucket in bucket_layout(sizes_bytes, caps_bytes, dtypes)]


def ddp_bucket_caps(bucket_cap_mb=None):
    """The caps DDP buckets with for a given `bucket_cap_mb`: the 1 MiB first bucket exists
    only at the default (None, then 25 MiB); a cap the user sets applies to every bucket,
    the first included (torch/nn/parallel/distributed.py, _BucketCapacityConfig.create)."""
    if bucket_cap_mb is None:
        return (FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES)
    return (int(bucket_cap_mb * (1 << 20)),)


def transformer_param_numels(layers, hidden, vocab, seq, tied_head=False):
    """Elements of each parameter tensor of the course's GPT-style transformer
    (labkit/model/transformer.py), in the order it registers them: the token and position
    embeddings; per block norm1, qkv, proj, norm2, fc1, fc2 (weight, then bias, each); the
    final LayerNorm; the output head unless it is tied to the token embedding. They sum to
    memory_model.transformer_params."""
    h = hidden
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    return [vocab * h, seq * h] + block * layers + [h, h] + ([] if tied_head else [vocab * h])


def ddp_bucket_bytes(numels, element_bytes=4, caps_bytes=None):
    """Bytes of DDP's buckets after its first iteration, in the order they are all-reduced,
    for parameter tensors of `numels` elements given in registration order.

    DDP rebuilds its buckets in the order the gradients became ready in the first backward,
    which for a model that runs its modules in the order it registers them is that order
    reversed. A tied head's weight is the token embedding, registered first: it is ready
    last, once the embedding's backward has added its part, so the last bucket holds it,
    the largest tensor of the model. Every tensor stays whole: a tensor larger than the cap
    closes the bucket it joins, after the smaller tensors already in it. (Within a module
    DDP may see a bias before its weight; it moves a bucket's boundary by a bias at most.)"""
    caps_bytes = caps_bytes or ddp_bucket_caps()
    return bucket_bytes([element_bytes * n for n in reversed(numels)], caps_bytes)


def shard_collective_time(bytes_, world_size, alpha_s, beta_bytes_per_s):
    """Alpha-beta model of a ring all-gather or reduce-scatter of a `bytes_` tensor: half of
    an all-reduce, (N-1) latencies + (N-1)/N * S / beta."""
    n = world_size
    return (n - 1) * alpha_s + (n - 1) / n * bytes_ / beta_bytes_per_s


def nccl_ring_allreduce_time(bytes_, world_size, gpus_per_node, intra, inter):
    """Alpha-beta model of NCCL's ring all-reduce, as its tuning model prices it (NCCL 2.30,
    src/graph/tuning.cc, ncclTopoTuneModel): one flat ring through all N ranks, split over
    channels, with no level of its own for the nodes. Its 2(N-1) steps are those of a
    reduce-scatter and an all-gather (twice hierarchical_shard_collective_time): 2(nodes-1)
    of them cross the network, the others NVLink. Every GPU passes 2(N-1)/N of the data on
    over NVLink, and each node's share of the rings leaves it through its G cards, so the
    bandwidth term is bound by the slower of NVLink and the node's G cards together.

    `intra` and `inter` are (alpha_s, beta_bytes_per_s) of a GPU's NVLink and of one
    network card; one card per GPU."""
    return 2 * hierarchical_shard_collective_time(bytes_, world_size, gpus_per_node, intra,
                                                  inter)


def nccl_tree_allreduce_time(bytes_, world_size, gpus_per_node, intra, inter):
    """Alpha-beta model of NCCL's tree all-reduce (src/graph/connect.cc, connectTrees and
    the chain of ncclTopoPreset; priced in src/graph/tuning.cc): inside each node a chain
    through its G GPUs, over the nodes a double binary tree (two trees, each carrying half
    of the data, a node inner in one and a leaf in the other), pipelined: reduce up, then
    broadcast down. Latency, as NCCL counts it: 2((G-1) alpha_intra + floor(log2 nodes)
    alpha_inter). Bandwidth: a GPU in the middle of the chain receives S going up and S
    coming down, 2S over NVLink, whatever the number of nodes (so inside one node the tree
    is a chain with the ring's 2(G-1) steps and more bytes); each node's cards carry 2S in
    each direction over the double tree, or S with two nodes, where each node is the root of
    one tree and the leaf of the other. NCCL's model is this before its per-channel caps
    and its 0.92 factor."""
    g, n = gpus_per_node, world_size
    if n <= 1:
        return 0.0
    (alpha_intra, beta_intra), (alpha_inter, beta_inter) = intra, inter
    if n <= g:                        # one node: the chain alone
        return 2 * (n - 1) * alpha_intra + 2 * bytes_ / beta_intra
    if n % g:
        raise ValueError(f"{n} GPUs do not fill nodes of {g}")
    nodes = n // g
    latency = 2 * ((g - 1) * alpha_intra + (nodes.bit_length() - 1) * alpha_inter)
    chain = 2 * bytes_ / beta_intra if g > 1 else 0.0
    network = (1 if nodes == 2 else 2) * bytes_ / (g * beta_inter)
    return latency + max(chain, network)


def nccl_allreduce_time(bytes_, world_size, gpus_per_node, intra, inter):
    """The faster of NCCL's ring and tree (nccl_ring_allreduce_time, nccl_tree_allreduce_time):
    NCCL prices each algorithm and protocol it may run and takes the fastest
    (src/enqueue.cc, topoGetAlgoInfo). NVLS and CollNet need switch support and are left
    out; nvls_allreduce_time prices NVLS inside one node from a measured figure."""
    return min(nccl_ring_allreduce_time(bytes_, world_size, gpus_per_node, intra, inter),
               nccl_tree_allreduce_time(bytes_, world_size, gpus_per_node, intra, inter))



def nccl_crossover_bytes(world_size, gpus_per_node, intra, inter):
    """Message size above which NCCL's ring is faster than its tree under the two models
    above, or None if one is faster at every size. Both are a latency plus a size over a
    rate, so they cross at most once."""
    big = 2.0 ** 40   # a slope read over 1 TiB, not 1 byte, keeps the latency's digits

    def line(model):
        at_zero = model(0.0, world_size, gpus_per_node, intra, inter)
        return at_zero, (model(big, world_size, gpus_per_node, intra, inter) - at_zero) / big
    (ring_latency, ring_per_byte), (tree_latency, tree_per_byte) = (
        line(nccl_ring_allreduce_time), line(nccl_tree_allreduce_time))
    if (ring_latency - tree_latency) * (tree_per_byte - ring_per_byte) <= 0:
        return None
    return (ring_latency - tree_latency) / (tree_per_byte - ring_per_byte)


def nvls_allreduce_time(bytes_, world_size, alpha_s, busbw_bytes_per_s):
    """NVLS (NVLink SHARP) all-reduce inside one node, where the NVSwitch adds the GPUs'
    values: a GPU sends and receives about S once instead of the ring's 2(N-1)/N S, so its
    rate is no link's. Priced from a measured bus bandwidth (hardware.NVLS_BUSBW), through
    nccl-tests' normalisation: algbw = busbw N / (2(N-1)). NCCL counts one step of latency
    for it (src/graph/tuning.cc)."""
    n = world_size
    if n <= 1:
        return 0.0
    return alpha_s + 2 * (n - 1) / n * bytes_ / busbw_bytes_per_s


def hierarchical_shard_collective_time(bytes_, world_size, gpus_per_node, intra, inter):
    """Alpha-beta model of an all-gather or reduce-scatter over nodes of `gpus_per_node`
    GPUs, as NCCL's tuning model (src/graph/tuning.cc) prices its ring, the algorithm it
    runs these two with across nodes of several GPUs (no tree; NVLS and CollNet need switch
    support, PAT, since 2.23, one GPU per node). One ring through all N ranks, pipelined:
    N - 1 steps, of which nodes - 1 cross the network and the others NVLink; every GPU
    passes (N - 1)/N of the data on over NVLink, and the G rings, one per network card,
    carry it between nodes, each card (N - 1)/N of 1/G of it, whichever is slower. Its
    latency grows with the ranks, where a tree's would grow with their logarithm."""
    g = gpus_per_node
    if world_size <= g:
        return shard_collective_time(bytes_, world_size, *intra) if world_size > 1 else 0.0
    if world_size % g:
        raise ValueError(f"{world_size} GPUs do not fill nodes of {g}")
    n, nodes = world_size, world_size // g
    (alpha_intra, beta_intra), (alpha_inter, beta_inter) = intra, inter
    latency = (n - nodes) * alpha_intra + (nodes - 1) * alpha_inter
    return latency + (n - 1) / n * bytes_ / min(beta_intra, g * beta_inter)


def delay_s(bytes_, world_size, ns_per_byte, op="all_reduce"):
    """The labs' optional slow link: ns_per_byte for each byte a rank sends in a ring `op`.
    It adds 1 / (ns_per_byte GB/s) to 1 / beta."""
    return comm_model.bytes_sent_per_rank(op, bytes_, world_size) * ns_per_byte * 1e-9


def step_time(forward_s, backward_s, buckets_bytes, buckets_comm_s, overlap=True, optimizer_s=0.0):
    """Seconds of one data-parallel step: compute plus the communication it cannot hide.

    Without overlap the buckets are all-reduced one after another once backward is done:
    T = forward + backward + sum(comm) + optimizer. With overlap, bucket i can start once
    backward has produced its gradients, taken to happen at a steady rate in bytes (bucket
    i is ready at forward + backward * (bytes in buckets 0..i) / (all bytes)), and the
    buckets share one link, so one starts when it is ready and the one before has finished:
        finish_i = max(ready_i, finish_{i-1}) + comm_i
    T = max(forward + backward, finish_last) + optimizer. The last bucket is ready only
    when backward ends, so its all-reduce is never hidden.
    """
    if len(buckets_bytes) != len(buckets_comm_s):
        raise ValueError("one communication time per bucket")
    compute_end = forward_s + backward_s
    if not overlap:
        return compute_end + sum(buckets_comm_s) + optimizer_s
    total = sum(buckets_bytes)
    finish, produced = forward_s, 0
    for size, comm in zip(buckets_bytes, buckets_comm_s):
        produced += size
        ready = forward_s + backward_s * produced / total
        finish = max(ready, finish) + comm
    return max(compute_end, finish) + optimizer_s


def exposed_comm_s(forward_s, backward_s, buckets_bytes, buckets_comm_s, optimizer_s=0.0):
    """The part of communication that overlap cannot hide: step time minus compute."""
    return step_time(forward_s, backward_s, buckets_bytes, buckets_comm_s, True,
                     optimizer_s) - (forward_s + backward_s + optimizer_s)


def optimizer_step_s(params, memory_bytes_per_s, bytes_per_param=28):
    """Seconds of an Adam step over `params` parameters, at the memory's full rate: it
    reads the fp32 parameter, gradient and two moments (16 bytes) and writes the parameter
    and the moments back (12), 28 bytes per parameter, with a few FLOPs per byte, far too
    few to be bound by compute. A lower bound: unfused kernels move the data more often.
    Every DDP rank does all of it; ZeRO-1 gives each of N ranks 1/N of it."""
    return params * bytes_per_param / memory_bytes_per_s


def compute_time_from_flops(params, tokens, peak_flops, utilization):
    """Seconds of forward + backward on `tokens` tokens: about 6 FLOPs per parameter per
    token (2 forward, 4 backward; Kaplan et al.), at `utilization` of the peak rate.
    Returns (forward_s, backward_s)."""
    forward_flops = 2 * params * tokens
    rate = peak_flops * utilization
    return forward_flops / rate, 2 * forward_flops / rate



def layer_forward_flops(seq, batch, hidden):
    """FLOPs of one transformer layer's forward pass (Narayanan et al., 2021): 24 b s h^2
    in its four weight multiplications (QKV 6, the output projection 2, the MLP's two 16)
    and 4 b s^2 h in attention's two (Q K^T, and the weights times V). Backward costs
    twice the forward; tensor parallelism divides both by t."""
    return 24 * batch * seq * hidden ** 2 + 4 * batch * seq ** 2 * hidden


def pipeline_bubble_fraction(stages, microbatches, chunks=1):
    """Fraction of a pipeline step each stage spends idle, when every stage's forward of a
    micro-batch takes the same time and its backward a fixed multiple of it: (p-1)/(v m + p-1).

    With one batch (m = 1, v = 1) this is (p-1)/p: only one stage works at a time. GPipe and
    1F1B both have it (Huang et al., 2019; Narayanan et al., 2021): the first stage's last
    forward starts m-1 forwards after its first and the last stage's first backward can only
    start p-1 forwards after it; the drain mirrors the fill, so each stage waits p-1 forward
    + backward slots in a step of m + p - 1 of them. The interleaved schedule gives each
    rank v chunks of 1/v of its layers, so the fill and drain slots shrink by v: a step of
    v m + p - 1 chunk slots, v m of them busy. That needs m >= p. With fewer micro-batches
    than stages (torch's interleaved schedule allows it) a micro-batch's v p chunks, one
    after the other, set the step instead: v p + m - 1 chunk slots."""
    p, m, v = stages, microbatches, chunks
    slots = max(v * m + p - 1, v * p + m - 1)
    return (slots - v * m) / slots


def schedule_order(schedule, stages, stage, microbatches):
    """[(op, micro-batch)] stage `stage` of `stages` runs in one step.

      gpipe  all m forwards, then all m backwards (Huang et al., 2019)
      1f1b   p-1-s forwards to fill the pipeline, then one forward and one backward in
             turn, then the backwards left (Narayanan et al., 2021): a micro-batch's
             activations are freed p-s slots after they were made, not m
    """
    m = microbatches
    forwards, backwards = [("F", i) for i in range(m)], [("B", i) for i in range(m)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule == "1f1b":
        warmup = min(stages - 1 - stage, m)
        steady = [op for i in range(m - warmup) for op in (forwards[warmup + i], backwards[i])]
        return forwards[:warmup] + steady + backwards[m - warmup:]
    raise ValueError(f"unknown schedule {schedule!r}")


def pipeline_step_time(orders, durations, handoff_s=0.0, before_input=None):
    """Seconds one pipeline step takes, its critical path: each rank runs its ops one after
    the other, in `orders` {rank: [(op, micro-batch, piece)]}, each lasting `durations`
    {rank: [seconds]} (the same layout) once its input is in hand; a forward of a
    micro-batch on piece k > 0 has its input once piece k-1's forward of it has ended and
    the activations have reached this rank, a backward on piece k < last once piece
    k+1's backward of it has ended and the gradient has arrived. Reaching another rank
    takes `handoff_s`, the handoff: the message, and the wake-up of the process waiting for
    it, counted from when both the sender and the receiver have posted their side (gloo
    and NCCL match a send with its receive before moving the data). `before_input` {rank: [seconds]}, if given, is what a rank spends after its
    previous op before it can take the next one's input (posting what the last op made).
    Pieces are numbered along the model (rank r holds pieces r, r + p, ...: one, or v
    chunks when interleaved; r and 2p - 1 - r in a V, zero_bubble_order).

    The ops are F (forward) and B (the whole backward), or, where a schedule splits the
    backward (zero_bubble_order), I (the input's gradient, which the previous piece waits
    for) and W (the weights' gradient, which no other piece waits for; it follows its own
    I on the same rank, so the order alone places it).

    With equal forwards F, backwards B and no handoff, GPipe and 1F1B take
    (m + p - 1)(F + B), the textbook step (pipeline_bubble_fraction); a handoff adds its
    latency on every edge of the critical path between ranks: 2(p - 1) of them in the
    fill and the drain, and more wherever a stage waits on its neighbour in between."""
    ends, at = {}, {rank: 0 for rank in orders}
    clock = {rank: 0.0 for rank in orders}
    last_piece = max(piece for order in orders.values() for _, _, piece in order)
    where = {(op, i, piece): rank for rank, order in orders.items() for op, i, piece in order}
    remaining = sum(len(order) for order in orders.values())
    while remaining:
        progressed = False
        for rank, order in orders.items():
            while at[rank] < len(order):
                op, i, piece = order[at[rank]]
                needs = ((op, i, piece - 1) if op == "F" and piece > 0 else
                         _gradient_from(where, i, piece + 1)
                         if op in ("B", "I") and piece < last_piece else None)
                if needs is not None and needs not in ends:
                    break   # its input is not made yet: another rank goes first
                ready = clock[rank] + (before_input[rank][at[rank]] if before_input else 0.0)
                if needs is not None and where.get(needs) != rank:
                    # a message leaves once both sides have posted (gloo and NCCL both
                    # match a send with its receive first), then takes the handoff
                    ready = max(ready, ends[needs]) + handoff_s
                elif needs is not None:
                    ready = max(ready, ends[needs])
                clock[rank] = ends[(op, i, piece)] = ready + durations[rank][at[rank]]
                at[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the ops' orders wait on each other: the schedule deadlocks")
    return max(clock.values())


def _gradient_from(where, microbatch, piece):
    """The op of `piece` that makes micro-batch `microbatch`'s gradient for the piece before
    it: its whole backward (B), or its input-gradient half (I) where the backward is split."""
    whole = ("B", microbatch, piece)
    return whole if whole in where else ("I", microbatch, piece)


def pipeline_bubble_with_handoff(orders, durations, handoff_s, before_input=None, busy=None):
    """The bubble of one step (idle time over p x step time) when its ops last `durations`
    and each handoff between ranks takes `handoff_s` (pipeline_step_time). `busy`: the
    time the ranks spent in their ops, if `durations` also hold more (the time between
    an op's input and its start). At handoff 0 with equal ops it is the textbook
    (p-1)/(m+p-1), the limit the measured bubble approaches as the ops grow long
    against the handoff."""
    if busy is None:
        busy = sum(sum(times) for times in durations.values())
    step = pipeline_step_time(orders, durations, handoff_s, before_input)
    return 1 - busy / (len(orders) * step)


# Context parallelism: which chunks of the sequence each rank holds, and the attention work
# that leaves each rank under a causal mask.

CP_LAYOUTS = ("contiguous", "zigzag")


def context_parallel_chunks(cp, layout):
    """[chunks of rank r]: the sequence cut into equal chunks, numbered in order.
    contiguous  cp chunks, rank r holds chunk r;
    zigzag      2 cp chunks, rank r holds chunks r and 2 cp - 1 - r (one from the start,
                one from the end), so every rank has as many early as late tokens."""
    if layout == "contiguous":
        return [[r] for r in range(cp)]
    if layout == "zigzag":
        return [[r, 2 * cp - 1 - r] for r in range(cp)]
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(CP_LAYOUTS)}")


def causal_chunk_pairs(cp, layout):
    """[blocks rank r computes]: the (query chunk, key chunk) pairs its queries meet under a
    causal mask, key chunk <= query chunk. A pair with the key chunk after the query chunk
    is all masked and skipped; the diagonal one is half masked and computed whole. A chunk
    q meets q + 1 chunks: contiguous ranks r + 1 blocks, zig-zag ranks 2 cp + 1 each."""
    return [sum(q + 1 for q in chunks) for chunks in context_parallel_chunks(cp, layout)]


def ring_attention_flops_by_rank(seq, batch, hidden, cp, layout):
    """[forward FLOPs of attention's two products on rank r]: each block of c x c tokens
    (c = s / chunks) costs Q K^T and P V, 2 c^2 h FLOPs each per sequence (h = heads x head
    size): 4 b c^2 h per block, times causal_chunk_pairs. Contiguous: rank r does r + 1
    times rank 0's work; zig-zag: every rank the same."""
    chunks = cp if layout == "contiguous" else 2 * cp
    c = seq // chunks
    return [4 * batch * c * c * hidden * pairs for pairs in causal_chunk_pairs(cp, layout)]


def ring_overlap_min_tokens(hidden, kv_hidden, flops_per_s, bytes_per_s, value_bytes=2,
                            causal=False):
    """Tokens per rank (s / N) from which one ring step's transfer (the next block's K and V,
    2 b n h_kv values) takes no longer than its block's forward products: n >= value_bytes
    h_kv R / (2 h beta) when every step computes a whole block (4 b n^2 h FLOPs, no mask:
    Liu et al. 2023's c >= F/B). causal=True: a causal mask in the zig-zag layout leaves
    every step after the first 2 of its 4 chunk pairs (causal_chunk_pairs: 2N + 1 in N
    steps), half a block, 2 b n^2 h FLOPs, so n must be twice as large. Below it the ring
    waits on the link; above it the sends hide behind the computation."""
    work = 0.5 if causal else 1
    return value_bytes * kv_hidden * flops_per_s / (2 * work * hidden * bytes_per_s)


def attention_products_flops(seq, batch, hidden, kv_seq=None, fused=True):
    """{"forward", "backward"}: FLOPs of attention's matrix products for `seq` queries
    against `kv_seq` keys (default the same), no mask, h = heads x head size. Forward,
    Q K^T and P V: 2 products of 2 b s s_kv h. Backward, dV = P^T dO, dP = dO V^T,
    dQ = dS K and dK = dS^T Q: 4 more; a fused (FlashAttention-style) kernel keeps no P and
    recomputes Q K^T first, 5 in all, 2.5 times the forward (the FLOP count of
    flash-attention's benchmarks/benchmark_flash_attention.py). fused=False: P kept, 4."""
    kv_seq = seq if kv_seq is None else kv_seq
    product = 2 * batch * seq * kv_seq * hidden
    return {"forward": 2 * product, "backward": (5 if fused else 4) * product}


def document_causal_pairs_by_rank(doc_lengths, cp, layout):
    """[(query, key) token pairs rank r's queries attend to] when documents of
    `doc_lengths` tokens are packed into one sequence under a document-causal mask (a token
    sees the tokens of its own document up to itself: position - document start + 1 keys).
      zigzag        the whole sequence cut into 2N chunks, rank r holding r and 2N-1-r
                    (context_parallel_chunks): balanced for one document, not for several
      per_document  every document cut into 2N chunks, rank r holding chunks r and 2N-1-r
                    of each: balanced again. Megatron-Core's
                    _get_batch_on_this_cp_rank_per_document_balancing (megatron/core/
                    utils.py), through Transformer Engine's thd_get_partitioned_indices
      torch_per_document  what torch's _PerDocumentHeadTailLoadBalancer does (torch/
                    distributed/tensor/experimental/_context_parallel/_load_balancer.py):
                    _generate_indices_for_batch lays out, document after document, chunks
                    0, 2N-1, 1, 2N-2, ..., N-1, N of each (its loop over ranks sits inside
                    the loop over documents), and _context_parallel_buffers then cuts that
                    order into N contiguous pieces, rank r taking piece r. One document, or
                    equal ones, come out balanced; unequal ones in general not: documents
                    [4, 8, 4] at N = 2 give rank 0 positions [0, 3, 1, 2, 4, 5, 10, 11]
                    (all of the first, two chunks of the second), and [4, 4, 8] give it
                    both 4s, 20 pairs against rank 1's 36. (Its docstring describes
                    per-document balancing; its code does not do it.)
    The count is what a kernel that skips every masked pair does, a lower bound on work."""
    starts = [sum(doc_lengths[:i]) for i in range(len(doc_lengths))]
    ends = [s + length for s, length in zip(starts, doc_lengths)]

    def keys(lo, hi):   # keys the queries at positions lo .. hi-1 see, document by document
        total = 0
        for start, end in zip(starts, ends):
            a, b = max(lo, start), min(hi, end)
            if a < b:   # positions a..b-1 of a document see a-start+1 .. b-start keys
                total += (b - start) * (b - start + 1) // 2 - (a - start) * (a - start + 1) // 2
        return total

    zigzag = context_parallel_chunks(cp, "zigzag")
    if layout == "zigzag":
        if sum(doc_lengths) % (2 * cp):
            raise ValueError(f"{sum(doc_lengths)} tokens do not split into {2 * cp} chunks")
        c = sum(doc_lengths) // (2 * cp)
        return [sum(keys(q * c, (q + 1) * c) for q in chunks) for chunks in zigzag]
    if layout == "per_document":
        if any(length % (2 * cp) for length in doc_lengths):
            raise ValueError(f"every document must split into {2 * cp} chunks")
        return [sum(keys(start + q * (length // (2 * cp)),
                         start + (q + 1) * (length // (2 * cp)))
                    for start, length in zip(starts, doc_lengths) for q in chunks)
                for chunks in zigzag]
    if layout == "torch_per_document":
        if any(length % (2 * cp) for length in doc_lengths):
            raise ValueError(f"every document must split into {2 * cp} chunks")
        order = []      # (lo, hi) position ranges in the balancer's order
        for start, length in zip(starts, doc_lengths):
            c = length // (2 * cp)
            for r in range(cp):
                order += [(start + r * c, start + (r + 1) * c),
                          (start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c)]
        piece = sum(doc_lengths) // cp
        pairs, offset = [0] * cp, 0     # offset: where the range starts in that order
        for lo, hi in order:
            while lo < hi:              # a range may straddle two ranks' pieces
                rank = offset // piece
                take = min(hi - lo, (rank + 1) * piece - offset)
                pairs[rank] += keys(lo, lo + take)
                lo, offset = lo + take, offset + take
        return pairs
    raise ValueError(f"unknown layout {layout!r}; choose from zigzag, per_document, "
                     "torch_per_document")


# Zero-bubble schedules: the backward split in two, the input's gradient (I, which the
# previous piece waits for) and the weights' gradient (W, which nothing waits for until the
# optimizer step), and the W's moved into time a rank would otherwise idle (Qi et al.,
# 2024); and DeepSeek-V3's DualPipe (§3.2.1) in its V-shaped form. The orders are those of
# torch 2.13's schedules (torch/distributed/pipelining/schedules.py), written out here so
# that a step can be priced without torch; tests/test_pipeline.py checks them against
# torch's own.

ZERO_BUBBLE_SCHEDULES = ("zb1p", "zbv", "dualpipev")


def zero_bubble_pieces(schedule, stages, stage, chunks=2):
    """[model pieces rank `stage` of `stages` holds, in the order of its local stages]:
      zb1p       v = `chunks` pieces interleaved, r, r + p, ..., as the interleaved 1F1B
      zbv, dualpipev   two pieces in a V, r and 2p - 1 - r: the first and the last piece
                 share rank 0, and the two in the middle rank p - 1, where nothing is sent"""
    if schedule == "zb1p":
        return [chunk * stages + stage for chunk in range(chunks)]
    if schedule in ("zbv", "dualpipev"):
        return [stage, 2 * stages - 1 - stage]
    raise ValueError(f"unknown schedule {schedule!r}; choose from "
                     f"{', '.join(ZERO_BUBBLE_SCHEDULES)}")


def zero_bubble_order(schedule, stages, stage, microbatches, chunks=2):
    """[(op, micro-batch, piece)] rank `stage` of p = `stages` runs in one step of m =
    `microbatches`, ops F (forward), I (input's gradient), W (weights' gradient) and B (a
    whole backward, I and W in one op), on the pieces of zero_bubble_pieces:

      zb1p       torch's ScheduleInterleavedZeroBubble, Qi et al.'s ZB-H1 over v chunks:
                 the interleaved 1F1B's warm-up less one forward per hop, (v-1) r + p-1-s
                 forwards (r micro-batches per round, as the interleaved 1F1B's), then an F
                 and an I in turn; rank s starts to follow each I with the oldest W still
                 due only after its first s I's, so the last rank defers p - 1 of them into
                 the drain; the W's left run at the end
      zbv        ScheduleZBVZeroBubble, their ZB-V (§6): 2(p-s) - 1 forwards of the first
                 piece, s pairs of forwards (second piece, first), p - s rounds of F, I, W
                 on the second piece, then F, I, W on the first piece and on the second in
                 turn until every forward has run, the input gradients left, and the W's
                 left last; torch plans max(m, 2p - 1) micro-batches and drops the ops past m
      dualpipev  ScheduleDualPipeV, DualPipe cut in half (DeepSeek's DualPipe repository):
                 2(p-1-s) forwards of the first piece, s + 1 pairs of forwards, p-1-s rounds
                 of I, W, F on the second piece, the main phase, where a forward of one piece
                 goes with a whole backward of the other (DualPipe overlaps each such pair;
                 torch's runtime runs its two ops one after the other), then the backwards
                 left, the later ones split into I and W, with the W's last; m >= 2p
    """
    p, s, m = stages, stage, microbatches
    pieces = zero_bubble_pieces(schedule, p, s, chunks)
    order, made = [], {}

    def run(op, piece, microbatch=None):
        """Append op on piece: the next micro-batch it has not run, or `microbatch`."""
        key = ("I" if op == "B" else op, piece)   # a whole backward counts as an I
        i = made.get(key, 0) if microbatch is None else microbatch
        made[key] = made.get(key, 0) + 1
        order.append((op, i, piece))
        return i

    def done(op, piece):
        return made.get((op, piece), 0)

    if schedule == "zb1p":
        v, per_round = chunks, m // max(1, m // p)
        warmup = min((v - 1) * per_round + p - 1 - s, m * v)
        backwards = []   # the piece of each I run so far: the W's follow in that order
        for k in range(m * v + warmup):
            if k < m * v:
                run("F", pieces[k // per_round % v])
            if k >= warmup:
                backwards.append(pieces[v - 1 - (k - warmup) // per_round % v])
                run("I", backwards[-1])
                if k - warmup >= s:
                    run("W", backwards[sum(done("W", q) for q in pieces)])
        for piece in backwards[sum(done("W", q) for q in pieces):]:
            run("W", piece)
        return order
    first, second = pieces
    if schedule == "zbv":
        n = max(2 * p - 1, m)
        for _ in range(2 * (p - s) - 1):
            run("F", first)
        for _ in range(s):
            run("F", second)
            run("F", first)
        for _ in range(p - s):
            run("F", second)
            run("W", second, run("I", second))
        while done("F", second) < done("F", first) or done("F", first) < n:
            if done("F", first) < n:
                run("F", first)
            run("W", first, run("I", first))
            run("F", second)
            run("W", second, run("I", second))
        for _ in range(s):
            run("I", first)
            run("I", second)
        for _ in range(p - s):
            run("I", first)
            run("W", first)
        for piece in (second, first):
            while done("W", piece) < done("I", piece):
                run("W", piece)
        return [op for op in order if op[1] < m]
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs m >= 2p micro-batches, got p = {p} and m = {m}")
    waiting = []   # (piece, micro-batch) of each I whose W has not run, oldest first

    def backward(split, piece):
        i = run("I" if split else "B", piece)
        if split:
            waiting.append((piece, i))

    def weight():
        if waiting:
            piece, i = waiting.pop(0)
            run("W", piece, i)

    for _ in range(2 * (p - 1 - s)):
        run("F", first)
    for _ in range(s + 1):
        run("F", first)
        run("F", second)
    for _ in range(p - 1 - s):
        backward(True, second)
        weight()
        run("F", second)
    for _ in range(m - 2 * p + s + 1):   # the main phase: forward of one, backward of other
        run("F", first)
        backward(False, second)
        run("F", second)
        backward(False, first)
    for _ in range(p - 1 - s):
        backward(False, second)
        run("F", second)
        backward(False, first)
    split = False   # from half-way through these, the backwards leave their W for later
    for i in range(s + 1):
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        backward(split, second)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        backward(split, first)
    for _ in range(p - 1 - s):
        weight()
        backward(split, first)
    while waiting:
        weight()
    return order


def zero_bubble_step_time(schedule, stages, microbatches, forward_s, input_grad_s,
                          weight_grad_s, chunks=2, handoff_s=0.0):
    """Seconds of one step of `schedule` (zero_bubble_order) when each piece's forward of a
    micro-batch lasts F = forward_s, its input's gradient B = input_grad_s and its weights'
    W = weight_grad_s (a whole backward B + W): the step's critical path
    (pipeline_step_time), `handoff_s` on every edge between two ranks. Times are a
    piece's: 1/v of a rank's layers for zb1p, half for zbv and dualpipev."""
    lengths = {"F": forward_s, "I": input_grad_s, "W": weight_grad_s,
               "B": input_grad_s + weight_grad_s}
    orders = {s: zero_bubble_order(schedule, stages, s, microbatches, chunks)
              for s in range(stages)}
    durations = {s: [lengths[op] for op, _, _ in order] for s, order in orders.items()}
    return pipeline_step_time(orders, durations, handoff_s)


def zero_bubble_bubble_fraction(schedule, stages, microbatches, forward_s, input_grad_s,
                                weight_grad_s, chunks=2, handoff_s=0.0):
    """The bubble (idle time over p x step time) of zero_bubble_step_time's step, any m and
    any F, B and W. Each rank is busy m (F + B + W) per piece it holds; the bubble is what
    the step adds. With F = B = W and m large: (p-1) F idle per rank for all three."""
    pieces = len(zero_bubble_pieces(schedule, stages, 0, chunks))
    busy = pieces * microbatches * (forward_s + input_grad_s + weight_grad_s)
    step = zero_bubble_step_time(schedule, stages, microbatches, forward_s, input_grad_s,
                                 weight_grad_s, chunks, handoff_s)
    return 1 - busy / step


def published_bubble_s(schedule, stages, forward_s, input_grad_s, weight_grad_s,
                       overlapped_s=None):
    """Seconds each of p = `stages` ranks idles in one step by the published counts, for m
    large enough, from the times of one piece's F, B (input's gradient) and W (weights'):

      1f1b       (p-1)(F + B + W)       Qi et al. 2024, Table 2 (B + W the whole backward)
      zb1p       (p-1)(F + B - W)       their ZB-H1 (§2.1, Table 2; DeepSeek-V3's Table 2
                                        writes it (PP-1)(F + B' - 2W), B' = B + W the whole
                                        backward), for W <= F and W <= B: past them the
                                        order's critical path gives (p-1) max(F, B)
      zbv        0                      their ZB-V (§6), for F = B = W only (raises
                                        otherwise), counted within each rank's own span,
                                        first op to last; a step whose ranks start together
                                        (after the optimizer's) also idles the fill and the
                                        drain, (p-1) F per rank (zero_bubble_step_time)
      dualpipev  (p-1)(F&B + B' - 3W)   DeepSeek-V3's Table 2 for DualPipe, (PP/2-1)(F&B +
                                        B' - 3W) over PP stages, which DualPipeV holds on
                                        PP/2 = p ranks (DualPipe's README); F&B =
                                        `overlapped_s`, a forward and a whole backward run
                                        together (default F + B + W: one after the other)

    The counts hold for zb1p from m >= p, zbv from m >= 2p - 1, dualpipev from its least,
    m = 2p; zero_bubble_step_time walks any m and any times."""
    p, f, b, w = stages, forward_s, input_grad_s, weight_grad_s
    if schedule == "1f1b":
        return (p - 1) * (f + b + w)
    if schedule == "zb1p":
        return (p - 1) * (f + b - w)
    if schedule == "zbv":
        if not f == b == w:
            raise ValueError("the published ZB-V count assumes F = B = W; "
                             "zero_bubble_step_time walks other times")
        return 0.0
    if schedule == "dualpipev":
        overlapped = f + b + w if overlapped_s is None else overlapped_s
        return (p - 1) * (overlapped + (b + w) - 3 * w)
    raise ValueError(f"unknown schedule {schedule!r}; choose from 1f1b, "
                     f"{', '.join(ZERO_BUBBLE_SCHEDULES)}")


def published_bubble_fraction(schedule, stages, microbatches, forward_s, input_grad_s,
                              weight_grad_s, chunks=2, overlapped_s=None):
    """published_bubble_s as a fraction of the step: idle / (idle + busy), each rank busy
    m (F + B + W) per piece it holds (one for 1f1b, `chunks` for zb1p, two for zbv and
    dualpipev). With chunks > 1 the times are a piece's, a form Qi et al. did not publish
    (their ZB-H1 count is for one piece per rank, stage times): compare it with interleaved
    1F1B at the same chunks (pipeline_bubble_fraction), not with plain 1F1B."""
    pieces = 1 if schedule == "1f1b" else len(zero_bubble_pieces(schedule, stages, 0, chunks))
    idle = published_bubble_s(schedule, stages, forward_s, input_grad_s, weight_grad_s,
                              overlapped_s)
    return idle / (idle + pieces * microbatches * (forward_s + input_grad_s + weight_grad_s))


# A matrix product's rate by its shape. A GPU computes C = A B (A: m x k, B: k x n) in
# output tiles, one thread block per tile, in waves of one tile per SM (NVIDIA, "Matrix
# Multiplication Background User's Guide", Deep Learning Performance documentation, its
# "Tile quantization" and "Wave quantization"): m and n are rounded up to whole tiles, and
# the tiles to whole waves. The guide's worked example takes 256 x 128 tiles on the A100's
# 108 SMs. cuBLAS picks among several tiles, so one tile's loss is an upper bound on what it
# loses.
GEMM_TILE = (256, 128)


def gemm_shape_efficiency(m, n, sms, batch=1, tile=GEMM_TILE):
    """The fraction of a GPU's large-product rate a product with an m x n output (`batch` of
    them, one launch) keeps after tile quantisation, m n / (ceil(m/tm) tm ceil(n/tn) tn),
    and wave quantisation, tiles / (ceil(tiles/SMs) SMs). Both tend to 1 as m and n grow."""
    tm, tn = tile
    rows, cols = math.ceil(m / tm), math.ceil(n / tn)
    tiles = batch * rows * cols
    return m * n / (rows * tm * cols * tn) * tiles / (math.ceil(tiles / sms) * sms)


def gemm_seconds(m, n, k, ceiling_flops, memory_bytes_per_s, sms, batch=1, value_bytes=2):
    """Seconds of `batch` products of (m x k) by (k x n): the compute at `ceiling_flops`
    (the rate large products reach) times gemm_shape_efficiency, or reading both operands
    and writing the output at the memory's rate, whichever is longer (a roofline)."""
    compute = 2 * m * n * k * batch / (ceiling_flops * gemm_shape_efficiency(m, n, sms, batch))
    traffic = batch * value_bytes * (m * k + k * n + m * n) / memory_bytes_per_s
    return max(compute, traffic)


def gemm_rate(m, n, k, ceiling_flops, memory_bytes_per_s, sms, batch=1, value_bytes=2):
    """FLOP/s of gemm_seconds' product: at most `ceiling_flops`."""
    return 2 * m * n * k * batch / gemm_seconds(m, n, k, ceiling_flops, memory_bytes_per_s,
                                                sms, batch, value_bytes)


def trained_gemm_seconds(m, n, k, ceiling_flops, memory_bytes_per_s, sms, batch=1):
    """A linear layer's three products in a training step, m tokens through a k x n weight:
    the forward (m x k by k x n), the input's gradient (m x n by n x k) and the weight's
    (k x m by m x n), each at its own shape's rate (gemm_seconds)."""
    args = (ceiling_flops, memory_bytes_per_s, sms, batch)
    return gemm_seconds(m, n, k, *args) + gemm_seconds(m, k, n, *args) \
        + gemm_seconds(k, n, m, *args)

"""Communication cost models: how a ring splits a tensor, bytes each rank sends, bus bandwidth,
and the alpha-beta time model with its fit to measured times.

Pure functions, no process group: the chapters compute predictions with them, the labs use
them for the same split, and the tests check them by hand. CollectiveCounter adds up, with
the same formulas, the collectives a lab really issues.
"""

import math
from fractions import Fraction

# Bus bandwidth = algorithm bandwidth x this factor (nccl-tests' definitions): it turns
# bytes/time into the bandwidth each link must carry, comparable across world sizes.
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
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
    """Bytes each rank sends in the bandwidth-optimal (ring or pipelined chain) algorithm.

    `bytes_` is the size of the full tensor: the input of all-reduce, reduce-scatter, reduce,
    broadcast and all-to-all, the output of all-gather. Divisible sizes assumed. A
    `fractions.Fraction` size gives an exact answer (the FSDP lab counts bytes with it).
    """
    n = world_size
    per_rank = {
        "broadcast": bytes_ * (n - 1) / n,    # chain: all but the last forward S
        "reduce": bytes_ * (n - 1) / n,
        "all_reduce": bytes_ * 2 * (n - 1) / n,
        "reduce_scatter": bytes_ * (n - 1) / n,
        "all_gather": bytes_ * (n - 1) / n,
        "all_to_all": bytes_ * (n - 1) / n,   # keeps 1/N, sends the rest
    }
    return per_rank[op]


# The collectives one data-parallel training step issues over the whole parameter set:
# DDP all-reduces the gradients once; ZeRO-3 gathers the parameters for forward and again
# for backward, and reduce-scatters the gradients.
DATA_PARALLEL_COLLECTIVES = {
    "ddp": ("all_reduce",),
    "zero3": ("all_gather", "all_gather", "reduce_scatter"),
}


def data_parallel_bytes_per_rank(strategy, numel, world_size, value_bytes=4):
    """Bytes each rank sends in one training step of `numel` parameters, exactly (a
    Fraction): DDP 2(N-1)/N x numel x b; ZeRO-3 3(N-1)/N x numel x b, where numel is the
    padded count its equal shards need (memory_model.padded_numel)."""
    size = Fraction(numel * value_bytes)
    return sum(bytes_sent_per_rank(op, size, world_size)
               for op in DATA_PARALLEL_COLLECTIVES[strategy])


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
        size = Fraction(tensor.numel() * tensor.element_size())
        self.sent += bytes_sent_per_rank(op, size, self.world_size)
        self.counts[op] = self.counts.get(op, 0) + 1


def bus_bandwidth(op, bytes_, seconds, world_size):
    """nccl-tests' busbw in bytes/s: algbw (bytes / seconds) times the op's factor."""
    return bytes_ / seconds * BUSBW_FACTORS[op](world_size)


def allreduce_time(bytes_, world_size, alpha_s, beta_bytes_per_s):
    """Alpha-beta model of a ring all-reduce: 2(N-1) latencies + 2(N-1)/N * S / beta."""
    n = world_size
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * bytes_ / beta_bytes_per_s


def tree_allreduce_time(bytes_, world_size, alpha_s, beta_bytes_per_s):
    """A pipelined binary-tree reduce then broadcast: 2 log2(N) latencies, ~2 S / beta.

    Fewer latency terms than the ring (log N instead of N), but every byte crosses the
    busiest link twice whatever N is, against 2(N-1)/N for the ring.
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

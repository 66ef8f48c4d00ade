"""Sending less: what a rank sends per step when it compresses its gradients or synchronises
less often, and what a step then costs on a link of a given speed.

  ddp               every step, the fp32 gradients all-reduced: 4 bytes a value
  bf16              every step, the gradients cast to bf16 and all-reduced: 2 bytes a value
  powersgd          torch's powerSGD_hook at rank r (Vogels et al. 2019): each gradient seen
                    as an n x m matrix (n its first dimension) is compressed when
                    (n + m) r x min_compression_rate < n m, into P (n x r) and Q (m x r),
                    each all-reduced in fp32; the rest (the biases, the small matrices)
                    all-reduced as they are. The first `start_iter` steps all-reduce
                    everything (torch needs 2 or more with error feedback or warm start).
  local_sgd         each rank steps alone; every H steps the parameters are averaged: one
                    fp32 all-reduce of all of them
  diloco            H steps of an inner optimizer, then the pseudo-gradient (the parameters
                    at the last sync minus now) all-reduced in fp32, and an outer step
                    (Douillard et al. 2023): the same bytes as local SGD
  streaming_diloco  the model cut into P fragments, fragment p synced every H steps, the
                    fragments' syncs spread evenly over the H steps (Douillard et al. 2025):
                    on average the bytes of DiLoCo, at most a fragment's at once

All bytes are those of the ring algorithm (comm_model.bytes_sent_per_rank): 2(N-1)/N of what
is all-reduced. bf16's error (bf16_average_relative_rms, bf16_average_error_bound) is the
precision chapter's model of a bf16 sum (precision_model.sum_relative_error), with the casts
before it. outer_state_bytes: what DiLoCo keeps on every rank to sync less often. Torch-free:
the labs, the chapter and the tests call the same functions.
"""

import math
from fractions import Fraction

from . import comm_model, precision_model

METHODS = ("ddp", "bf16", "powersgd", "local_sgd", "diloco", "streaming_diloco")
SYNCS_EVERY_STEP = ("ddp", "bf16", "powersgd")
POWERSGD_MIN_COMPRESSION_RATE = 2   # torch's PowerSGDState default
POWERSGD_START_ITER = 2             # the fewest torch allows with error feedback


def powersgd_split(shapes, rank, min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE):
    """(values sent as they are, values of the P factors, values of the Q factors) of one
    PowerSGD step over gradients of these shapes, as torch's powerSGD_hook splits them:
    each viewed as (shape[0], rest), its rank capped by min(n, m), compressed only where
    that saves more than min_compression_rate times."""
    uncompressed = p_values = q_values = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = 1
        for d in shape[1:]:
            m *= d
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p_values += n * r
            q_values += m * r
        else:
            uncompressed += n * m
    return uncompressed, p_values, q_values


def fragments_of(layers, fragments):
    """[(first layer, end)] of each fragment: the layers cut into `fragments` contiguous runs,
    the first ones one layer longer where they do not divide (the embedding goes with the
    first fragment, the head with the last)."""
    if not 1 <= fragments <= layers:
        raise ValueError(f"{fragments} fragments of {layers} layers: each needs a layer")
    base, extra = divmod(layers, fragments)
    bounds, start = [], 0
    for f in range(fragments):
        end = start + base + (f < extra)
        bounds.append((start, end))
        start = end
    return bounds


def fragment_sync_step(fragment, fragments, sync_every):
    """The step (0-based, within each period of `sync_every`) at which `fragment` syncs:
    fragment p at p H / P (rounded down), so the syncs spread over the period and the last
    fragment's lands at H - H/P, not on the others'."""
    return (fragment * sync_every) // fragments


def values_all_reduced(method, step, shapes, sync_every=1, rank=1, fragment_values=None,
                       start_iter=POWERSGD_START_ITER):
    """[(values, bytes per value)] of every all-reduce a rank makes at training step `step`
    (0-based). `shapes`: the parameters' shapes; `fragment_values`: the values of each
    fragment (streaming DiLoCo)."""
    total = sum(_numel(s) for s in shapes)
    if method == "ddp":
        return [(total, 4)]
    if method == "bf16":
        return [(total, 2)]
    if method == "powersgd":
        if step < start_iter:
            return [(total, 4)]
        return [(values, 4) for values in powersgd_split(shapes, rank)]
    if method in ("local_sgd", "diloco"):
        return [(total, 4)] if (step + 1) % sync_every == 0 else []
    if method == "streaming_diloco":
        fragments = len(fragment_values)
        return [(values, 4) for p, values in enumerate(fragment_values)
                if step % sync_every == (fragment_sync_step(p, fragments, sync_every)
                                         + sync_every - 1) % sync_every]
    raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")


def bytes_sent_per_rank(method, steps, shapes, world_size, **options):
    """Bytes a rank sends over `steps` steps (an exact Fraction), all-reduce by all-reduce."""
    sent = Fraction(0)
    for step in range(steps):
        for values, value_bytes in values_all_reduced(method, step, shapes, **options):
            sent += comm_model.bytes_sent_per_rank("all_reduce", Fraction(values * value_bytes),
                                                   world_size)
    return sent


def peak_bytes_per_sync(method, shapes, world_size, **options):
    """The most bytes a rank sends in any one step: what the link must carry at once."""
    steps = max(options.get("sync_every", 1), POWERSGD_START_ITER)   # PowerSGD's plain steps too
    return max(sum(comm_model.bytes_sent_per_rank("all_reduce", Fraction(v * b), world_size)
                   for v, b in values_all_reduced(method, step, shapes, **options))
               for step in range(steps))


def outer_state_bytes(method, param_count, value_bytes=4):
    """{anchor, outer_momentum}: bytes of state a rank keeps beyond DDP's (its parameters,
    gradients and inner optimizer state) to synchronise less often. DiLoCo keeps the
    parameters of the last sync (the anchor its pseudo-gradient starts from) and its outer
    Nesterov momentum, each a full copy of the parameters in fp32; Streaming DiLoCo keeps
    both for every fragment, so the same in all. Local SGD averages the parameters in place
    and keeps neither. DDP and the compressed all-reduces keep no outer state (PowerSGD's
    error feedback and its last Q are the hook's, not counted here)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")
    copies = 1 if method in ("diloco", "streaming_diloco") else 0
    return {"anchor": copies * value_bytes * param_count,
            "outer_momentum": copies * value_bytes * param_count}


def powersgd_flops(shapes, rank, min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE):
    """Multiply-adds x 2 that PowerSGD adds per step: P = M Q, Q = M^T P and the
    decompression P Q^T, each n m r, for every compressed n x m matrix (the
    orthogonalisation of P, O(n r^2), left out)."""
    flops = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = _numel(shape) // n if shape else 1
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            flops += 3 * 2 * n * m * r
    return flops


def step_time(method, compute_s, steps, shapes, world_size, alpha_s, beta_bytes_per_s,
              extra_compute_s=0.0, first_step=0, **options):
    """Mean seconds a step takes over steps first_step .. steps - 1: its computation, what
    the method adds to it, and each all-reduce's alpha + bytes sent / beta, with no overlap
    (the lab's slowed link waits before each collective). alpha and beta as fitted on the
    same link."""
    comm = 0.0
    for step in range(first_step, steps):
        for values, value_bytes in values_all_reduced(method, step, shapes, **options):
            sent = comm_model.bytes_sent_per_rank("all_reduce", values * value_bytes, world_size)
            comm += alpha_s + sent / beta_bytes_per_s
    return compute_s + extra_compute_s + comm / (steps - first_step)


def time_within_spread(predicted_s, step_range_s, compute_s, compute_range_s,
                       forward_range_s, compute_forward_s, floor=False):
    """Whether a predicted mean step time agrees with a run's steps, on a busy machine too.
    The prediction adds the link's time to compute_s, a step without communication timed
    before the run (its fastest and slowest in compute_range_s, its forward pass's median
    compute_forward_s). The run's own forward passes, which no method changes and none
    communicates in, ranged over forward_range_s: the machine ran the computation between
    forward_range_s / compute_forward_s times as slow as then. The prediction, its
    computation so scaled, must come within the range of the run's steps (step_range_s:
    fastest, slowest), widened either side by that range's width and by the compute steps'
    spread at the slowest of those speeds: a busy machine widens all three. A prediction
    that leaves part of the step out (floor=True: PowerSGD's, whose products are priced at
    the rate of the model's own step) need only not exceed the slowest step."""
    fastest, slowest = step_range_s
    slow_down = [f / compute_forward_s for f in forward_range_s]
    margin = slowest - fastest + slow_down[1] * (compute_range_s[1] - compute_range_s[0])
    if predicted_s + (slow_down[0] - 1) * compute_s > slowest + margin:
        return False
    return floor or predicted_s + (slow_down[1] - 1) * compute_s >= fastest - margin


def crossover_bandwidth(bytes_a, seconds_a, bytes_b, seconds_b,
                        messages_a=0, messages_b=0, alpha_s=0.0):
    """The link bandwidth (bytes/s) below which method b, sending bytes_b per step in
    messages_b all-reduces and computing seconds_b more, beats method a: where
    s_a + n_a alpha + B_a/beta = s_b + n_b alpha + B_b/beta, so
    beta* = (B_a - B_b) / ((s_b - s_a) + (n_b - n_a) alpha). Each extra message costs a
    latency the saved bytes must pay back too. None where b never wins (it sends no fewer
    bytes) or always does (it costs no more)."""
    saved_bytes = bytes_a - bytes_b
    extra_s = (seconds_b - seconds_a) + (messages_b - messages_a) * alpha_s
    if saved_bytes <= 0:
        return None
    if extra_s <= 0:
        return float("inf")
    return saved_bytes / extra_s


def _is_power_of_two(n):
    return n & (n - 1) == 0


def bf16_average_relative_rms(world_size):
    """RMS error of the bf16 hook's averaged gradient against the exact average, relative to
    the average's RMS, for ranks whose gradients are independent and equally spread: each
    rank's gradient cast to bf16 (rounding_rms of each of N terms, against a sum sqrt(N)
    times one term: rounding_rms), divided by N in bf16 (exact for a power of two, else
    rounded once more), then summed in bf16 by the ring (sum_relative_error). Gradients that
    agree across ranks have a larger sum and err less, relative to it; gradients that cancel,
    more."""
    cast = precision_model.rounding_rms("bf16")
    divide = 0.0 if _is_power_of_two(world_size) else cast
    return math.sqrt(cast ** 2 + divide ** 2
                     + precision_model.sum_relative_error("bf16", world_size) ** 2)


def bf16_average_error_bound(world_size):
    """(c, floor): no value of the bf16 hook's average is further from DDP's fp32 average
    than c x sum over ranks |g_r| / N + floor, whatever the gradients. Each term passes
    through k roundings at most, its cast, the division where N is no power of two, and
    N - 1 additions, each of relative error u = 2^-(m + 1), so |error| <= gamma_k x
    sum |term| with gamma_k = k u / (1 - k u) (Higham, Accuracy and Stability of Numerical
    Algorithms, ch. 3 and 4), in bf16 and, for DDP's own fp32 sum, in fp32; `floor` covers
    results below the smallest normal, where each rounding errs by half a subnormal step
    at most."""
    k = world_size + (0 if _is_power_of_two(world_size) else 1)

    def gamma(name):
        u = 2.0 ** -(precision_model.get_format(name).mantissa_bits + 1)
        return k * u / (1 - k * u)

    floor = k * (precision_model.get_format("bf16").min_subnormal
                 + precision_model.get_format("fp32").min_subnormal) / 2
    return gamma("bf16") + gamma("fp32"), floor


def transformer_shapes(layers, hidden, vocab, seq):
    """The parameter shapes of the course's transformer (labkit.model.transformer), in its
    order: token and position embeddings; per block LayerNorm, fused QKV, projection,
    LayerNorm, the 4h MLP (weights and biases); the final LayerNorm and an untied head."""
    h = hidden
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,),
             (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return [(vocab, h), (seq, h), *block * layers, (h,), (h,), (vocab, h)]


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n

"""The pipeline in a step: the schedule's idle time on the slowest stage (1F1B, interleaved,
ZB-H1 over v chunks, or DualPipe's), and the activations and gradients sent between stages."""

from .. import time_model
from .layout import stage_imbalance
from .settings import VALUE_BYTES


def sends_overlapped(settings, chunks):
    """Whether the pipeline's sends run beside the computation (Settings.pp_async): as
    Llama 3 ran them (Dubey et al., 2024, section 3.3.2), or by Megatron-LM's default, with
    the interleaved schedule only (its --no-overlap-p2p-communication turns it off; its
    validate_args turns it off without interleaving). Overlapped, a send is exposed only
    in the fill and drain, where the next stage waits for it."""
    return (chunks > 1) if settings.pp_async is None else settings.pp_async


def bubble_seconds(model, cut, pp, microbatches, chunks, work, forward, flash, dualpipe=False,
                   communication=0.0, zero_bubble=False):
    """The pipeline's idle time in a step of `work` seconds of computation a rank
    (`forward` of them the forward's).
    The pipeline waits for its slowest stage (the embedding's and the head's work sit on the
    first and last), and idles in the schedule's fill and drain, whose slots each last a
    micro-batch's computation and its exposed `communication` (tensor-, context- and
    expert-parallel collectives and the pipeline's own sends, a step's of each; Narayanan et
    al., 2021, section 2.2: the bubble is (p - 1)/(v m) of the time the m micro-batches
    take). Interleaved, the fill and drain wait on the other ranks' first chunks: a rank's
    time over v stands in for them, exact when the chunks hold the same layers. The
    schedules that split the backward are priced by the time model's own functions, as the
    pipeline lab measures them: DualPipe by DeepSeek-V3's Table 2 (published_bubble_s,
    DualPipeV's count over pp/2 ranks), in units of the computation alone; ZB-H1 over v
    chunks (`zero_bubble`, torch's ScheduleInterleavedZeroBubble) by the walk of its order
    (zero_bubble_bubble_fraction) at this step's F, I and W. For both, W, the weights'
    gradients, lasts as long as the forward (a linear layer's backward is two products of
    its forward's one, the input's and the weights'), and I the rest of the backward, any
    recomputation in it."""
    slowest = work * stage_imbalance(model, cut, flash, chunks)
    backward = work - forward                  # the whole backward, any recomputation in it
    weights = forward
    if dualpipe:
        # F&B the overlapped forward and backward (F + B when compute-bound)
        idle = time_model.published_bubble_s("dualpipev", pp // 2, forward,
                                             backward - weights, weights, overlapped_s=work)
        return slowest - work + idle / work * slowest / microbatches
    if zero_bubble:
        fraction = time_model.zero_bubble_bubble_fraction(
            "zb1p", pp, microbatches, forward, backward - weights, weights, chunks)
    else:
        fraction = time_model.pipeline_bubble_fraction(pp, microbatches, chunks)
    return (slowest + communication) / (1 - fraction) - work - communication


def send_seconds(model, batch, seq, tp, cp, dp, pp, microbatches, chunks, hw):
    """The pipeline's sends in a step, one after the other: an activation forward and its
    gradient back per micro-batch and chunk; each tensor-parallel rank sends its own 1/tp
    of the tokens (sequence parallelism splits them, as Megatron-LM's scatter/gather does
    without it) of its s/cp."""
    if pp == 1:
        return 0.0
    alpha, beta = hw.nvlink if tp * cp * dp * pp <= hw.gpus_per_node else hw.network
    return microbatches * chunks * 2 * (alpha + VALUE_BYTES * batch * seq * model.hidden
                                        / tp / beta)


def chunk_exposed_seconds(model, batch, seq, tp, cp, dp, pp, microbatches, chunks, hw,
                          forward, backward):
    """What overlapped sends still cost in a step (Settings.chunk_price): each of the m x v
    activations sent forward and gradients sent back (v times a 1F1B pipeline's, Narayanan
    et al., 2021, section 2.2) waits its link's latency, the launch and the matching
    receive that no overlap hides, and a transfer longer than the chunk's computation
    beside it (a micro-batch's forward, or backward, over v chunks: `forward` and
    `backward` seconds of a step's m micro-batches) leaves the rest exposed."""
    if pp == 1:
        return 0.0
    alpha, beta = hw.nvlink if tp * cp * dp * pp <= hw.gpus_per_node else hw.network
    transfer = VALUE_BYTES * batch * seq * model.hidden / tp / beta
    slots = microbatches * chunks
    return slots * (2 * alpha + max(0.0, transfer - forward / slots)
                    + max(0.0, transfer - backward / slots))

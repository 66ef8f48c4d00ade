"""The search: every layout of the GPUs and every setting of it that can run (why_not says
why one cannot), kept if it fits and ranked by its step time (plan); one layout's rank
among them (rank_layout)."""

import math

from .layout import chunk_split, divisors, interleavings, most_virtual_stages, stage_split
from .memory_per_gpu import memory
from .step import mfu, step_time

MICRO_BATCH_SIZES = (1, 2, 4, 8)


def why_not(model, layout, settings, hw):
    """Why `layout` (its degrees) cannot run this model, or None."""
    dp, tp, pp, cp, ep, v = (layout[k] for k in ("dp", "tp", "pp", "cp", "ep", "chunks"))
    if dp * tp * pp * cp != hw.gpus:
        return f"dp x tp x pp x cp = {dp * tp * pp * cp}, not the {hw.gpus} GPUs"
    if hw.gpus_per_node % tp:
        return f"tp {tp} does not divide a node of {hw.gpus_per_node} GPUs"
    if model.heads % tp or (model.kv_heads or model.heads) % tp and not model.attention_params:
        return f"tp {tp} does not divide the {model.heads} heads ({model.kv_heads or model.heads} key-value)"
    if model.vocab % tp:
        return f"tp {tp} does not divide the vocabulary of {model.vocab}"
    if tp > 1 and not settings.sequence_parallel and (settings.tp_comm_overlap
                                                      or settings.async_tp):
        return ("overlapping tensor-parallel collectives with their products needs sequence "
                "parallelism (Transformer Engine's and torch's both do)")
    if pp * v > most_virtual_stages(model, v):
        return (f"pp {pp} x {v} chunks is more than the {model.layers} layers"
                + (" and two end chunks without one" if v > 1 else ""))
    if model.seq % (2 * cp if cp > 1 else 1):
        return f"cp {cp} does not divide the sequence of {model.seq} into 2 cp chunks"
    if ep > 1 and not model.experts:
        return "ep > 1 needs a mixture-of-experts model (--experts)"
    etp = layout.get("etp", tp)
    if etp != tp and not model.experts:
        return "etp needs a mixture-of-experts model (--experts); a dense model's is tp"
    if hw.gpus_per_node % etp:
        return f"etp {etp} does not divide a node of {hw.gpus_per_node} GPUs"
    if model.experts and model.expert_hidden % etp:
        return f"etp {etp} does not divide the experts' width of {model.expert_hidden}"
    if model.experts and (model.experts % ep or (tp * cp * dp) % (ep * etp)):
        return (f"ep {ep} must divide the {model.experts} experts, and ep x etp = {ep * etp} "
                f"the tp x cp x dp = {tp * cp * dp} ranks of a stage")
    if layout.get("zb") and layout.get("dualpipe"):
        return "a layout runs one schedule: zb=1 or dualpipe=1, not both"
    if layout.get("zb") and "microbatches" in layout and layout["microbatches"] % pp:
        # torch's ScheduleInterleavedZeroBubble runs rounds of p micro-batches
        return (f"ZB-H1 here needs the micro-batches ({layout['microbatches']}) a multiple "
                f"of pp {pp}")
    if layout.get("dualpipe") and (pp % 2 or v > 1):
        return f"DualPipe needs an even pp and one chunk per stage, got pp {pp}, v {v}"
    if layout.get("dualpipe") and "microbatches" in layout and (
            layout["microbatches"] % 2 or layout["microbatches"] < 2 * pp):
        return (f"DualPipe needs an even number of micro-batches, at least 2 pp = {2 * pp}, "
                f"got {layout['microbatches']}")
    if stage_split(model, pp, v, settings.flash_attention) is None:
        return (f"no cut of the {model.layers} layers over pp {pp} stages of {v} chunks "
                f"leaves a layer in every chunk but the two end ones")
    if v > 1 and "microbatches" in layout and layout["microbatches"] % pp:
        # Megatron-LM's interleaved schedule asserts it
        return (f"the interleaved schedule needs the micro-batches ({layout['microbatches']}) "
                f"a multiple of pp {pp}")
    sequences = settings.global_batch_tokens // model.seq
    if sequences % dp:
        return f"dp {dp} does not divide the batch of {sequences} sequences"
    return None


def evaluate(model, layout, settings, hw, mem=None):
    """`layout` with its memory (`mem` if already known), time and MFU (a new dict)."""
    mem = mem or memory(model, layout, settings, hw)
    time_s = step_time(model, layout, settings, hw)
    pp, v = layout["pp"], layout["chunks"]
    split = stage_split(model, pp, v, settings.flash_attention)
    chunks = {"chunk_layers": list(chunk_split(model, pp, v, settings.flash_attention))} \
        if v > 1 else {}
    return {**layout, "stage_layers": list(split), **chunks, "memory_bytes": mem,
            "fits": mem["total"] <= mem["usable"],
            "time_s": time_s,
            "tokens_per_s_per_gpu": settings.global_batch_tokens / time_s["step"] / hw.gpus,
            "mfu": mfu(model, settings, hw, time_s["step"]),
            "mfu_with_attention": mfu(model, settings, hw, time_s["step"], True)}


def settings_for(model, degrees, settings):
    """Every (micro-batch, chunks, ZeRO stage, recomputation) to try with `degrees`."""
    sequences = settings.global_batch_tokens // model.seq // degrees["dp"]
    pp = degrees["pp"]
    chunk_options = [degrees["chunks"]] if "chunks" in degrees else \
        interleavings(model, pp, settings.flash_attention)
    for b in MICRO_BATCH_SIZES:
        if sequences % b:
            continue
        for v in chunk_options:
            if pp * v > most_virtual_stages(model, v):
                continue
            for zero in settings.zero:
                for recompute in settings.recompute:
                    yield {**degrees, "chunks": v, "micro_batch": b,
                           "microbatches": sequences // b, "zero": zero,
                           "recompute": recompute,
                           "sequence_parallel": degrees["tp"] > 1 and settings.sequence_parallel}


def degree_options(model, hw, cp=None, ep=None):
    """Every (dp, tp, pp, cp, ep, etp) of the GPUs, before the model's own limits: a
    mixture of experts' matrices split as its attention's (etp = tp, Megatron-Core's
    default) or whole (etp = 1, as DeepSeek-V3's runs keep them)."""
    for tp in divisors(hw.gpus_per_node):
        if hw.gpus % tp:
            continue
        for cp_ in (cp if cp is not None else [1]):
            if hw.gpus % (tp * cp_):
                continue
            for pp in divisors(hw.gpus // (tp * cp_)):
                dp = hw.gpus // (tp * cp_ * pp)
                for ep_ in (ep if ep is not None else [1]):
                    for etp in sorted({tp, 1} if model.experts else {tp}, reverse=True):
                        yield {"dp": dp, "tp": tp, "pp": pp, "cp": cp_, "ep": ep_,
                               "etp": etp}


def configurations(model, settings, hw, cp=None, ep=None):
    """Every configuration that fits, fastest first (then least memory)."""
    found = []
    for degrees in degree_options(model, hw, cp, ep):
        layout = {**degrees, "chunks": 1}
        if why_not(model, layout, settings, hw):
            continue
        for config in settings_for(model, degrees, settings):
            if why_not(model, config, settings, hw):
                continue
            mem = memory(model, config, settings, hw)
            if mem["total"] <= mem["usable"]:   # only what fits is timed
                found.append(evaluate(model, config, settings, hw, mem))
    found.sort(key=lambda c: (c["time_s"]["step"], c["memory_bytes"]["total"]))
    return found


def cheapest_recompute(found):
    """Of configurations differing only in recomputation, keep the fastest: the planner's
    --recompute auto."""
    best = {}
    for c in found:
        key = tuple(c[k] for k in ("dp", "tp", "pp", "cp", "ep", "etp", "chunks",
                                   "micro_batch", "zero"))
        if key not in best:
            best[key] = c
    return sorted(best.values(), key=lambda c: (c["time_s"]["step"],
                                                c["memory_bytes"]["total"]))


def rank_layout(model, degrees, settings, hw, found):
    """The best configuration with these degrees (and chunks, if given), where it ranks
    among `found` (1 = the fastest), and the best step time; or why it does not fit."""
    layout = {"cp": 1, "ep": 1, "etp": degrees["tp"], **degrees}
    reason = why_not(model, {"chunks": 1, **layout}, settings, hw)
    best_time = found[0]["time_s"]["step"] if found else None
    if reason:
        return {**layout, "rank": None, "step_time_s": None, "best_step_time_s": best_time,
                "reason": reason}
    tried = [evaluate(model, c, settings, hw) for c in settings_for(model, layout, settings)
             if not why_not(model, c, settings, hw)]
    fitting = sorted((c for c in tried if c["fits"]),
                     key=lambda c: (c["time_s"]["step"], c["memory_bytes"]["total"]))
    if not fitting:
        smallest = min(tried, key=lambda c: c["memory_bytes"]["total"], default=None)
        reason = ("no micro-batch size divides the batch" if smallest is None else
                  f"needs {smallest['memory_bytes']['total'] / 1e9:.1f} GB per GPU at "
                  f"least (micro-batch {smallest['micro_batch']}, {smallest['zero']}, "
                  f"recompute {smallest['recompute']}), more than the "
                  f"{smallest['memory_bytes']['usable'] / 1e9:.1f} GB usable of "
                  f"{hw.gpu_memory_gb:g} GB")
        return {**layout, "rank": None, "step_time_s": None, "best_step_time_s": best_time,
                "reason": reason}
    mine = fitting[0]
    rank = 1 + sum(1 for c in found if c["time_s"]["step"] < mine["time_s"]["step"])
    return {**mine, "rank": rank, "step_time_s": mine["time_s"]["step"],
            "best_step_time_s": min(best_time or math.inf, mine["time_s"]["step"]),
            "reason": None}


def plan(model, settings, hw, cp=None, ep=None):
    """The fitting configurations, fastest first, one per setting of everything but the
    recomputation when that is 'auto' (settings.recompute = RECOMPUTE)."""
    found = configurations(model, settings, hw, cp, ep)
    return cheapest_recompute(found) if len(settings.recompute) > 1 else found

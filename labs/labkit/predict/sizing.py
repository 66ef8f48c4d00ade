"""The sizing page's one entry point: a form's fields in, the cost models' answers out, as
plain data (JSON). The page (book/sizing.md) runs it in the browser with Pyodide; the
numbers are those of memory_model and planner, the modules the build checks against the
labs. Bad input raises SizingError with one line for the form, never a traceback.

    run({"model": "llama3-70b", "gpus": "256", "global_batch_tokens": "4M"})
"""

import dataclasses
import math

from . import comm_model, memory_model, planner

ZERO_STAGES = memory_model.STRATEGIES
TOP = 5
# the form's "matrix products" choice: (plan.py's --precision, --fp8-activations)
MATMULS = {"bf16": ("bf16", False), "fp8": ("fp8", False), "fp8_activations": ("fp8", True)}
# the form's "tensor-parallel overlap" choice: none, plan.py's --tp-comm-overlap
# (Transformer Engine's), or its --async-tp (torch's): the Settings each sets, its flag
TP_OVERLAP = {"none": ({}, None), "gemm": ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
              "async": ({"async_tp": True}, "--async-tp")}


class SizingError(ValueError):
    """A field the form must correct: its message is one line, shown beside the form."""


def _whole(fields, name, default=None, minimum=1):
    text = str(fields.get(name, "") or "").strip()
    if not text:
        if default is None:
            raise SizingError(f"{name.replace('_', ' ')}: a whole number is needed")
        return default
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise SizingError(f"{name.replace('_', ' ')}: {text!r} is not a whole number") from None
    if value < minimum:
        raise SizingError(f"{name.replace('_', ' ')}: must be at least {minimum}, got {value}")
    return value


def _number(fields, name, default):
    text = str(fields.get(name, "") or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SizingError(f"{name.replace('_', ' ')}: {text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise SizingError(f"{name.replace('_', ' ')}: must be a positive number, got {text}")
    return value


def _tokens(fields, name, default):
    text = str(fields.get(name, "") or "").strip() or default
    try:
        value = comm_model.parse_size(text)
    except ValueError:
        raise SizingError(f"{name.replace('_', ' ')}: {text!r} is not a token count "
                          f"(a whole number with an optional K, M or G)") from None
    if value < 1:
        raise SizingError(f"{name.replace('_', ' ')}: must be at least 1 token")
    return value


def model_from_fields(fields):
    """(Model or None, parameter count): a preset, a parameter count, or a shape."""
    choice = str(fields.get("model", "") or "").strip()
    if choice in planner.PRESETS:
        model = planner.PRESETS[choice]
        seq = fields.get("seq")
        if str(seq or "").strip():
            model = dataclasses.replace(model, seq=_whole(fields, "seq"))
        return model, model.params()
    if choice == "params":
        text = str(fields.get("params", "") or "").strip()
        try:
            count = memory_model.parse_count(text)
        except ValueError as error:
            raise SizingError(f"parameters: {error}") from None
        seq = _whole(fields, "seq", 2048)
        return planner.shape_from_params(count, seq), count
    if choice != "shape":
        raise SizingError(f"model: choose a preset, 'params' or 'shape', not {choice!r}")
    experts = _whole(fields, "experts", 0, minimum=0)
    model = planner.Model(
        layers=_whole(fields, "layers"), hidden=_whole(fields, "hidden"),
        heads=_whole(fields, "heads"), seq=_whole(fields, "seq", 2048),
        vocab=_whole(fields, "vocab"), ffn_hidden=_whole(fields, "ffn_hidden", 0, minimum=0),
        kv_heads=_whole(fields, "kv_heads", 0, minimum=0),
        gpt=str(fields.get("style", "gpt")) != "llama", experts=experts,
        top_k=_whole(fields, "top_k", 0, minimum=0),
        expert_hidden=_whole(fields, "expert_hidden", 0, minimum=0),
        shared_experts=_whole(fields, "shared_experts", 0, minimum=0),
        dense_layers=_whole(fields, "dense_layers", 0, minimum=0))
    problem = model.check()
    if problem:
        raise SizingError(problem.replace("--", ""))
    return model, model.params()


def memory_per_gpu(params, gpus, optimizer, precision):
    """{stage: {params, grads, optimizer, total} bytes} for DDP and ZeRO-1/2/3: the model
    states one GPU holds (memory_model.state_bytes_per_gpu, the ZeRO paper's accounting)."""
    return {stage: memory_model.state_bytes_per_gpu(params, gpus, stage, optimizer, precision)
            for stage in ZERO_STAGES}


def _configuration(c):
    keys = ("dp", "tp", "pp", "cp", "ep", "etp", "chunks", "zero", "micro_batch", "microbatches",
            "recompute", "rank", "step_time_s", "best_step_time_s", "reason",
            "tokens_per_s_per_gpu", "mfu", "mfu_with_attention")
    row = {k: c[k] for k in keys if k in c}
    for k in ("memory_bytes", "time_s"):
        if k in c:
            row[k] = dict(c[k])
    return row


def run(fields):
    """The page's answer for the form's `fields` (strings, as a form gives them)."""
    model, params = model_from_fields(fields)
    gpus = _whole(fields, "gpus")
    optimizer = str(fields.get("optimizer", "adam") or "adam")
    precision = str(fields.get("precision", "mixed") or "mixed")
    if optimizer not in memory_model.OPTIMIZERS:
        raise SizingError(f"optimizer: choose from {', '.join(memory_model.OPTIMIZERS)}")
    if precision not in memory_model.PRECISIONS:
        raise SizingError(f"precision: choose from {', '.join(memory_model.PRECISIONS)}")
    matmuls = str(fields.get("matmuls", "bf16") or "bf16")
    if matmuls not in MATMULS:
        raise SizingError(f"matrix products: choose from {', '.join(MATMULS)}")
    tp_overlap = str(fields.get("tp_overlap", "none") or "none")
    if tp_overlap not in TP_OVERLAP:
        raise SizingError(f"tensor-parallel overlap: choose from {', '.join(TP_OVERLAP)}")
    hw = planner.Hardware(gpus=gpus, gpus_per_node=_whole(fields, "gpus_per_node", 8),
                          gpu_memory_gb=_number(fields, "gpu_memory_gb", 80.0))
    if hw.gpus % hw.gpus_per_node and hw.gpus > hw.gpus_per_node:
        raise SizingError(f"GPUs: {gpus} do not fill nodes of {hw.gpus_per_node}")
    tokens = _tokens(fields, "global_batch_tokens", "4M")
    if tokens % model.seq:
        raise SizingError(f"global batch: {tokens:,} tokens are not a whole number of "
                          f"{model.seq}-token sequences")
    result = {"model": {**dataclasses.asdict(model), "params": params,
                        "active_params": model.active_params()},
              "memory_per_gpu": memory_per_gpu(params, gpus, optimizer, precision),
              "command": command_line(fields)}
    layout_text = str(fields.get("layout", "") or "").strip()
    layout = None
    if layout_text:
        try:
            layout = planner.parse_layout(layout_text)
        except ValueError as error:
            raise SizingError(f"layout: {error}") from None
    if precision != "mixed" or optimizer != "adam":
        result["planner"] = None   # the planner prices mixed-precision Adam only
        result["planner_note"] = "the planner prices mixed-precision Adam only"
        return result
    compute_precision, fp8_activations = MATMULS[matmuls]
    settings = planner.Settings(global_batch_tokens=tokens, precision=compute_precision,
                                fp8_activations=fp8_activations,
                                **TP_OVERLAP[tp_overlap][0])
    cp = sorted({1, layout["cp"]}) if layout else [1]
    ep = ([e for e in (1, 2, 4, 8, 16, 32, 64) if model.experts % e == 0]
          if model.experts else None)
    if layout and model.experts and layout["ep"] not in ep:
        ep.append(layout["ep"])
    found = planner.plan(model, settings, hw, cp=cp, ep=ep)
    result["planner"] = {"count": len(found),
                         "best": [_configuration(c) for c in found[:TOP]]}
    if layout:
        result["layout"] = _configuration(planner.rank_layout(model, layout, settings, hw,
                                                              found))
    return result


def command_line(fields):
    """The labs/plan.py line that asks the same question (what the page shows without
    JavaScript, and beside its answers)."""
    choice = str(fields.get("model", "") or "").strip()
    parts = ["python labs/plan.py"]
    if choice in planner.PRESETS:
        parts += ["--model", choice]
    elif choice == "params":
        parts += ["--params", str(fields.get("params", ""))]
    else:
        for name in ("layers", "hidden", "heads", "vocab", "kv_heads", "ffn_hidden", "experts",
                     "top_k", "expert_hidden"):
            value = str(fields.get(name, "") or "").strip()
            if value and value != "0":
                parts += [f"--{name.replace('_', '-')}", value]
        if str(fields.get("style", "")) == "llama":
            parts.append("--llama")
    for name in ("seq", "gpus", "gpus_per_node", "gpu_memory_gb", "global_batch_tokens",
                 "layout"):
        value = str(fields.get(name, "") or "").strip()
        if value:
            parts += [f"--{name.replace('_', '-')}", value]
    compute_precision, fp8_activations = MATMULS.get(str(fields.get("matmuls", "bf16")),
                                                     ("bf16", False))
    if compute_precision != "bf16":
        parts += ["--precision", compute_precision]
    if fp8_activations:
        parts.append("--fp8-activations")
    flag = TP_OVERLAP.get(str(fields.get("tp_overlap", "none")), ({}, None))[1]
    if flag:
        parts.append(flag)
    return " ".join(parts)

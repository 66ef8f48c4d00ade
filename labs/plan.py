"""Choose a parallel configuration: every layout of N GPUs over data, tensor, pipeline,
context and expert parallelism (labs/labkit/predict/planner/), with a ZeRO stage, a micro-batch
size, a pipeline schedule and a recomputation, kept if it fits in GPU memory and ranked by
predicted step time. The command line of labkit.predict.planner; the model is described there.

Memory per GPU: the fullest pipeline stage's mixed-precision Adam states, sharded by the
ZeRO stage over the ranks holding the same weights, its activations (Korthikanti et al.,
2022) for the micro-batches the schedule keeps in flight, and the last stage's logits.
Step time: compute, the pipeline's idle time, recomputation's extra forward, and what the
tensor-, pipeline-, data-, context- and expert-parallel traffic leaves exposed. Everything
is a model: it ranks configurations and shows where time goes; it does not replace
measuring the best few.

Launch lines (from the repository root):
  a 70B model on 256 H100s:  python labs/plan.py --model llama3-70b --gpus 256 \\
                               --global-batch-tokens 4M
  a shape of your own:       python labs/plan.py --layers 80 --hidden 8192 --heads 64 \\
                               --seq 4096 --vocab 128256 --gpus 256
  from a parameter count:    python labs/plan.py --params 13B --gpus 64
  one layout, and its rank:  python labs/plan.py --model llama3-405b --gpus 16384 \\
                               --global-batch-tokens 16M --layout tp=8,pp=16,dp=128
  a mixture of experts:      python labs/plan.py --model deepseek-v3 --gpus 2048 \\
                               --ep 1,8,64 --global-batch-tokens 60M --json
  in FP8, as DeepSeek-V3 ran:  python labs/plan.py --model deepseek-v3 --gpus 2048 \\
                               --ep 64 --global-batch-tokens 60M --precision fp8 \\
                               --fp8-activations

--json prints {model, hardware, settings, global_batch_tokens, configurations}: the
configurations fastest first, each {dp, tp, pp, cp, ep, etp (the experts' tensor
parallelism: tp, or 1 where a mixture of experts keeps them whole), chunks, zero, micro_batch,
microbatches, recompute, checkpointing (recompute == full), sequence_parallel,
stage_layers (the layers of each pipeline stage: the planner takes up to two off each end),
chunk_layers when interleaved (the layers of each of the pp x chunks virtual stages, in order,
virtual stage j on stage j mod pp: an end chunk may hold only the embedding or the head),
memory_bytes {params, grads, optimizer, states, activations, logits, total (the tensors), stage,
reserve (the CUDA context's and NCCL's), usable (the GPU's memory less the reserve, what
total must fit in)},
time_s {compute, recompute, bubble, tp, pp, dp, cp, ep, step}, tokens_per_s_per_gpu,
mfu, mfu_with_attention}. With --layout it adds `layout`: that layout's best
configuration's fields plus rank (1 = fastest of all), step_time_s, best_step_time_s and
reason (why it does not fit, else null).
"""

import argparse
import dataclasses
import json
import sys

from labkit.predict import comm_model, hardware, memory_model, planner, precision_model
from labkit.predict.arguments import ArgumentParser, choice_list, fail, positive_int

def parse_tokens(text):
    """'4M' -> 4194304 tokens (binary units, as batch sizes are quoted), '524288'."""
    try:
        value = comm_model.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a token count: {text!r} (a whole number with an optional K, M or G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text}")
    return value


def degrees(text):
    """'1,2,4' or '1-16' (every whole number from 1 to 16) -> [1, 2, 4]."""
    values = set()
    for part in text.split(","):
        low, dash, high = part.partition("-")
        try:
            values.update(range(int(low), int(high) + 1) if dash else [int(low)])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a list of degrees: {text!r} (for example 1,2,4 or 1-8)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"degrees must be at least 1, got {text!r}")
    return sorted(values)


def layout_type(text):
    try:
        return planner.parse_layout(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=__doc__[__doc__.index("Launch lines"):])
    model = parser.add_argument_group("the model (one of --model, --params or a shape)")
    model.add_argument("--model", choices=sorted(planner.PRESETS),
                       help="a published shape (labkit.predict.planner.PRESETS, with sources)")
    model.add_argument("--params", help="parameter count (7B, 350M): a GPT-3-like shape")
    for name in ("layers", "hidden", "heads", "vocab"):
        model.add_argument(f"--{name}", type=positive_int, help=f"model {name}")
    model.add_argument("--seq", type=positive_int, help="sequence length (default: the "
                       "preset's, else 2048)")
    model.add_argument("--kv-heads", type=positive_int, help="key-value heads (default: --heads)")
    model.add_argument("--ffn-hidden", type=positive_int, help="MLP width (default 4 x hidden)")
    model.add_argument("--llama", action="store_true",
                       help="Llama-style layers: SwiGLU MLP, RMSNorm, no biases")
    model.add_argument("--experts", type=positive_int, help="routed experts per MoE layer")
    model.add_argument("--top-k", type=positive_int, help="experts per token")
    model.add_argument("--expert-hidden", type=positive_int, help="an expert's MLP width")
    model.add_argument("--shared-experts", type=int, default=0, help="experts every token uses")
    model.add_argument("--dense-layers", type=int, default=0,
                       help="first layers with a dense MLP instead of experts")
    run = parser.add_argument_group("the cluster and the run")
    run.add_argument("--gpus", type=positive_int, required=True, help="GPUs, N")
    run.add_argument("--gpus-per-node", type=positive_int, default=hardware.GPUS_PER_NODE)
    run.add_argument("--gpu-memory-gb", type=positive_float, default=80.0,
                     help="memory per GPU, GB (1e9 bytes)")
    run.add_argument("--global-batch-tokens", type=parse_tokens, default=parse_tokens("4M"),
                     help="tokens per step (4M = 4 x 2^20); a whole number of sequences")
    run.add_argument("--peak-tflops", type=positive_float,
                     default=hardware.H100_BF16_FLOPS / 1e12,
                     help="dense 16-bit peak per GPU (default: H100 SXM)")
    run.add_argument("--mfu", type=positive_float, default=planner.COMPUTE_EFFICIENCY,
                     help="fraction of the peak the computation runs at when nothing "
                          f"waits (default {planner.COMPUTE_EFFICIENCY}, an assumption)")
    run.add_argument("--nvlink-gb-s", type=positive_float, default=hardware.NVLINK[1] / 1e9,
                     help="bandwidth inside a node per GPU, GB/s (default: H100 NVLink)")
    run.add_argument("--network-gb-s", type=positive_float, default=hardware.NIC[1] / 1e9,
                     help="bandwidth between nodes per GPU, GB/s (default: 400 Gb/s NDR)")
    choose = parser.add_argument_group("what to consider")
    choose.add_argument("--zero", type=choice_list(memory_model.STRATEGIES),
                        default=list(memory_model.STRATEGIES),
                        help="ZeRO stages to consider, comma-separated (ddp: none)")
    choose.add_argument("--cp", type=degrees, default=[1],
                        help="context-parallel degrees to consider (1,2,4 or 1-16)")
    choose.add_argument("--ep", type=degrees, default=None,
                        help="expert-parallel degrees (default: 1 for dense models, every "
                             "power of two up to the experts for MoE)")
    choose.add_argument("--recompute", choices=("none", "selective", "full", "auto"),
                        default="auto", help="activation recomputation (auto: the "
                        "cheapest that fits, for each configuration)")
    choose.add_argument("--flash-attention", action=argparse.BooleanOptionalAction,
                        default=True, help="a fused attention that keeps no s x s matrix")
    choose.add_argument("--tp-overlap", type=fraction, default=planner.TP_OVERLAP,
                        help="fraction of tensor-parallel traffic hidden by compute "
                             "(asynchronous TP; default 0)")
    choose.add_argument("--tp-comm-overlap", action="store_true",
                        help="each tensor-parallel all-gather and reduce-scatter pipelined "
                             "with its linear layer's product, only what outlasts it exposed "
                             "(Megatron-LM's --tp-comm-overlap)")
    choose.add_argument("--torch-tp", action="store_true",
                        help="torch's tensor parallelism (DTensor's, as torchtitan applies "
                             "it): eight collectives a layer, the gathered inputs kept")
    choose.add_argument("--async-tp", action="store_true",
                        help="torch's asynchronous tensor parallelism (torchtitan's "
                             "enable_async_tensor_parallel): six of its eight collectives a "
                             "layer fused with their products, only what outlasts them exposed; "
                             "the two backward reduce-scatters whole")
    choose.add_argument("--ep-overlap", action="store_true",
                        help="the expert all-to-alls beside another micro-batch's computation, "
                             "hidden as far as it lasts (Megatron-Core's "
                             "--overlap-moe-expert-parallel-comm)")
    choose.add_argument("--precision", choices=precision_model.PLANNER_PRECISIONS,
                        default="bf16", help="the matrix products in bf16, or in FP8 (the "
                        f"layers' linear products {precision_model.FP8_MATMUL_RATIO:.2f}x "
                        "faster, the H100's measured FP8 over bf16 matrix rate, their "
                        "weights gathered in FP8)")
    choose.add_argument("--fp8-activations", action="store_true",
                        help="with --precision fp8: cache the activations for backward as "
                             "DeepSeek-V3 did, most of them in FP8")
    choose.add_argument("--fp32-grads", action="store_true",
                        help="gradients kept in an fp32 buffer, as Megatron-LM does with "
                             "bf16: 18 bytes of states per parameter, not 16")
    choose.add_argument("--grad-reduce", choices=sorted(planner.GRAD_REDUCE_BYTES),
                        default="fp32", help="the precision the data-parallel reductions "
                        "carry gradients in (default fp32, Megatron-LM's with bf16, Llama 3's, "
                        "torchtitan's; bf16 or fp16 where a run reduces in 16 bits)")
    choose.add_argument("--cp-scheme", choices=planner.CP_SCHEMES, default="ring",
                        help="context parallelism as a ring of K and V blocks overlapped "
                             "with attention (Megatron-Core's default), or K and V "
                             "all-gathered, exposed (Llama 3's)")
    choose.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                        default=True, help="sequence parallelism with tensor parallelism "
                        "(--no-sequence-parallel: all-reduces, the layers' inputs whole on "
                        "each rank, as Megatron-LM ran in 2021)")
    choose.add_argument("--pp-async", choices=("auto", "yes", "no"), default="auto",
                        help="the pipeline's sends beside the computation (yes, as Llama 3 "
                             "ran them), one after the other (no), or as Megatron-LM does by "
                             "default: overlapped with the interleaved schedule only (auto)")
    choose.add_argument("--dispatch-bytes", type=int, choices=(1, 2), default=2,
                        help="bytes a value of the tokens sent to their experts (1: FP8, as "
                             "DeepSeek-V3 dispatches; the combine stays 16-bit)")
    choose.add_argument("--rate", choices=planner.RATES, default=planner.Settings.rate,
                        help="the computation's rate: every FLOP at --mfu of the peak (flat), "
                             "or each linear product at its shape's tile- and wave-quantised "
                             "rate under that, or bound by its traffic, and norms, activations "
                             "and the optimizer's step at HBM bandwidth (shape)")
    choose.add_argument("--chunk-price", action="store_true",
                        help="charge each interleaved chunk's sends their latency, and what "
                             "outlasts the chunk's computation, even where they overlap it")
    choose.add_argument("--layout", type=layout_type,
                        help="evaluate one layout, tp=8,pp=16,dp=128[,cp=..,ep=..,etp=..,v=..]")
    parser.add_argument("--top", type=positive_int, default=10, help="configurations printed")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    args.model_shape = model_from_args(args)
    problem = args.model_shape.check()
    if problem:
        fail(problem)
    if args.global_batch_tokens % args.model_shape.seq:
        fail(f"--global-batch-tokens {args.global_batch_tokens} is not a whole number of "
             f"--seq {args.model_shape.seq} sequences")
    if args.fp8_activations and args.precision != "fp8":
        fail("--fp8-activations needs --precision fp8")
    if args.mfu > 1:
        fail(f"--mfu is a fraction of the peak, at most 1, got {args.mfu}")
    if args.tp_comm_overlap and (args.async_tp or args.torch_tp):
        fail("--tp-comm-overlap is Transformer Engine's tensor parallelism, --torch-tp and "
             "--async-tp torch's: give one")
    if not args.sequence_parallel and (args.tp_comm_overlap or args.async_tp):
        fail("--tp-comm-overlap and --async-tp need sequence parallelism: drop "
             "--no-sequence-parallel")
    if args.ep is None:
        experts = args.model_shape.experts
        args.ep = [e for e in (2 ** i for i in range(12)) if e <= max(1, experts)]
    return args


def model_from_args(args):
    shape = [n for n in ("layers", "hidden", "heads", "vocab") if getattr(args, n) is not None]
    given = [name for name, present in (("--model", args.model), ("--params", args.params),
                                        ("a shape", shape)) if present]
    if len(given) > 1:
        fail(f"give one of --model, --params or a shape (--layers --hidden --heads --vocab), "
             f"not both {given[0]} and {given[1]}")
    moe = {"experts": args.experts or 0, "top_k": args.top_k or 0,
           "expert_hidden": args.expert_hidden or 0, "shared_experts": args.shared_experts,
           "dense_layers": args.dense_layers}
    if args.model:
        model = planner.PRESETS[args.model]
        return model if args.seq is None else dataclasses.replace(model, seq=args.seq)
    seq = args.seq or 2048
    if args.params is not None:
        try:
            count = memory_model.parse_count(args.params)
        except ValueError as error:
            fail(f"--params: {error}")
        return planner.shape_from_params(count, seq)
    if len(shape) < 4:
        fail("give --model NAME, --params P, or a whole model shape: --layers --hidden "
             "--heads --vocab")
    return planner.Model(args.layers, args.hidden, args.heads, seq, args.vocab,
                         ffn_hidden=args.ffn_hidden or 0, kv_heads=args.kv_heads or 0,
                         gpt=not args.llama, **moe)


def settings_from_args(args):
    return planner.Settings(
        global_batch_tokens=args.global_batch_tokens, mfu=args.mfu, tp_overlap=args.tp_overlap,
        tp_comm_overlap=args.tp_comm_overlap, async_tp=args.async_tp,
        torch_tp=args.torch_tp, ep_overlap=args.ep_overlap,
        flash_attention=args.flash_attention, zero=tuple(args.zero),
        precision=args.precision, fp8_activations=args.fp8_activations,
        states="fp32_grads" if args.fp32_grads else "mixed", grad_reduce=args.grad_reduce,
        cp_scheme=args.cp_scheme, sequence_parallel=args.sequence_parallel,
        pp_async={"auto": None, "yes": True, "no": False}[args.pp_async],
        dispatch_bytes=args.dispatch_bytes, rate=args.rate, chunk_price=args.chunk_price,
        recompute=planner.RECOMPUTE if args.recompute == "auto" else (args.recompute,))


def hardware_from_args(args):
    return planner.Hardware(args.gpus, args.gpus_per_node, args.gpu_memory_gb,
                            args.peak_tflops, args.nvlink_gb_s, args.network_gb_s)


def run(args):
    """{model, hardware, settings, global_batch_tokens, configurations[, layout]}."""
    model, settings, hw = (args.model_shape, settings_from_args(args),
                           hardware_from_args(args))
    found = planner.plan(model, settings, hw, cp=args.cp, ep=args.ep)
    for c in found:
        c["checkpointing"] = c["recompute"] == "full"
    result = {"model": {**dataclasses.asdict(model), "params": model.params(),
                        "active_params": model.active_params()},
              "hardware": dataclasses.asdict(hw),
              "settings": {k: v for k, v in dataclasses.asdict(settings).items()
                           if k != "global_batch_tokens"},
              "global_batch_tokens": args.global_batch_tokens,
              "configurations": found}
    if args.layout:
        result["layout"] = planner.rank_layout(model, args.layout, settings, hw, found)
    return result


def describe(c, experts):
    """One configuration's line of the table; etp only for a mixture of experts."""
    t = c["time_s"]
    etp = c["etp"] if experts else "-"
    return (f"{c['dp']:>5} {c['tp']:>3} {c['pp']:>3} {c['cp']:>3} {c['ep']:>3} {etp:>3} "
            f"{c['chunks']:>2} {c['zero']:>5} {c['micro_batch']:>2} {c['microbatches']:>4} "
            f"{c['recompute']:>9} {c['memory_bytes']['total'] / 1e9:>6.1f} "
            f"{t['step']:>7.2f} {t['compute'] + t['recompute']:>7.2f} {t['bubble']:>6.2f} "
            f"{t['tp'] + t['pp'] + t['dp'] + t['cp'] + t['ep']:>6.2f} {c['mfu']:>5.1%}")


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    model, found = args.model_shape, result["configurations"]
    active = (f", {model.active_params() / 1e9:.1f} B active" if model.experts else "")
    print(f"{model.params() / 1e9:.1f} B parameters{active} ({model.layers} layers, hidden "
          f"{model.hidden}, {model.heads} heads, seq {model.seq}, vocab {model.vocab}) on "
          f"{args.gpus} GPUs ({args.gpus_per_node} per node, {args.gpu_memory_gb:g} GB), "
          f"{args.global_batch_tokens:,} tokens per step")
    header = (f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'etp':>3} {'v':>2} {'zero':>5} "
              f"{'b':>2} {'m':>4} {'recompute':>9} {'GB/GPU':>6} {'step s':>7} "
              f"{'compute':>7} {'bubble':>6} {'comm':>6} {'MFU':>5}")
    if found:
        print(f"{len(found)} configurations fit; the fastest {min(args.top, len(found))}:")
        print(header)
        for c in found[:args.top]:
            print(describe(c, model.experts))
    else:
        print("no configuration fits: more GPUs, more memory per GPU, or a smaller batch")
    if args.layout:
        mine = result["layout"]
        if mine["reason"]:
            print(f"layout {args.layout}: does not fit: {mine['reason']}")
        else:
            print(f"layout: rank {mine['rank']} of {len(found)}, "
                  f"{mine['step_time_s'] / mine['best_step_time_s'] - 1:+.1%} against the best")
            print(header)
            print(describe(mine, model.experts))
            print(f"its stages hold {', '.join(map(str, mine['stage_layers']))} layers")
            if "chunk_layers" in mine:
                print(f"in {mine['chunks']} chunks each, the virtual stages in order hold "
                      f"{', '.join(map(str, mine['chunk_layers']))}")
    if not found:
        sys.exit(1)


if __name__ == "__main__":
    main()

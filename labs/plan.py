"""Choose a parallel configuration: every dp x pp x tp layout of N GPUs (tp dividing the
node), with a ZeRO stage, a micro-batch size and activation checkpointing, kept if it fits
in GPU memory and ranked by predicted step time.

Memory per GPU comes from memory_model.config_bytes_per_gpu, the memory calculator's own
function (labs/memory.py predict --tp --pp ...): mixed-precision Adam states sharded over
dp by the ZeRO stage, the fullest pipeline stage's layers split tp ways (sequence
parallelism on whenever tp > 1), and the activations of the micro-batches 1F1B keeps in
flight on it. Step time is the sum of:

  compute    6 x params FLOPs per token (8 with checkpointing, which runs each forward
             twice), spread over the N GPUs at --mfu of --peak-tflops
  bubble     compute x (p - 1) / m: 1F1B's idle fill and drain
  tp         the tensor-parallel collectives of the slowest stage, with sequence
             parallelism (comm_model.tensor_parallel_collectives, the function the lab's
             counts are checked against): per layer and micro-batch 4 all-gathers and 4
             reduce-scatters of b s h 16-bit values forward and backward and 2 all-gathers
             of the inputs again (10 collectives; checkpointing repeats the forward's 4),
             the embedding's and head's, the loss's; on NVLink (tp stays inside a node),
             not overlapped
  pp         per micro-batch, a b s h activation forward and its gradient back, on the
             network when the stages span nodes, not overlapped
  dp         the data-parallel collectives of the stage's 16-bit parameters
             (comm_model.data_parallel_step_collectives: one reduction per step for DDP
             and ZeRO-1, one per micro-batch for ZeRO-2, and ZeRO-3's gathers of every
             layer for every micro-batch, each with its ring latency), on the network
             when the group spans nodes; hidden behind the last micro-batch's backward
             (DDP, ZeRO-1), every backward (ZeRO-2) or all of the compute (ZeRO-3)
  (comm_model's alpha-beta costs, hardware.py's links). Everything is a model: it ranks
configurations and shows where time goes; it does not replace measuring a few of them.

Launch lines (from the repository root):
  a 70B model on 256 H100s:  python labs/plan.py --layers 80 --hidden 8192 --heads 64 \\
                               --seq 4096 --vocab 128256 --gpus 256 --global-batch-tokens 4M
  from a parameter count:    python labs/plan.py --params 13B --gpus 64
  as JSON:                   python labs/plan.py --params 13B --gpus 64 --json

--json prints the feasible configurations as a list sorted by predicted step time, each
{dp, pp, tp, zero, micro_batch, microbatches, checkpointing, sequence_parallel,
memory_bytes {params, grads, optimizer, states, activations, total, stage}, time_s
{compute, bubble, tp, pp, dp, step}, tokens_per_s_per_gpu, mfu}, after a header
{model, hardware, global_batch_tokens}.
"""

import argparse
import functools
import json
import math
import sys
from collections import Counter

from labkit import comm_model, hardware, memory_model, time_model
from labkit.distenv import choice_list, fail, positive_int
from labkit.transformer import Shape

MICRO_BATCH_SIZES = (1, 2, 4, 8)
VALUE_BYTES = 2          # bf16 activations and gradients on the wire
ASPECT = 128             # hidden / layers of GPT-3's models: a shape from --params alone
# The fraction of the dense peak the computation itself runs at, nothing waiting: large
# bf16 matmuls reach well above it, attention, norms and elementwise kernels well below.
# An assumption, not a measurement: vary it with --mfu. The achieved MFU the planner
# reports is lower, since the bubble and exposed communication come on top.
COMPUTE_EFFICIENCY = 0.55
HEAD_DIM = 128


def shape_from_params(params, seq, vocab):
    """A GPT-3-like shape of about `params` parameters: hidden = 128 x layers, heads of
    128, hidden a multiple of 128 (Brown et al., 2020, Table 2.1 keeps hidden / layers
    near 128 for the larger models)."""
    hidden = max(HEAD_DIM, round((ASPECT * params / 12) ** (1 / 3) / HEAD_DIM) * HEAD_DIM)
    layers = max(1, round((params - (2 * vocab + seq) * hidden) / (12 * hidden ** 2)))
    return Shape(layers=layers, hidden=hidden, heads=hidden // HEAD_DIM, seq=seq, vocab=vocab)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def links(dp, pp, tp, args):
    """(alpha, beta) of the link each dimension's traffic crosses, with ranks placed tp
    innermost: a group inside one node uses NVLink, one that spans nodes the network."""
    nvlink = (hardware.NVLINK[0], args.nvlink_gb_s * 1e9)
    network = (hardware.NIC[0], args.network_gb_s * 1e9)
    # a group of `span` consecutive ranks starting at a multiple of span stays in a node
    # when it divides the node
    inside = lambda span: args.gpus_per_node % span == 0  # noqa: E731
    return {"tp": nvlink if inside(tp) else network,
            "pp": nvlink if inside(tp * pp) else network,
            "dp": nvlink if inside(tp * pp * dp) else network}


def collective_time(op, bytes_, world_size, alpha_s, beta_bytes_per_s):
    """A ring collective's alpha-beta time (comm_model, time_model): all-reduce, or half of
    one for an all-gather or reduce-scatter."""
    if op == "all_reduce":
        return comm_model.allreduce_time(bytes_, world_size, alpha_s, beta_bytes_per_s)
    return time_model.shard_collective_time(bytes_, world_size, alpha_s, beta_bytes_per_s)


def tensor_parallel_plan(shape, config, stage):
    """[(op, elements)] the tensor-parallel collectives one rank of pipeline stage `stage`
    issues in one step of `config`: comm_model.tensor_parallel_collectives for the stage's
    layers (the embedding on the first stage, the head and loss on the last), m
    micro-batches of b sequences, sequence parallelism whenever tp > 1, and each layer's
    forward collectives again under checkpointing. Nothing at tp = 1."""
    if config["tp"] == 1:
        return []
    pp = config["pp"]
    return comm_model.tensor_parallel_collectives(
        memory_model.stage_layers(shape.layers, pp)[stage], shape.seq, config["micro_batch"],
        shape.hidden, config["tp"], sequence_parallel=config["sequence_parallel"],
        embedding=stage == 0, head=stage == pp - 1, microbatches=config["microbatches"],
        recompute=config["checkpointing"])


@functools.lru_cache(maxsize=4096)
def _plan_time(shape, key, stage, alpha_s, beta_bytes_per_s):
    config = dict(key)
    counts = Counter(tensor_parallel_plan(shape, config, stage))
    return sum(count * collective_time(op, VALUE_BYTES * numel, config["tp"], alpha_s,
                                       beta_bytes_per_s)
               for (op, numel), count in counts.items())


def tensor_parallel_time(shape, config, link):
    """Seconds of the slowest stage's tensor-parallel collectives (tensor_parallel_plan),
    each at its ring alpha-beta time on `link`, none overlapped."""
    key = tuple((k, config[k]) for k in ("pp", "tp", "micro_batch", "microbatches",
                                         "checkpointing", "sequence_parallel"))
    return float(max(_plan_time(shape, key, stage, *link) for stage in range(config["pp"])))


def step_time(shape, params, config, args):
    """{compute, bubble, tp, pp, dp, step} seconds of one step of `config`."""
    dp, pp, tp, b, m = (config[k] for k in ("dp", "pp", "tp", "micro_batch", "microbatches"))
    tokens = args.global_batch_tokens
    forward, backward = time_model.compute_time_from_flops(
        params, tokens, args.peak_tflops * 1e12, args.mfu)
    forward, backward = forward / args.gpus, backward / args.gpus
    compute = forward * (2 if config["checkpointing"] else 1) + backward
    link = links(dp, pp, tp, args)
    sbh_bytes = VALUE_BYTES * b * shape.seq * shape.hidden
    layers = math.ceil(shape.layers / pp)
    tp_s = tensor_parallel_time(shape, config, link["tp"])
    alpha, beta = link["pp"]
    pp_s = m * 2 * (alpha + sbh_bytes / beta) if pp > 1 else 0.0
    stage_params = max(memory_model.stage_params_per_rank(
        shape.layers, shape.hidden, shape.vocab, shape.seq, pp, tp, s) for s in range(pp))
    dp_plan = comm_model.data_parallel_step_collectives(config["zero"], stage_params, m, layers)
    dp_s = sum(collective_time(op, VALUE_BYTES * numel, dp, *link["dp"])
               for op, numel in dp_plan) if dp > 1 else 0.0
    # what overlaps it: the last micro-batch's backward for one reduction per step (DDP's
    # buckets, ZeRO-1), every backward for ZeRO-2's per-micro-batch reductions, all of the
    # compute for ZeRO-3's gathers, which are prefetched one unit ahead
    window = {"ddp": backward / m, "zero1": backward / m, "zero2": backward,
              "zero3": compute}[config["zero"]]
    dp_exposed = max(0.0, dp_s - window)
    result = {"compute": compute, "bubble": compute * (pp - 1) / m, "tp": tp_s, "pp": pp_s,
              "dp": dp_exposed}
    result["step"] = sum(result.values())
    return result


def configurations(shape, args):
    """Every (dp, pp, tp, zero, micro-batch, checkpointing) that fits, with its memory
    and time, fastest first."""
    params = memory_model.transformer_params(shape.layers, shape.hidden, shape.vocab, shape.seq)
    sequences = args.global_batch_tokens // shape.seq
    limit = args.gpu_memory_gb * 1e9
    found = []
    for tp in divisors(args.gpus):
        if args.gpus_per_node % tp or shape.heads % tp or shape.vocab % tp:
            continue
        for pp in divisors(args.gpus // tp):
            if pp > shape.layers:
                continue
            dp = args.gpus // (tp * pp)
            if sequences % dp:
                continue
            for b in MICRO_BATCH_SIZES:
                if (sequences // dp) % b:
                    continue
                m = sequences // dp // b
                for zero in args.zero:
                    for checkpointing in (False, True):
                        config = {"dp": dp, "pp": pp, "tp": tp, "zero": zero, "micro_batch": b,
                                  "microbatches": m, "checkpointing": checkpointing,
                                  "sequence_parallel": tp > 1}
                        memory = memory_model.config_bytes_per_gpu(
                            shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab,
                            dp, pp, tp, zero, b, m, "1f1b", tp > 1, checkpointing)
                        if memory["total"] > limit:
                            continue
                        time_s = step_time(shape, params, config, args)
                        found.append({**config, "memory_bytes": memory, "time_s": time_s,
                                      "tokens_per_s_per_gpu":
                                          args.global_batch_tokens / time_s["step"] / args.gpus,
                                      "mfu": 6 * params * args.global_batch_tokens
                                          / (time_s["step"] * args.gpus * args.peak_tflops * 1e12)})
    found.sort(key=lambda c: (c["time_s"]["step"], c["memory_bytes"]["total"]))
    return params, found


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__[__doc__.index("Launch lines"):])
    parser.add_argument("--params", help="parameter count (7B, 350M): a GPT-3-like shape")
    for name in ("layers", "hidden", "heads", "vocab"):
        parser.add_argument(f"--{name}", type=positive_int, help=f"model {name}")
    parser.add_argument("--seq", type=positive_int, default=2048, help="sequence length")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs, N")
    parser.add_argument("--gpus-per-node", type=positive_int, default=hardware.GPUS_PER_NODE)
    parser.add_argument("--gpu-memory-gb", type=positive_float, default=80.0,
                        help="memory per GPU, GB (1e9 bytes)")
    parser.add_argument("--global-batch-tokens", type=parse_tokens, default=parse_tokens("4M"),
                        help="tokens per step (4M = 4 x 2^20); a whole number of sequences")
    parser.add_argument("--peak-tflops", type=positive_float,
                        default=hardware.H100_BF16_FLOPS / 1e12,
                        help="dense 16-bit peak per GPU (default: H100 SXM)")
    parser.add_argument("--mfu", type=positive_float, default=COMPUTE_EFFICIENCY,
                        help="fraction of the peak the computation runs at when nothing "
                             f"waits (default {COMPUTE_EFFICIENCY}, an assumption)")
    parser.add_argument("--nvlink-gb-s", type=positive_float, default=hardware.NVLINK[1] / 1e9,
                        help="bandwidth inside a node per GPU, GB/s (default: H100 NVLink)")
    parser.add_argument("--network-gb-s", type=positive_float, default=hardware.NIC[1] / 1e9,
                        help="bandwidth between nodes per GPU, GB/s (default: 400 Gb/s NDR)")
    parser.add_argument("--zero", type=choice_list(memory_model.STRATEGIES),
                        default=list(memory_model.STRATEGIES),
                        help="ZeRO stages to consider, comma-separated (ddp: none)")
    parser.add_argument("--top", type=positive_int, default=10, help="configurations printed")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    given = [n for n in ("layers", "hidden", "heads", "vocab") if getattr(args, n) is not None]
    if args.params is not None:
        if given:
            fail("give --params or a model shape (--layers --hidden --heads --vocab), not both")
        try:
            params = memory_model.parse_count(args.params)
        except ValueError as error:
            fail(f"--params: {error}")
        args.shape = shape_from_params(params, args.seq, 51200)
    elif len(given) == 4:
        args.shape = Shape(args.layers, args.hidden, args.heads, args.seq, args.vocab)
        problem = args.shape.check()
        if problem:
            fail(problem)
    else:
        fail("give --params P, or a whole model shape: --layers --hidden --heads --vocab")
    if args.global_batch_tokens % args.seq:
        fail(f"--global-batch-tokens {args.global_batch_tokens} is not a whole number of "
             f"--seq {args.seq} sequences")
    if args.mfu > 1:
        fail(f"--mfu is a fraction of the peak, at most 1, got {args.mfu}")
    return args


def main(argv=None):
    args = parse_args(argv)
    shape = args.shape
    params, found = configurations(shape, args)
    header = {"model": {**shape.__dict__, "params": params},
              "hardware": {"gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
                           "gpu_memory_gb": args.gpu_memory_gb, "peak_tflops": args.peak_tflops,
                           "mfu": args.mfu, "nvlink_gb_s": args.nvlink_gb_s,
                           "network_gb_s": args.network_gb_s},
              "global_batch_tokens": args.global_batch_tokens}
    if args.json:
        print(json.dumps({**header, "configurations": found}, indent=1))
        return
    print(f"{params / 1e9:.1f} B parameters ({shape.layers} layers, hidden {shape.hidden}, "
          f"{shape.heads} heads, seq {shape.seq}, vocab {shape.vocab}) on {args.gpus} GPUs "
          f"({args.gpus_per_node} per node, {args.gpu_memory_gb:g} GB), "
          f"{args.global_batch_tokens:,} tokens per step")
    if not found:
        print("no configuration fits: more GPUs, more memory per GPU, or a smaller batch")
        sys.exit(1)
    print(f"{len(found)} configurations fit; the fastest {min(args.top, len(found))}:")
    print(f"{'dp':>4} {'pp':>3} {'tp':>3} {'zero':>5} {'b':>2} {'m':>5} {'ckpt':>4} "
          f"{'GB/GPU':>7} {'step s':>7} {'compute':>8} {'bubble':>7} {'tp':>6} {'pp':>6} "
          f"{'dp':>6} {'MFU':>5}")
    for c in found[:args.top]:
        t = c["time_s"]
        print(f"{c['dp']:>4} {c['pp']:>3} {c['tp']:>3} {c['zero']:>5} {c['micro_batch']:>2} "
              f"{c['microbatches']:>5} {'yes' if c['checkpointing'] else 'no':>4} "
              f"{c['memory_bytes']['total'] / 1e9:>7.1f} {t['step']:>7.2f} {t['compute']:>8.2f} "
              f"{t['bubble']:>7.2f} {t['tp']:>6.2f} {t['pp']:>6.2f} {t['dp']:>6.2f} "
              f"{c['mfu']:>5.1%}")


if __name__ == "__main__":
    main()

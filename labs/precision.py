"""Precision, measured: what bf16, fp16 and FP8 do to memory, to the bytes on the wire and
to the numbers, beside what the cost models predict.

Seven parts, in one launch:
  variants      the course's transformer trained --steps steps with FSDP2 (fully_shard on
                every block, then the root; SGD with momentum) under each precision recipe:
                fp32; bf16_autocast (fp32 weights, torch.autocast casting each op to bf16);
                bf16_params (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32));
                bf16_reduce (gradients reduced in bf16 too); fp8_allgather (torchao's
                float8 linears, their weights cast to float8 before FSDP2's all-gather;
                needs torchao). Each from the same weights, on the same data.
  loss_scaling  the same model, on rank 0 alone, in fp16 autocast, with a loss small
                enough that its gradients fall below fp16's range: without loss scaling,
                and with torch's GradScaler (starting at --init-scale, so that its first
                steps overflow and are skipped while it backs off).
  fp8_gemm      one linear layer of the model's shape (the second MLP matrix: input 4h,
                output h), forward in e4m3 x e4m3 and input gradient in e5m2 x e4m3 with
                torch._scaled_mm (fp32 accumulation, scales from the exact amax), scaled
                per tensor, per row, and per block (1 x B tiles of activations and
                gradients, B x B blocks of weights, as DeepSeek-V3 §3.3.2 cuts them, each
                block's product accumulated in fp32), against fp32, the gradient also in
                e4m3; then on activations whose channels differ in scale, with one
                channel --outlier times the median. On rank 0 alone.
  fp8_scale_pitfalls  a per-tensor scale from an amax of zero, an infinite amax, and a
                stale amax below the tensor's own, each shown failing. On rank 0 alone.
  fp8_delayed_scaling  current scaling (each tensor's own amax) against delayed scaling
                (the largest of an amax history) before, at and after a jump in the data.
  block_scaled  MXFP8 and NVFP4 casts (torchao's, where it loads) and a product of two
                cast operands, against the error model.
  bf16_reduce_error   gradients all-reduced in bf16 by the first n ranks, n = 1 ... N,
                against their exact sum: the error grows with n.

Launch lines (from the repository root):
  laptop, gloo on CPU:  torchrun --standalone --nproc_per_node=4 labs/precision.py --out p4.json
  a world of one:       python labs/precision.py
  GPU box, NCCL:        torchrun --standalone --nproc_per_node=8 labs/precision.py --out p8.json
  two nodes:            torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
                          --rdzv-endpoint=HOST:29500 --rdzv-id=precision labs/precision.py

JSON: variants {name: {state_bytes_per_rank and predicted_state_bytes_per_rank ({params,
grads, optimizer}, rank 0's shards), comm_bytes_per_rank and predicted_comm_bytes_per_rank
(one step, ring volumes), max_param_diff_vs_fp32}, or {error} where fp8_allgather cannot
run here (torchao missing, uneven shards), or {not_run} where torchao fails otherwise};
loss_scaling {fp16_unscaled: {zero_gradient_fraction}, fp16_scaled:
{zero_gradient_fraction, skipped_steps, taken_steps, taken_gradients_finite, final_scale}};
fp8_gemm {tensorwise, rowwise, blockwise: {relative_error and predicted_relative_error ({output, input_grad,
input_grad_e4m3}), relative_error_channels and relative_error_with_outlier (of the other
channels' product, under their own scales and under the outlier's),
and where this box's _scaled_mm refused a product and it was emulated, emulated: true and
emulated_because {output or input_grad: the refusal}}, or {not_run} where it failed};
fp8_scale_pitfalls {amax_zero: {nan_fraction, nan_fraction_with_floor}, amax_infinite:
{nan_fraction}, amax_stale: {stale_by, nan_fraction, saturated_fraction, relative_error,
relative_error_current_amax}}; fp8_delayed_scaling {jump_by, steady_steps, amax_history_len,
steady, jump, after: {current, delayed: {relative_error, saturated_fraction}}}; block_scaled
{mxfp8_floor, mxfp8_rceil, nvfp4: {block, scale, bits_per_value, relative_error and
predicted_relative_error ({cast, product})}, or {not_run}}; bf16_reduce_error {n: {relative_error,
predicted_relative_error}}; param_count.
"""

import contextlib
import copy
import logging

import torch
import torch.distributed as dist

from labkit.model.transformer import Shape, Transformer, add_shape_args, shape_from_args
from labkit.parallel.strategies import apply_fsdp, rank_batch, train_step, world_mesh
from labkit.predict import comm_model, memory_model, precision_model
from labkit.runtime import distenv
from labkit.runtime.collectives import CountCollectives

# model
SHAPE = Shape(layers=2, hidden=128, heads=4, seq=32, vocab=256)
BATCH = 4                  # sequences per rank per step
STEPS = 3
LEARNING_RATE, MOMENTUM = 0.05, 0.9
# the three parts
VARIANTS = ("fp32", "bf16_autocast", "bf16_params", "bf16_reduce", "fp8_allgather")
FP8_BLOCK = 128            # DeepSeek-V3's tile and block size
OUTLIER = 1000.0           # the outlier channel over the median channel: LLMs' "massive
                           # activations" are 10^3-10^4 times the median (Sun et al. 2024)
CHANNEL_SPREAD = 1.0       # the channels' scales: exp(N(0, this)), a median of 1
LOSS_SHRINK = 2.0 ** -24   # the loss scaled down until fp16 gradients underflow
INIT_SCALE = 2.0 ** 46     # GradScaler's first scale: too large, on purpose
STALE_BY = 4               # a delayed-scaling amax this many times below the tensor's own
AMAX_HISTORY = 1024        # Transformer Engine's DelayedScaling(amax_history_len=1024)
STEADY_STEPS, JUMP = 16, 16   # steps of N(0, 1) activations, then one JUMP times larger
REDUCE_NUMEL = 1 << 16     # values per rank of the bf16 reduction measured at n = 1 ... N
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (param_dtype, reduce_dtype) of FSDP2's MixedPrecisionPolicy, by variant
POLICIES = {"bf16_params": (torch.bfloat16, torch.float32),
            "bf16_reduce": (torch.bfloat16, torch.bfloat16),
            "fp8_allgather": (torch.bfloat16, torch.float32)}


# ---------------------------------------------------------------- variants (FSDP2)

def convert_to_float8(blocks):
    """torchao's float8 linears in the blocks, their weights gathered in float8 by FSDP2.
    Returns how many parameters that makes FP8 weights. Raises ImportError without
    torchao."""
    # torchao logs, at import, every CUDA-only kernel a CPU build cannot load
    for logger in ("torchao", "torch.utils._pytree"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(blocks, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))
    return sum(m.weight.numel() for m in blocks.modules() if type(m).__name__ == "Float8Linear")


def fsdp_variant(name, initial, env):
    """A copy of `initial` wrapped with FSDP2 as variant `name` says, and how many of its
    parameters are FP8 linear weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    model = copy.deepcopy(initial)
    fp8_numel = convert_to_float8(model.blocks) if name == "fp8_allgather" else 0
    options = {}
    if name in POLICIES:
        param_dtype, reduce_dtype = POLICIES[name]
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                    reduce_dtype=reduce_dtype)
    return apply_fsdp(model, env.device, mesh=world_mesh(env.device, env.group),
                      **options), fp8_numel


def shard_bytes(tensors):
    """Bytes of this rank's shards of `tensors` (DTensors; None counts nothing)."""
    return sum(t.to_local().numel() * t.to_local().element_size()
               for t in tensors if t is not None)


def train_variant(name, initial, shape, args, env):
    """Train variant `name` --steps steps; (model, FP8 numel, rank 0's state bytes, bytes
    the last step sent)."""
    model, fp8_numel = fsdp_variant(name, initial, env)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    counter, grads = comm_model.CollectiveCounter(env.world_size), {}

    def keep_gradient_bytes():   # before the step zeroes them
        grads["bytes"] = shard_bytes(p.grad for p in model.parameters())

    for step in range(args.steps):
        ids, targets = rank_batch(shape, BATCH, args.seed, step, env.rank, env.device)
        last = step == args.steps - 1   # the one counted: every step sends the same
        counting = CountCollectives(counter) if last else contextlib.nullcontext()
        autocast = torch.autocast(env.device.type, dtype=torch.bfloat16,
                                  enabled=name == "bf16_autocast")
        with counting, autocast:
            train_step(model, optimizer, ids, targets,
                       after_backward=keep_gradient_bytes if last else None)
    state = {"params": shard_bytes(model.parameters()), "grads": grads["bytes"],
             "optimizer": sum(t.to_local().numel() * t.to_local().element_size()
                              for s in optimizer.state.values() for t in s.values()
                              if torch.is_tensor(t) and t.dim())}
    return model, fp8_numel, state, counter.sent


def predicted_state(shapes, world_size, name):
    """Rank 0's shards under FSDP2 (memory_model.fsdp2_shard_numel) at the recipe's bytes
    per parameter (memory_model.bytes_per_parameter, SGD with momentum)."""
    numel = sum(memory_model.fsdp2_shard_numel(s, world_size, 0) for s in shapes)
    p, g, k = memory_model.bytes_per_parameter("momentum", name)
    return {"params": p * numel, "grads": g * numel, "optimizer": k * numel}


def predicted_comm(units, fp8_units, world_size, name):
    """One step of FSDP2: every unit gathered twice and reduced once, in the recipe's
    formats (comm_model); FP8 weights also all-reduce their amax, one fp32, before each
    of their two gathers (the scale of torchao's dynamic cast)."""
    total = 0
    for shapes, fp8_shapes in zip(units, fp8_units):
        numel = memory_model.fsdp2_gathered_numel(shapes, world_size)
        fp8 = memory_model.fsdp2_gathered_numel(fp8_shapes, world_size)
        total += comm_model.data_parallel_bytes_per_rank("zero3", numel, world_size,
                                                         precision=name, fp8_numel=fp8)
        total += 2 * len(fp8_shapes) * comm_model.bytes_sent_per_rank("all_reduce", 4,
                                                                      world_size)
    return float(total)


def run_variants(shape, args, env):
    torch.manual_seed(args.seed)
    with torch.device(env.device):   # built where it trains (see distenv's device guard)
        initial = Transformer(shape)
    units = [[tuple(p.shape) for p in unit.parameters()] for unit in initial.units()]
    blocks = set(initial.blocks)
    linear_weights = [[tuple(m.weight.shape) for m in unit.modules()
                       if isinstance(m, torch.nn.Linear)] if unit in blocks else []
                      for unit in initial.units()]
    shapes = [s for unit in units for s in unit]
    uneven = sorted({rows for unit in linear_weights for rows, _ in unit
                     if rows % env.world_size})

    def measure(name):
        """Variant `name`'s result, and its trained weights, whole."""
        model, fp8_numel, state, sent = train_variant(name, initial, shape, args, env)
        full = [p.full_tensor().detach().float() for p in model.parameters()]
        fp8_units = linear_weights if fp8_numel else [[] for _ in units]
        return {
            "state_bytes_per_rank": state,
            "predicted_state_bytes_per_rank": predicted_state(shapes, env.world_size, name),
            "comm_bytes_per_rank": float(sent),
            "predicted_comm_bytes_per_rank": predicted_comm(units, fp8_units,
                                                            env.world_size, name),
            "max_param_diff_vs_fp32": max((a - b).abs().max().item()
                                          for a, b in zip(full, reference or full)),
        }, full

    def fp8_allgather():
        try:
            return measure("fp8_allgather")[0]
        except ImportError as error:   # torchao missing: said in the JSON, not hidden
            return {"error": f"{type(error).__name__}: {error}"}

    results, reference = {}, None
    for name in args.variants:
        if name != "fp8_allgather":
            # torch's own API, there since torch 2.6: a failure is the lab's, and ends it
            results[name], full = measure(name)
            reference = reference or full   # fp32's: parse_args puts it first
        elif uneven:
            # seen with torchao 0.18 on gloo: FSDP2 pads the uneven shards, and the float8
            # all-gather then receives more bytes than it expects, which aborts the process
            results[name] = {"error": f"FSDP2 pads the float8 weights' rows "
                                      f"({', '.join(map(str, uneven))}) to a multiple of "
                                      f"{env.world_size}, which torchao's float8 all-gather "
                                      f"does not handle"}
        else:
            # torchao is built for one torch: against another it can fail in other ways
            # than ImportError as it loads or converts the model, on every rank alike and
            # before any collective. try_variant records why ({"not_run": ...}), and the
            # other variants keep their results.
            results[name] = distenv.try_variant(env, name, fp8_allgather)
    return results, sum(p.numel() for p in initial.parameters())


# ---------------------------------------------------------------- loss scaling (fp16)

def fp16_run(shape, args, env, scaler):
    """--steps steps in fp16 autocast on rank 0's data, the loss shrunk by LOSS_SHRINK;
    the share of the last step's gradient values of the blocks' matrices that are exactly
    0, and how many steps the scaler skipped."""
    torch.manual_seed(args.seed)
    with torch.device(env.device):
        model = Transformer(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    zero_share, skipped, finite = 0.0, 0, True
    for step in range(args.steps):
        ids, targets = rank_batch(shape, BATCH, args.seed, step, env.rank, env.device)
        with torch.autocast(env.device.type, dtype=torch.float16):
            loss = LOSS_SHRINK * torch.nn.functional.cross_entropy(
                model(ids).flatten(0, 1), targets.flatten())
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            backed_off = scaler.get_scale() < scale   # it backed off: the step was skipped
            skipped += backed_off
            if not backed_off:   # a step taken: its (unscaled) gradients must be finite
                finite = finite and all(torch.isfinite(p.grad).all().item()
                                        for p in model.parameters() if p.grad is not None)
        # the blocks' matrices: every value of theirs gets a gradient (an embedding's
        # rows of tokens not in the batch get none, underflow or not)
        grads = torch.cat([p.grad.flatten() for p in model.blocks.parameters()
                           if p.grad is not None and p.dim() == 2])
        zero_share = (grads == 0).float().mean().item()
        optimizer.zero_grad(set_to_none=False)
    return zero_share, skipped, finite


def run_loss_scaling(shape, args, env):
    unscaled, _, _ = fp16_run(shape, args, env, None)
    scaler = torch.amp.GradScaler(env.device.type, init_scale=args.init_scale)
    scaled, skipped, finite = fp16_run(shape, args, env, scaler)
    return {"fp16_unscaled": {"zero_gradient_fraction": unscaled},
            "fp16_scaled": {"zero_gradient_fraction": scaled, "skipped_steps": int(skipped),
                            "taken_steps": args.steps - int(skipped),
                            "taken_gradients_finite": bool(finite),
                            "final_scale": scaler.get_scale()}}


# ---------------------------------------------------------------- FP8 matrix products

def scales(x, fmt, rows, cols):
    """One scale per `rows` x `cols` block of x (a block as large as x: per tensor), each
    the block's largest magnitude over the format's largest value, expanded to x's shape."""
    r, c = x.shape
    blocks = x.abs().reshape(r // rows, rows, c // cols, cols).amax(dim=(1, 3))
    blocks = blocks.clamp(min=torch.finfo(torch.float32).tiny) / precision_model.FORMATS[fmt].max
    return blocks.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def scaled_mm(qa, qb, scale_a, scale_b):
    """torch._scaled_mm(qa, qb) in fp32, and None; or, where this box's kernel refuses the
    combination, the same product emulated, and the refusal's first line. Row-wise scales
    on CUDA builds whose cuBLAS is older than 12.9 (and on sm89) go to a CUTLASS kernel
    that refused an fp32 output until pytorch#187569, and refuses an e5m2 second operand
    (an e5m2 first one it takes: the input gradient's product puts dy first); cuBLASLt
    refuses e5m2 x e5m2. The emulation computes what the kernel does up to the order of
    its fp32 additions: each product of two FP8 values is exact in fp32, and the scales
    multiply the sum."""
    try:
        return torch._scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.float32), None
    except (RuntimeError, ValueError) as refusal:   # TORCH_CHECK, TORCH_CHECK_VALUE
        lines = str(refusal).strip().splitlines()
        reason = f"{type(refusal).__name__}: {lines[0] if lines else ''}"
        return (qa.float() @ qb.float()) * scale_a * scale_b, reason


def fp8_matmul(a, b, a_fmt, b_fmt, granularity, block):
    """a @ b (a: M x K, b: K x N) with both cast to FP8 and multiplied by torch._scaled_mm
    (scaled_mm), fp32 out. tensorwise: a scale per tensor; rowwise: per row of a and per
    column of b (along the contraction); blockwise: 1 x block tiles of a and block x block
    blocks of b, one _scaled_mm per block of K, its partial product accumulated in fp32.
    Returns the product, and why it was emulated (None: the kernel ran)."""
    (m, k), n = a.shape, b.shape[1]
    shapes = {"tensorwise": ((m, k), (k, n)), "rowwise": ((1, k), (k, 1)),
              "blockwise": ((1, block), (block, block))}[granularity]
    sa, sb = scales(a, a_fmt, *shapes[0]), scales(b, b_fmt, *shapes[1])
    qa = (a / sa).to(TORCH_FP8[a_fmt])
    qb = (b / sb).to(TORCH_FP8[b_fmt])
    chunks = range(0, k, block) if granularity == "blockwise" else [0]
    width = block if granularity == "blockwise" else k
    out, emulated = torch.zeros(m, n, device=a.device), None
    for start in chunks:
        part = slice(start, start + width)
        if granularity == "tensorwise":
            # one-element fp32 scales: what _scaled_mm reads as per tensor (an M x 1 column
            # of equal values is per row to it, which some of its kernels refuse)
            row_scale, col_scale = sa[:1, :1], sb[:1, :1]
        else:   # one scale per row of a and per column of b within this block of K
            row_scale, col_scale = sa[:, start:start + 1], sb[start:start + 1, :]
        # _scaled_mm wants its second operand column-major: the transpose of a contiguous one
        product, refused = scaled_mm(qa[:, part].contiguous(), qb[part, :].t().contiguous().t(),
                                     row_scale.contiguous(), col_scale.contiguous())
        out += product
        emulated = emulated or refused
    return out, emulated


def fp8_matmul_inputs(x, fmt, granularity, block):
    """x as fp8_matmul sees it, cast to `fmt` with its granularity's scales (rows of x
    along the contraction: per row, or 1 x block tiles) and back to fp32."""
    rows, cols = {"tensorwise": x.shape, "rowwise": (1, x.shape[1]),
                  "blockwise": (1, block)}[granularity]
    s = scales(x, fmt, rows, cols)
    return (x / s).to(TORCH_FP8[fmt]).float() * s


def relative_error(value, exact):
    return ((value - exact).norm() / exact.norm()).item()


def cast_with_amax(x, amax, fmt="e4m3"):
    """x cast to `fmt` and back with the one scale an amax gives: amax / the format's
    largest value, no floor and no check (what the pitfalls below break)."""
    scale = amax / precision_model.FORMATS[fmt].max
    return (x / scale).to(TORCH_FP8[fmt]).float() * scale


def nan_fraction(x):
    return torch.isnan(x).float().mean().item()


def run_scale_pitfalls(shape, args, env):
    """A per-tensor scale computed from a bad amax, each shown failing on an activation of
    the model's shape: an amax of zero (a tensor of zeros: 0 / 0 is NaN; the floor that
    scales() and torchao put under the amax keeps it finite); an infinite amax (one value
    overflowed upstream: every other value is divided by infinity, then 0 x inf is NaN);
    and a stale amax (delayed scaling's, from earlier steps) STALE_BY times below the
    tensor's own, so that the values above it are cast to e4m3's largest value (torch
    2.12 on; earlier versions return NaN for them, counted in nan_fraction)."""
    generator = distenv.generator(args.seed, "fp8 scales")
    x = torch.randn(BATCH * shape.seq, 4 * shape.hidden, generator=generator,
                    device="cpu").to(env.device)   # host-drawn, as in run_fp8_gemm
    zeros = torch.zeros_like(x)
    floor = torch.finfo(torch.float32).tiny
    overflowed = x.clone()
    overflowed[0, 0] = float("inf")
    amax = x.abs().max()
    stale = cast_with_amax(x, amax / STALE_BY)
    scaled = x / (amax / STALE_BY / precision_model.FORMATS["e4m3"].max)
    return {
        "amax_zero": {"nan_fraction": nan_fraction(cast_with_amax(zeros, zeros.abs().max())),
                      "nan_fraction_with_floor": nan_fraction(
                          cast_with_amax(zeros, zeros.abs().max().clamp(min=floor)))},
        "amax_infinite": {"nan_fraction": nan_fraction(
            cast_with_amax(overflowed, overflowed.abs().max()))},
        "amax_stale": {"stale_by": STALE_BY, "nan_fraction": nan_fraction(stale),
                       "saturated_fraction": (scaled.abs() >= precision_model.FORMATS[
                           "e4m3"].max).float().mean().item(),
                       "relative_error": relative_error(stale, x),
                       "relative_error_current_amax": relative_error(
                           cast_with_amax(x, amax), x)},
    }


def run_delayed_scaling(shape, args, env):
    """Current against delayed scaling, per tensor, e4m3: STEADY_STEPS activations drawn
    from N(0, 1), then one JUMP times larger (a spike), then one back at N(0, 1).
    Current scaling (torchao's float8, DeepSeek-V3) takes each tensor's own amax; delayed
    scaling (Transformer Engine's DelayedScaling, its default amax_compute_algo "max")
    takes the largest amax of the last AMAX_HISTORY steps before this one, and records
    this one's after the cast. At each of the three moments: the relative error of the
    cast and the share of values clipped at 448."""
    generator = distenv.generator(args.seed, "fp8 delayed")
    largest = precision_model.FORMATS["e4m3"].max
    history, out = [], {}
    for step in range(STEADY_STEPS + 2):
        x = torch.randn(BATCH * shape.seq, 4 * shape.hidden, generator=generator,
                        device="cpu").to(env.device)
        if step == STEADY_STEPS:
            x = x * JUMP
        amax = x.abs().max()
        moment = {STEADY_STEPS - 1: "steady", STEADY_STEPS: "jump",
                  STEADY_STEPS + 1: "after"}.get(step)
        if moment:
            out[moment] = {}
            for name, used in (("current", amax), ("delayed", max(history))):
                out[moment][name] = {
                    "relative_error": relative_error(cast_with_amax(x, used), x),
                    "saturated_fraction": (x.abs() > used).float().mean().item()}
        history = (history + [amax])[-AMAX_HISTORY:]
    return {"jump_by": JUMP, "steady_steps": STEADY_STEPS, "amax_history_len": AMAX_HISTORY,
            **out}


def run_block_scaled(shape, args, env):
    """MXFP8 and NVFP4 (precision_model.BLOCK_SCALED) as torchao 0.18 casts them
    (MXTensor.to_mx, NVFP4Tensor.to_nvfp4, which run on CPU), read back in fp32: the cast's
    relative error and that of the product of two cast operands (the model's second MLP
    matrix on N(0, 1) activations, the products exact and summed in fp32, as a block-scaled
    tensor core accumulates; torchao's fused products need a Blackwell GPU), beside the
    model. MXFP8 twice: torchao's default scale, 2^floor(log2 amax) / 2^8 (the OCP spec's,
    which puts a block's largest value in [256, 512) and clips what passes 448), and RCEIL,
    the smallest power of two that keeps the block within 448 (cuBLAS's). Each a variant of
    its own: torchao missing or failing says why."""
    generator = distenv.generator(args.seed, "block scaled")
    h = shape.hidden
    x = torch.randn(BATCH * shape.seq, 4 * h, generator=generator, device="cpu").to(env.device)
    w = (torch.randn(h, 4 * h, generator=generator, device="cpu") / (4 * h) ** 0.5).to(
        env.device)

    def measure(fmt, mode=None):
        for logger in ("torchao", "torch.utils._pytree"):   # CUDA-only kernels, at import
            logging.getLogger(logger).setLevel(logging.ERROR)
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
        spec = precision_model.BLOCK_SCALED[fmt]
        if fmt == "mxfp8":
            def cast(t):
                return MXTensor.to_mx(t, torch.float8_e4m3fn, block_size=spec.block,
                                      scaling_mode=getattr(ScaleCalculationMode, mode)
                                      ).dequantize(torch.float32)
            a, b = x, w
        else:   # NVFP4Tensor takes bf16: the exact values are the bf16 ones
            a, b = x.bfloat16().float(), w.bfloat16().float()

            def cast(t):
                return NVFP4Tensor.to_nvfp4(t.bfloat16(), block_size=spec.block
                                            ).dequantize(torch.float32)
        # torchao's NVFP4 cast makes its constants without a device: on the input's
        with torch.device(env.device):
            qa, qb = cast(a), cast(b)
        return {"block": spec.block, "scale": spec.scale,
                "bits_per_value": spec.bits_per_value(a.numel()),
                "relative_error": {"cast": relative_error(qa, a),
                                   "product": relative_error(qa @ qb.t(), a @ b.t())},
                "predicted_relative_error": {
                    "cast": precision_model.normwise_rounding_rms(fmt),
                    "product": precision_model.gemm_relative_error(fmt, fmt)}}

    return {name: distenv.try_variant(env, name, lambda: measure(*parts), local=True)
            for name, parts in (("mxfp8_floor", ("mxfp8", "FLOOR")),
                                ("mxfp8_rceil", ("mxfp8", "RCEIL")),
                                ("nvfp4", ("nvfp4",)))}


# ---------------------------------------------------------------- gradients summed in bf16

def run_reduce_error(args, env):
    """The error that reducing gradients in bf16 adds, as the ranks grow: REDUCE_NUMEL
    gradient-like values per rank (zero mean, already bf16) all-reduced in bf16 by the first
    n ranks, n = 1 ... world, against the same values all-reduced in fp64 (exact), beside
    precision_model.sum_relative_error (a ring's additions, each partial sum rounded).
    Every rank creates every group; the ranks past n sit that one out."""
    groups = {n: dist.new_group(list(range(n))) for n in range(env.world_size, 0, -1)}
    values = torch.randn(REDUCE_NUMEL, device="cpu", generator=distenv.generator(
        args.seed, "bf16 reduce", env.rank)).to(torch.bfloat16).to(env.device)
    results = {}
    for n, group in groups.items():
        if env.rank >= n:
            continue
        summed, exact = values.clone(), values.double()
        dist.all_reduce(summed, group=group)
        dist.all_reduce(exact, group=group)
        results[str(n)] = {"relative_error": relative_error(summed.double(), exact),
                           "predicted_relative_error": precision_model.sum_relative_error(
                               "bf16", n)}
    return dict(sorted(results.items(), key=lambda item: int(item[0])))


def run_fp8_gemm(shape, args, env):
    """The model's second MLP matrix (input 4h, output h): forward y = x W^T and input
    gradient dx = dy W (dy in e5m2, and in e4m3), per granularity, against fp32; then on
    activations whose channels differ in scale (log-normal), alone and with one channel
    --outlier times the median, the error of what the other channels contribute (the
    outlier's own term would dominate the output and hide what its scale does to them).
    Each granularity is a variant of its own (distenv.try_variant): one that fails says
    why, {"not_run": ...}, and the others keep their results. A product the kernel refuses
    is emulated (scaled_mm): its result says so, "emulated": true, and why, by product."""
    generator = distenv.generator(args.seed, "fp8 gemm")
    tokens, h = BATCH * shape.seq, shape.hidden
    # drawn on the host from a CPU generator (the same values on every device), then moved
    x = torch.randn(tokens, 4 * h, generator=generator, device="cpu").to(env.device)
    w = (torch.randn(h, 4 * h, generator=generator, device="cpu") / (4 * h) ** 0.5).to(
        env.device)
    dy = (torch.randn(tokens, h, generator=generator, device="cpu") * 1e-3).to(
        env.device)   # small values
    # activations as a transformer's are: each channel at a scale of its own (log-normal,
    # median 1), and one channel --outlier times the median, in every token
    channel_scale = torch.exp(CHANNEL_SPREAD * torch.randn(4 * h, generator=generator,
                                                           device="cpu")).to(env.device)
    channels = x * channel_scale
    spiked = channels.clone()
    spiked[:, 7] = x[:, 7] * args.outlier
    others = torch.arange(4 * h, device=env.device) != 7
    predicted = {"output": precision_model.gemm_relative_error("e4m3", "e4m3"),
                 "input_grad": precision_model.gemm_relative_error("e5m2", "e4m3"),
                 "input_grad_e4m3": precision_model.gemm_relative_error("e4m3", "e4m3")}

    def rest(value):   # the columns of every channel but the outlier's
        return value[:, others]

    def measure(granularity):
        out, out_emulated = fp8_matmul(x, w.t().contiguous(), "e4m3", "e4m3", granularity,
                                       args.fp8_block)
        grad, grad_emulated = fp8_matmul(dy, w, "e5m2", "e4m3", granularity, args.fp8_block)
        # the gradient in e4m3, as torchao's rowwise recipe and DeepSeek-V3 cast it
        grad4, grad4_emulated = fp8_matmul(dy, w, "e4m3", "e4m3", granularity, args.fp8_block)
        # the other channels' product, cast under their own scales and under the scales
        # the outlier sets (cast with it, then multiplied without its channel)
        wq = fp8_matmul_inputs(w, "e4m3", granularity, args.fp8_block)

        def others_error(data):
            cast = fp8_matmul_inputs(data, "e4m3", granularity, args.fp8_block)
            return relative_error(rest(cast) @ rest(wq).t(), rest(data) @ rest(w).t())
        result = {"relative_error": {"output": relative_error(out, x @ w.t()),
                                     "input_grad": relative_error(grad, dy @ w),
                                     "input_grad_e4m3": relative_error(grad4, dy @ w)},
                  "predicted_relative_error": predicted,
                  "relative_error_channels": others_error(channels),
                  "relative_error_with_outlier": others_error(spiked)}
        emulated = {part: why for part, why in (("output", out_emulated),
                                                ("input_grad", grad_emulated),
                                                ("input_grad_e4m3", grad4_emulated)) if why}
        if emulated:
            result.update(emulated=True, emulated_because=emulated)
        return result

    return {granularity: distenv.try_variant(env, f"FP8 {granularity}",
                                             lambda: measure(granularity), local=True)
            for granularity in ("tensorwise", "rowwise", "blockwise")}


# ---------------------------------------------------------------- the lab

def parse_args(argv=None):
    parser = distenv.lab_parser(__doc__)
    parser.add_argument("--steps", type=distenv.positive_int, default=STEPS)
    parser.add_argument("--variants", type=distenv.choice_list(VARIANTS), default=list(VARIANTS),
                        help=f"comma-separated, or all: {', '.join(VARIANTS)}")
    parser.add_argument("--fp8-block", type=distenv.positive_int, default=FP8_BLOCK,
                        help="the block of block-wise FP8 scaling; must divide --hidden")
    parser.add_argument("--outlier", type=distenv.number_above(0), default=OUTLIER,
                        help="the outlier input channel's scale over the median channel's")
    parser.add_argument("--init-scale", type=distenv.number_above(0), default=INIT_SCALE,
                        help="GradScaler's first scale")
    add_shape_args(parser, SHAPE)
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    shape = shape_from_args(args)
    if shape.hidden % args.fp8_block:
        distenv.fail(f"--fp8-block {args.fp8_block} does not divide --hidden {shape.hidden}")
    if "fp32" not in args.variants:
        distenv.fail("--variants must include fp32, the reference of the others")
    args.variants = ["fp32"] + [v for v in args.variants if v != "fp32"]
    return args


def main():
    args = parse_args()
    shape = shape_from_args(args)
    with distenv.initialize(args) as env:
        variants, param_count = run_variants(shape, args, env)
        reduce_error = run_reduce_error(args, env)
        if not env.is_rank0:   # the other two parts use no process group: rank 0 alone
            return
        metrics = {"variants": variants, "loss_scaling": run_loss_scaling(shape, args, env),
                   "fp8_gemm": run_fp8_gemm(shape, args, env),
                   "fp8_scale_pitfalls": run_scale_pitfalls(shape, args, env),
                   "fp8_delayed_scaling": run_delayed_scaling(shape, args, env),
                   "block_scaled": run_block_scaled(shape, args, env),
                   "bf16_reduce_error": reduce_error, "param_count": param_count}
        for name, result in variants.items():
            if "error" in result:
                env.print0(f"{name:>14}: not run here ({result['error']})")
                continue
            if "not_run" in result:   # try_variant has said why
                continue
            env.print0(f"{name:>14}: sent {result['comm_bytes_per_rank']:,.0f} B "
                       f"(predicted {result['predicted_comm_bytes_per_rank']:,.0f}), "
                       f"max |p - fp32| {result['max_param_diff_vs_fp32']:.1e}")
        scaled = metrics["loss_scaling"]
        env.print0(f"fp16 gradients at 0: {scaled['fp16_unscaled']['zero_gradient_fraction']:.1%}"
                   f" unscaled, {scaled['fp16_scaled']['zero_gradient_fraction']:.1%} scaled "
                   f"({scaled['fp16_scaled']['skipped_steps']} steps skipped)")
        for granularity, result in metrics["fp8_gemm"].items():
            if "not_run" in result:   # try_variant has said why
                continue
            env.print0(f"FP8 {granularity:>10}: output {result['relative_error']['output']:.4f}, "
                       f"input grad {result['relative_error']['input_grad']:.4f}; with the "
                       f"outlier {result['relative_error_with_outlier']:.4f} (the other channels)"
                       + "".join(f"; {part} emulated ({why})"
                                 for part, why in result.get("emulated_because", {}).items()))
        pitfalls = metrics["fp8_scale_pitfalls"]
        env.print0(f"FP8 scales: amax 0 -> {pitfalls['amax_zero']['nan_fraction']:.0%} NaN "
                   f"({pitfalls['amax_zero']['nan_fraction_with_floor']:.0%} with a floor); "
                   f"amax inf -> {pitfalls['amax_infinite']['nan_fraction']:.0%} NaN; amax "
                   f"{STALE_BY}x stale -> {pitfalls['amax_stale']['saturated_fraction']:.0%} "
                   f"saturated, error {pitfalls['amax_stale']['relative_error']:.3f}")
        jump = metrics["fp8_delayed_scaling"]["jump"]
        env.print0(f"FP8 after a {JUMP}x jump: current scaling errs "
                   f"{jump['current']['relative_error']:.3f}, delayed "
                   f"{jump['delayed']['relative_error']:.3f} "
                   f"({jump['delayed']['saturated_fraction']:.0%} clipped)")
        for name, result in metrics["block_scaled"].items():
            if "not_run" not in result:   # try_variant has said why
                env.print0(f"{name:>12}: cast {result['relative_error']['cast']:.4f}, "
                           f"product {result['relative_error']['product']:.4f} (predicted "
                           f"{result['predicted_relative_error']['product']:.4f})")
        env.print0("bf16 all-reduce error by ranks: " + ", ".join(
            f"{n}: {r['relative_error']:.2e} (predicted {r['predicted_relative_error']:.2e})"
            for n, r in reduce_error.items()))
        env.write_result(args, metrics)


if __name__ == "__main__":
    main()

"""Number formats as cost models: what a format can hold, and how much a cast to it and a
matrix product in it get wrong.

Pure functions of the formats' bit layout, no torch: the precision lab measures the same
quantities with torch's own casts and torch._scaled_mm.

  FORMATS                 sign, exponent and mantissa bits, largest finite value, smallest
                          normal and subnormal value, bytes, of fp32, bf16, fp16, and the
                          two FP8 formats (OCP FP8: e4m3, which has no infinity and one
                          NaN, so reaches 448; e5m2, IEEE-like, 57344)
  grid_spacing            the distance between neighbouring values of a format at x
  rounding_rms            the root-mean-square relative error of rounding to nearest,
                          for values whose leading digits follow Benford's law
  gemm_relative_error     a matrix product's relative error when both operands were
                          rounded (independent errors, a sum accumulated exactly)
  sum_relative_error      a sum of n values accumulated in a format one addition at a time,
                          as a ring reduction passes its partial sum on: the error that
                          reducing gradients in bf16 adds, growing with the ranks
  outlier_headroom        how far below a tensor's largest value a value can be and still
                          be normal once the tensor is scaled so that its largest value
                          is the format's largest: the outlier a scale can absorb

The rounding model: a value x = 2^e (1 + f) is rounded to a grid of spacing
2^(e - m), m mantissa bits, so its absolute error is uniform over half a step either side
(RMS 2^(e - m) / sqrt(12)) and its relative error is that over x. Averaged over the
significand 1 + f in [1, 2) with the density 1 / ((1 + f) ln 2) that Benford's law gives
(and that products and sums of random numbers approach), E[1 / (1 + f)^2] = 3 / (8 ln 2),
so the RMS relative error is 2^-m sqrt(3 / (96 ln 2)), about 0.212 x 2^-m. Subnormal
values lose relative precision and are left out: scaling keeps most values normal, and
outlier_headroom says when it no longer can.
"""

import math
from dataclasses import dataclass

from . import hardware


@dataclass(frozen=True)
class Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float           # the largest finite value
    min_normal: float
    min_subnormal: float
    bytes: int


FORMATS = {f.name: f for f in (
    Format("fp32", 8, 23, (2 - 2 ** -23) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -149, 4),
    Format("bf16", 8, 7, (2 - 2 ** -7) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -133, 2),
    Format("fp16", 5, 10, 65504.0, 2.0 ** -14, 2.0 ** -24, 2),
    # e4m3 (torch.float8_e4m3fn): exponent bias 7, the all-ones exponent still holds
    # numbers (only S.1111.111, of either sign, is NaN), so the largest is 1.75 x 2^8
    Format("e4m3", 4, 3, 448.0, 2.0 ** -6, 2.0 ** -9, 1),
    Format("e5m2", 5, 2, 57344.0, 2.0 ** -14, 2.0 ** -16, 1),
)}

# E[1 / s^2] for a significand s in [1, 2) of density 1 / (s ln 2) (Benford), over 12:
# the mean square relative error of rounding, in units of the grid spacing 2^-m
_BENFORD_FACTOR = math.sqrt(3 / (8 * math.log(2)) / 12)


# FP4 (OCP MX's E2M1, an element format only): bias 1, no infinity and no NaN, so its
# values are 0, 0.5 (its one subnormal), 1, 1.5, 2, 3, 4 and 6; half a byte.
E2M1 = Format("e2m1", 2, 1, 6.0, 1.0, 0.5, 0.5)


@dataclass(frozen=True)
class BlockScaled:
    """A block-scaled format, as Blackwell's tensor cores take it: `block` consecutive
    values along the contraction share one scale of format `scale`, and the values are
    stored in `element`; `tensor_scale`, one fp32 scale per tensor above the blocks'."""
    name: str
    element: str
    block: int
    scale: str
    scale_bits: int
    tensor_scale: bool = False

    def bits_per_value(self, numel=None):
        """Bits a tensor of `numel` values takes per value, scales included (the tensor's
        fp32 scale needs `numel`; None leaves it out)."""
        bits = 8 * get_format(self.element).bytes + self.scale_bits / self.block
        return bits + (32 / numel if self.tensor_scale and numel else 0)


# The OCP MX specification's MXFP8 (E4M3 elements, blocks of 32, an E8M0 scale: a power of
# two) and NVIDIA's NVFP4 (E2M1 elements, blocks of 16, an E4M3 scale, and an fp32 scale
# per tensor that keeps the blocks' scales within E4M3's range): Transformer Engine's
# MXFP8BlockScaling and NVFP4BlockScaling recipes, torchao's MXTensor and NVFP4Tensor.
BLOCK_SCALED = {b.name: b for b in (
    BlockScaled("mxfp8", "e4m3", 32, "e8m0", 8),
    BlockScaled("nvfp4", "e2m1", 16, "e4m3", 8, tensor_scale=True),
)}


def get_format(name):
    """The Format called `name` (a block-scaled one: its elements'), or a ValueError that
    lists the formats."""
    if name in BLOCK_SCALED:
        name = BLOCK_SCALED[name].element
    if name == E2M1.name:
        return E2M1
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose from "
                         f"{', '.join([*FORMATS, E2M1.name, *BLOCK_SCALED])}") from None


def grid_spacing(name, x):
    """The distance between the two values of format `name` around |x| (x within range):
    2^(e - m) for a normal x = 2^e (1 + f), the subnormal spacing below the normal range."""
    fmt = get_format(name)
    x = abs(x)
    if x > fmt.max:
        raise ValueError(f"{x} is beyond {name}'s largest value, {fmt.max}")
    if x < fmt.min_normal:
        return fmt.min_subnormal
    return 2.0 ** (math.floor(math.log2(x)) - fmt.mantissa_bits)


def rounding_rms(name):
    """Root-mean-square relative error of rounding a normal value to nearest in `name`
    (the module's model): about 0.212 x 2^-m, m the mantissa bits."""
    return 2.0 ** -get_format(name).mantissa_bits * _BENFORD_FACTOR


def normwise_rounding_rms(name, distribution="gaussian"):
    """The norm-wise relative error |round(x) - x| / |x| of a tensor of many values rounded
    to nearest in `name` (or in the element format of a block-scaled one, BLOCK_SCALED):
    what a matrix product sees, since its terms weigh each value's error by its size. It
    depends on the data, unlike rounding_rms: sqrt(E[spacing(x)^2] / 12 / E[x^2]).
      "gaussian"     x ~ N(0, 1) (any scale: a power of two moves it along the grid),
                     summed over the octaves [2^e, 2^(e+1)): about 0.213 x 2^-m;
      "log_uniform"  x spread evenly in log2 (Benford's significands): within an octave
                     E[s^2] = 3 / (2 ln 2), so 2^-m sqrt(ln 2 / 18), about 0.196 x 2^-m.
    Subnormals are left out, as in rounding_rms. A block-scaled format whose scale is no
    power of two (NVFP4's E4M3 scale) puts each block's largest value on the element's
    largest, exactly: that value errs by nothing, which takes its share of the block's
    squares, E[max^2] / block (gaussian_block_max_square), out of the error."""
    m = get_format(name).mantissa_bits
    if distribution == "log_uniform":
        return 2.0 ** -m * math.sqrt(math.log(2) / 18)
    if distribution != "gaussian":
        raise ValueError(f"unknown distribution {distribution!r}; choose gaussian or "
                         f"log_uniform")
    # P(|x| >= t) = erfc(t / sqrt 2); the octave [2^e, 2^(e+1)) has spacing 2^(e - m)
    mean_square_spacing = sum(4.0 ** e * (math.erfc(2.0 ** e / math.sqrt(2))
                                          - math.erfc(2.0 ** (e + 1) / math.sqrt(2)))
                              for e in range(-60, 8))
    rms = 2.0 ** -m * math.sqrt(mean_square_spacing / 12)
    block = BLOCK_SCALED.get(name)
    if block is not None and block.scale != "e8m0":
        rms *= math.sqrt(1 - gaussian_block_max_square(block.block) / block.block)
    return rms


def gaussian_block_max_square(n, steps=4000, top=12.0):
    """E[max_i x_i^2] over n independent N(0, 1) values: the integral of
    2 t P(max |x| > t) dt, P(max |x| <= t) = erf(t / sqrt 2)^n (midpoint rule to 12
    standard deviations, beyond which nothing is left)."""
    dt = top / steps
    return sum(2 * t * (1 - math.erf(t / math.sqrt(2)) ** n) * dt
               for t in ((i + 0.5) * dt for i in range(steps)))


def gemm_relative_error(input_format, weight_format=None, distribution="gaussian"):
    """Relative error (RMS over the output, against the exact product) of A W^T when A was
    rounded to `input_format` and W to `weight_format` (None: W exact), the products
    accumulated exactly (fp32 accumulation is exact by comparison), both of `distribution`
    (normwise_rounding_rms). Each term a_k w_k carries an independent relative error
    e_a + e_w, and for terms of random sign the output's error adds up as its value does:
    sqrt(rms_a^2 + rms_w^2), each operand's norm-wise error. A block-scaled format
    (BLOCK_SCALED) errs as its elements do, as long as its scales keep them normal."""
    a = normwise_rounding_rms(input_format, distribution)
    w = normwise_rounding_rms(weight_format, distribution) if weight_format is not None else 0.0
    return math.hypot(a, w)


def sum_relative_error(name, n):
    """Relative error (RMS, against the exact sum) that summing n values in format `name`
    adds to them, the values already in `name`, independent, of zero mean and equal
    spread, added one at a time with every partial sum rounded: a ring all-reduce or
    reduce-scatter, where each rank adds its own chunk to the partial sum it receives and
    passes the rounded result on. The k-th partial sum (k = 2 ... n) has variance k s^2
    and is rounded with the relative error above, so the errors add up to
    rms^2 s^2 (n(n + 1)/2 - 1) against the sum's n s^2: rms x sqrt((n + 1)/2 - 1/n), zero
    for one rank, about rms x sqrt(n / 2) for many. It under-predicts by 5-8 %: the exact
    sum of two values of a format carries only a bit or two beyond it, so half-step ties
    are common and the rounding error is not uniform. A tree all-reduce (NCCL's, for
    all-reduce only) adds in another order, and so errs otherwise."""
    if n < 1:
        raise ValueError(f"a sum needs at least one value, got n = {n}")
    return rounding_rms(name) * math.sqrt((n + 1) / 2 - 1 / n)


def outlier_headroom(name):
    """max / min_normal: a tensor scaled so that its largest value lands on the format's
    largest keeps every value within this factor of the largest normal, and rounds it
    with the relative error above. e4m3 absorbs 448 / 2^-6 = 28,672; a value further down
    falls among the subnormals or to zero. The headroom of a scale is the format's, not
    the granularity's: a finer granularity (rows, 1 x 128 blocks) helps only values that
    share their scale with an outlier beyond it."""
    fmt = get_format(name)
    return fmt.max / fmt.min_normal


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of one way to train in lower precision: what a rank keeps
    (params, grads, an fp32 master copy beside them) and what its data-parallel
    collectives carry (gather: the parameters an all-gather brings, reduce: the gradients
    a reduce-scatter or all-reduce sums). `fp8_gather`, when set, is what the weights of
    the FP8 linear layers are gathered in; the other parameters take `gather`."""
    params: int
    grads: int
    master: int
    gather: int
    reduce: int
    fp8_gather: int = None


# What each recipe keeps and sends, per parameter (optimizer state aside: fp32 always).
#   fp32           everything in fp32
#   mixed          the ZeRO paper's fp16 recipe: 16-bit parameters and gradients, an fp32
#                  master copy for the update, gradients reduced in 16 bits (Megatron-LM
#                  with bf16 keeps and reduces its gradients in fp32 instead)
#   bf16_autocast  fp32 parameters and gradients; torch.autocast casts each op's inputs to
#                  bf16 as it runs, so FSDP2 still gathers and reduces fp32
#   bf16_params    FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32):
#                  the fp32 shard is the master, gathered as bf16, gradients reduced in fp32
#   bf16_reduce    the same with reduce_dtype=bf16
#   fp8_allgather  bf16_params, with the FP8 linear layers' weights cast to float8 (and
#                  their scale) before the all-gather, as torchao's float8 does under FSDP2
#   fp32_grads     Megatron-LM's and Megatron-Core's bf16 (and FP8) training: bf16
#                  parameters, gradients accumulated and reduced in an fp32 buffer
#                  (main_grad), an fp32 master: 2 + 4 + 4 + Adam's 8 = 18 bytes, the table
#                  of Megatron-LM's distributed-optimizer guide
RECIPES = {
    "fp32": Recipe(params=4, grads=4, master=0, gather=4, reduce=4),
    "mixed": Recipe(params=2, grads=2, master=4, gather=2, reduce=2),
    "bf16_autocast": Recipe(params=4, grads=4, master=0, gather=4, reduce=4),
    "bf16_params": Recipe(params=4, grads=4, master=0, gather=2, reduce=4),
    "bf16_reduce": Recipe(params=4, grads=4, master=0, gather=2, reduce=2),
    "fp8_allgather": Recipe(params=4, grads=4, master=0, gather=2, reduce=4, fp8_gather=1),
    "fp32_grads": Recipe(params=2, grads=4, master=4, gather=2, reduce=4),
}


def get_recipe(name):
    """The Recipe called `name`, or a ValueError that lists them."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; choose from {', '.join(RECIPES)}") from None


def gathered_bytes(name, numel, fp8_numel=0):
    """Bytes of `numel` parameters as an all-gather carries them under recipe `name`,
    `fp8_numel` of them weights of FP8 linear layers (gathered in FP8 where the recipe
    does; their scales, one fp32 per tensor, travel by an all-reduce of their own)."""
    recipe = get_recipe(name)
    if not 0 <= fp8_numel <= numel:
        raise ValueError(f"need 0 <= fp8_numel <= numel, got {fp8_numel} and {numel}")
    if recipe.fp8_gather is None:
        return numel * recipe.gather
    return fp8_numel * recipe.fp8_gather + (numel - fp8_numel) * recipe.gather


# ---------------------------------------------------------------- FP8 training, priced

# The planner's two ways to run a step's matrix products: bf16, or FP8 as torchao's
# float8 training and DeepSeek-V3 do it (the layers' linear weights and their inputs cast
# to FP8, the products accumulated in fp32; the embedding, the output head, the norms,
# the router and attention's own products stay in bf16).
PLANNER_PRECISIONS = ("bf16", "fp8")
# The dense FP8 tensor-core peak over the dense bf16 peak of the same GPU: 1,979 TFLOP/s
# against 989 on the H100 SXM (NVIDIA's H100 datasheet; the datasheet's 3,958 and 1,979
# count 2:4 sparsity).
FP8_PEAK_RATIO = 2.0
# How much faster the planner runs FP8 products than bf16 ones: the fastest FP8 matrix
# product measured on an H100 SXM over the fastest bf16 one (hardware.H100_FP8_MAMF_FLOPS
# over H100_MAMF_FLOPS: 1,402.6 over 794.5 TFLOP/s, 1.77; torch 2.7.0, CUDA 12.6, FP8
# scaled per tensor), not the datasheet's 2; a ratio that moves with the software and the
# scaling recipe. FP8's casts and scales are left out.
FP8_MATMUL_RATIO = hardware.H100_FP8_MAMF_FLOPS / hardware.H100_MAMF_FLOPS


def gather_bytes_per_value(precision, fp8_share):
    """Mean bytes per parameter of a parameter all-gather under the planner's `precision`,
    `fp8_share` of the parameters being FP8 linear weights (gathered in FP8 by torchao's
    enable_fsdp_float8_all_gather and Megatron-Core's --fp8-param-gather; the rest in
    bf16). Their per-tensor scales are a few bytes and left out."""
    if precision not in PLANNER_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from "
                         f"{', '.join(PLANNER_PRECISIONS)}")
    if not 0 <= fp8_share <= 1:
        raise ValueError(f"fp8_share is a fraction, got {fp8_share}")
    bf16 = FORMATS["bf16"].bytes
    if precision == "bf16":
        return float(bf16)
    return fp8_share * FORMATS["e4m3"].bytes + (1 - fp8_share) * bf16


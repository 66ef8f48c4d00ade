"""What a run fixes besides the model and the layout: the hardware (Hardware), the run's
settings (Settings), and the defaults and choices they take."""

import dataclasses

from .. import hardware, memory_model
from .shapes import HashedOnce

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved")
# How the computation's rate is priced (Settings.rate): "flat", every FLOP at one fraction of
# the peak (Settings.mfu); "shape", each product at its shape's rate and the other kernels
# at HBM bandwidth (shape_rate)
RATES = ("flat", "shape")
ZERO = memory_model.STRATEGIES
# bf16 activations and collectives; the gradients' data-parallel reductions take
# GRAD_REDUCE_BYTES instead
VALUE_BYTES = 2
# The fraction of the dense peak the computation runs at when nothing waits: large bf16
# matmuls reach well above it, attention, norms and elementwise kernels well below. An
# assumption (--mfu), not a measurement; the MFU the planner reports is lower.
COMPUTE_EFFICIENCY = 0.55
# Tensor-parallel collectives hidden behind compute: none by default, as in Megatron-LM's
# 2021 runs and torch's plain TP; asynchronous TP (torchtitan's, Megatron-Core's
# --tp-comm-overlap) hides part of them: pass the fraction (--tp-overlap).
TP_OVERLAP = 0.0
# Bytes a gradient value takes in the data-parallel reductions (Settings.grad_reduce). fp32
# is the frameworks' default: Megatron-LM reduces bf16 runs' gradients in fp32 (its
# validate_args sets accumulate_allreduce_grads_in_fp32 for bf16; --grad-reduce-in-bf16
# turns it off), Llama 3 reduce-scattered in fp32 (Dubey et al., 2024, section 3.3.2),
# torchtitan sets FSDP2's reduce_dtype to fp32 (mixed_precision_reduce). 16 bits where a
# run says so: Megatron-LM's fp16 runs (fp16, without
# --accumulate-allreduce-grads-in-fp32), NeMo's grad_sync_dtype bf16, FSDP2's default
# reduce_dtype (the parameters' dtype, bf16 under a bf16 MixedPrecisionPolicy)
GRAD_REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Memory a GPU's tensors cannot have: the CUDA context and NCCL's buffers, 1.06 GB on each
# of eight H100s before a first all-to-all, 4.34 GB after it (NVIDIA/nccl issue 1685; the
# context alone about 0.4 GB with lazy loading, pytorch issue 109888). A layout fits when
# its tensors fit the nominal memory less this reserve; the allocator's fragmentation is
# not reserved (the 5-D chapter compares each published layout's room left with it)
RUNTIME_RESERVE_GB = 1.06
ALL_TO_ALL_RESERVE_GB = 4.34 - 1.06


# What Settings.rate "shape" needs of a GPU beyond Hardware's fields, by its dense bf16 peak
# in TFLOP/s: its SMs (NVIDIA's A100 and H100 architecture whitepapers) and its HBM bandwidth
# (datasheets, the A100 80 GB's): Hardware.memory_tb_s is the H100's unless a caller sets it,
# an A100's peak included. The H800 SXM is an H100 SXM for both
GPU_BY_PEAK = {
    round(hardware.A100_BF16_FLOPS / 1e12): dict(sms=108, hbm=hardware.A100_80GB_HBM_BYTES_S),
    round(hardware.H100_BF16_FLOPS / 1e12): dict(sms=132, hbm=hardware.H100_HBM_BYTES_S),
}


@dataclasses.dataclass(frozen=True)
class Hardware(HashedOnce):
    gpus: int
    gpus_per_node: int = hardware.GPUS_PER_NODE
    gpu_memory_gb: float = 80.0
    peak_tflops: float = hardware.H100_BF16_FLOPS / 1e12
    nvlink_gb_s: float = hardware.NVLINK[1] / 1e9
    network_gb_s: float = hardware.NIC[1] / 1e9
    memory_tb_s: float = hardware.H100_HBM_BYTES_S / 1e12   # HBM, for the roofline

    @property
    def sms_and_hbm(self):
        """(SMs, HBM bytes/s) of this GPU (GPU_BY_PEAK), known by its peak; another peak:
        the H100's SMs and memory_tb_s."""
        known = GPU_BY_PEAK.get(round(self.peak_tflops))
        if known:
            return known["sms"], known["hbm"]
        return GPU_BY_PEAK[round(hardware.H100_BF16_FLOPS / 1e12)]["sms"], self.memory_tb_s * 1e12

    @property
    def nvlink(self):
        return hardware.NVLINK[0], self.nvlink_gb_s * 1e9

    @property
    def network(self):
        return hardware.NIC[0], self.network_gb_s * 1e9


@dataclasses.dataclass(frozen=True)
class Settings(HashedOnce):
    """What the run fixes besides the layout and the hardware."""
    global_batch_tokens: int
    mfu: float = COMPUTE_EFFICIENCY
    tp_overlap: float = TP_OVERLAP
    # each sequence-parallel all-gather and reduce-scatter run beside a linear layer's
    # product, as Megatron-LM's --tp-comm-overlap and NeMo's ub_tp_comm_overlap run them
    # (Transformer Engine's comm-GEMM overlap; tensor_parallel_overlapped_time): a run's
    # own setting, where it says so; it replaces tp_overlap's fraction
    tp_comm_overlap: bool = False
    # torch's tensor parallelism (DTensor's, as torchtitan applies it): eight collectives a
    # layer, the gathered inputs kept (tensor_parallel_overlapped_time's "torch" style)
    torch_tp: bool = False
    # and six of those eight fused with their products, as torch's asynchronous tensor
    # parallelism runs them (torchtitan's enable_async_tensor_parallel; implies torch_tp):
    # a run's own setting, where it says so; it replaces tp_overlap's fraction
    async_tp: bool = False
    # the expert all-to-alls run beside another micro-batch's computation, hidden as far
    # as that lasts, as Megatron-Core's --overlap-moe-expert-parallel-comm runs them in the
    # interleaved 1F1B schedule: a run's own setting, where it says so
    ep_overlap: bool = False
    flash_attention: bool = True
    zero: tuple = ZERO
    recompute: tuple = RECOMPUTE     # or one of them
    # the matrix products in bf16 or FP8 (precision_model.PLANNER_PRECISIONS): FP8 runs the
    # layers' linear products precision_model.FP8_MATMUL_RATIO times faster and gathers
    # their weights in FP8; fp8_activations (a run's own choice, as DeepSeek-V3's) also
    # caches the activations for backward as DeepSeek-V3 does, most of them in FP8
    precision: str = "bf16"
    fp8_activations: bool = False
    # what the states take per parameter (precision_model.RECIPES): the ZeRO paper's
    # mixed precision, 2 + 2 + 12 bytes, or a framework's fp32 gradient buffer, as
    # Megatron-LM keeps with bf16 (fp32_grads: 2 + 4 + 12); what the reductions carry is
    # grad_reduce's
    states: str = "mixed"
    # context parallelism's scheme (context_parallel.CP_SCHEMES): Megatron-Core's default
    # ring ("p2p"), or Llama 3's all-gather of K and V, exposed
    cp_scheme: str = "ring"
    # sequence parallelism with tp > 1 (Korthikanti et al., 2022): on, as Megatron-Core's
    # recipes, NeMo's and torchtitan's run it; off, tensor parallelism all-reduces the
    # layers' outputs and keeps their inputs whole on each rank, as Megatron-LM's 2021 runs
    sequence_parallel: bool = True
    # the pipeline's sends beside the computation (True, as Llama 3 ran them), one after
    # the other (False), or None: Megatron-LM's default, overlapped only when interleaved
    pp_async: object = None
    # the data-parallel reductions' precision (GRAD_REDUCE_BYTES): fp32, the frameworks'
    # default with bf16, or a run's own 16 bits
    grad_reduce: str = "fp32"
    # bytes a value of the tokens dispatched to their experts (expert_parallel.
    # dispatch_seconds): 2, or DeepSeek-V3's FP8 dispatch, 1; the combine stays 16-bit
    dispatch_bytes: int = VALUE_BYTES
    # the computation's rate (RATES): "flat" (Settings.mfu of the peak for every FLOP), or
    # "shape" (shape_rate: the linear products at their tile- and wave-quantised rate under
    # the GPU's measured matmul ceiling or at HBM bandwidth, unfused attention's likewise, a
    # fused attention at Settings.mfu, norms, activations, an unfused softmax and the
    # optimizer's step at HBM bandwidth)
    rate: str = "shape"
    # a price for each interleaved chunk (pipeline.chunk_exposed_seconds): each of a
    # step's m x v x 2 sends waits its latency even where the sends overlap the
    # computation, and a send longer than the chunk's computation it overlaps waits for the
    # rest. Off: overlapped sends cost nothing outside the fill and drain
    chunk_price: bool = False


# dataclass(frozen=True) writes a __hash__ of its own into each class: put the cached one back
for _cls in (Hardware, Settings):
    _cls.__hash__ = HashedOnce.__hash__

"""What a run fixes besides the model and the layout: the hardware (Hardware), the run's
settings (Settings), and the defaults and choices they take."""

import dataclasses

from .. import hardware, memory_model
from .shapes import HashedOnce

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved")
ZERO = memory_model.STRATEGIES
# bf16 activations and collectives, the gradients' reductions included: a lower bound
# where a run reduces in fp32, as Megatron-LM with bf16 and torchtitan do by default
VALUE_BYTES = 2
# The fraction of the dense peak the computation runs at when nothing waits: large bf16
# matmuls reach well above it, attention, norms and elementwise kernels well below. An
# assumption (--mfu), not a measurement; the MFU the planner reports is lower.
COMPUTE_EFFICIENCY = 0.55
# Tensor-parallel collectives hidden behind compute: none by default, as in Megatron-LM's
# 2021 runs and torch's plain TP; asynchronous TP (torchtitan's, Megatron-Core's
# --tp-comm-overlap) hides part of them: pass the fraction (--tp-overlap).
TP_OVERLAP = 0.0


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
    # Megatron-LM keeps with bf16 (fp32_grads: 2 + 4 + 12, its gradients reduced in fp32)
    states: str = "mixed"


# dataclass(frozen=True) writes a __hash__ of its own into each class: put the cached one back
for _cls in (Hardware, Settings):
    _cls.__hash__ = HashedOnce.__hash__

"""The planner: every layout of N GPUs over five degrees, with its memory per GPU and its
step time, fastest first. No torch: the same code runs in labs/plan.py and in a browser.

Degrees, and where their ranks sit (the order of torchtitan's and Megatron-Core's device
meshes, tp innermost, pp outermost: [pp, dp, cp, tp]):
  tp  tensor parallelism, inside a node, with sequence parallelism or without
      (Settings.sequence_parallel)
  cp  context parallelism: each rank holds s/cp tokens of every sequence; attention's
      keys and values pass round a ring, overlapped with the blocks' compute, or are
      all-gathered, exposed, as Llama 3 ran it (Settings.cp_scheme)
  dp  data parallelism, with ZeRO 0-3 over the dp x cp ranks that hold the same weights
      (the gradients of cp ranks are reduced together, as Megatron-Core and torchtitan do)
  pp  pipeline stages, 1F1B or interleaved with v chunks per rank, any m >= 1; or
      ZB-H1 over the v chunks where a layout names it (zb=1, torch's
      ScheduleInterleavedZeroBubble), its bubble the walk of its order at the step's F, I and
      W (time_model.zero_bubble_bubble_fraction, as the pipeline lab measures it); or
      DualPipe where a layout names it (dualpipe=1, as DeepSeek-V3 ran): neither searched,
      its memory modelled (two stages per rank, ZeRO sharding over both copies'
      replicas), its bubble DeepSeek-V3's Table 2 gives, and the expert all-to-alls and
      pipeline sends hidden behind computation as far as it lasts, as DualPipe overlaps
      them (DeepSeek-V3 §3.2.1)
  ep  expert parallelism, for mixture-of-experts shapes: each MoE layer's experts over ep
      ranks, their matrices split etp ways (expert tensor parallelism: tp, Megatron-Core's
      default, or 1, the experts whole, as DeepSeek-V3's runs keep them). Megatron-Core
      lays etp x ep x edp over a stage's tp x cp x dp ranks, etp innermost (torchtitan
      carves ep out of dp_shard x cp x tp and keeps each expert whole): ep x etp divides
      tp x cp x dp and does not multiply N; the experts' own data parallelism is
      edp = tp x cp x dp / (ep x etp).
      Tokens reach their experts through the cheaper of Megatron-Core's all-to-all and
      all-gather dispatchers (dispatch_collective_time)
N = dp x cp x pp x tp.

Memory (the fullest pipeline stage, memory_model's accounting): mixed-precision Adam
states (2 + 2 + 12 bytes per parameter) sharded by the ZeRO stage over the ranks that hold
them, a tied head's copy of the embedding on a last stage that does not hold it;
activations per Korthikanti et al. (2022), split tp ways, of the micro-batches the
schedule keeps in flight (memory_model.pipeline_peak_microbatches); recomputation none,
selective (attention's s x s part rebuilt) or full (each layer keeps its input); a fused
attention (FlashAttention) keeps no s x s matrix; the last stage keeps the logits in fp32.
A layout fits when that fits the GPU's memory less the CUDA context's and NCCL's buffers
(memory_per_gpu.reserve_bytes).

Time, per step: compute at a stated fraction of the peak (the layers' and the head's
products, attention's as a kernel runs them, the embedding's lookup none), or with
Settings.rate "shape" each linear product at its shape's rate under that fraction and the
other kernels at HBM bandwidth (compute.shaped_compute), the routed
experts' products at the slower of that and their HBM traffic (expert_matmul_slowdown);
the pipeline's idle time (time_model.pipeline_bubble_fraction, m < p included), each slot
a micro-batch's computation and exposed traffic; tensor-parallel collectives
(comm_model.tensor_parallel_collectives, the embedding's on the first stage, the head's on
the last) on NVLink, a stated fraction overlapped, or with tp_comm_overlap each beside a
linear layer's product, as Transformer Engine runs them, or torch's eight a layer
(torch_tp), six of them fused with their products under async_tp
(tensor_parallel_overlapped_time); the pipeline's sends, in series or beside the
computation (Settings.pp_async; with chunk_price their latency and what outlasts each
chunk's computation stay exposed even then); the data-parallel collectives
(comm_model.data_parallel_step_collectives) over NCCL's ring or tree
(time_model.nccl_allreduce_time), the gradients in Settings.grad_reduce, the reductions
hidden behind the backward and the parameters' gathers after the step behind the next
forward as far as they fit, and a tied embedding's gradient summed between the end
stages; context parallelism's ring or all-gather; expert parallelism's dispatch (in
Settings.dispatch_bytes) and combine, exposed (or, with ep_overlap or DualPipe, hidden
behind the computation as far as it lasts).

Precision (Settings.precision): bf16, or FP8 for the layers' linear products, which then
run precision_model.FP8_MATMUL_RATIO times faster, the H100's measured FP8 matrix rate over
its bf16 one (attention's products, the embedding and the head stay bf16), and whose
weights the parameter all-gathers carry in one byte;
with fp8_activations the activations are cached for backward as DeepSeek-V3 caches them,
most in FP8 (Model.layer_activation_values). The MFU reported stays against the bf16 peak.

The files, each importing only those above it (no cycles):
  shapes            Model (a decoder-only transformer), the parameters a rank holds of its
                    layers, shape_from_params
  settings          Hardware, Settings and their defaults
  presets           PRESETS: published shapes, with their sources
  layout            stage cuts (chunk_split, stage_split), what each rank holds, FLOPs per
                    stage, ranks on nodes, parse_layout
  collectives       one collective over a group of ranks, priced (group_time, priced)
  tensor_parallel, data_parallel, pipeline, context_parallel, expert_parallel
                    each parallelism's term of a step
  memory_per_gpu    memory on the fullest GPU (memory)
  compute           the computation's price by its shapes (shaped_compute, linear_rate)
  step              step_time, mfu
  search            why_not, configurations, plan, rank_layout
Every name the planner's callers use is imported here, so `from labkit.predict import
planner` and `planner.<name>` work as they did when the planner was one file.
"""

from .shapes import (ASPECT, GPT_VOCAB, HEAD_DIM, HashedOnce, Model, largest_layer_params,
                     layer_kinds, rank_params, shape_from_params, stage_params)
from .settings import (ALL_TO_ALL_RESERVE_GB, COMPUTE_EFFICIENCY, GPU_BY_PEAK, GRAD_REDUCE_BYTES,
                       RATES, RECOMPUTE, RUNTIME_RESERVE_GB, SCHEDULES, TP_OVERLAP, VALUE_BYTES,
                       ZERO, Hardware, Settings)
from .presets import PRESETS
from .layout import (MAX_END_TRIM, chunk_flops, chunk_split, divisors, expert_replicas,
                     interleavings, layer_flops,
                     members_per_node, moe_count, most_moe_layers, most_virtual_stages,
                     parse_layout, rank_chunks, rank_layers, stage_flops, stage_imbalance,
                     stage_spans, stage_split)
from .collectives import group_time, priced, priced_counts
from .tensor_parallel import (tensor_parallel_overlapped_time, tensor_parallel_plan,
                              tensor_parallel_seconds, tensor_parallel_time)
from .data_parallel import (data_parallel_exposed_seconds, data_parallel_parts,
                            data_parallel_time, rank_data_parallel_parts,
                            slowest_data_parallel_time, stage_data_parallel_time,
                            tied_embedding_seconds)
from .pipeline import bubble_seconds, chunk_exposed_seconds, send_seconds, sends_overlapped
from .context_parallel import CP_SCHEMES, context_parallel_seconds
from .expert_parallel import dispatch_collective_time, dispatch_seconds, expert_matmul_slowdown
from .memory_per_gpu import (memory, reserve_bytes, stage_activation_values, stage_footprints,
                             state_bytes, with_reserve)
from .compute import (ADAM_BYTES, elementwise_bytes_per_token, linear_rate, optimizer_seconds,
                      shaped_compute, unfused_attention_rate)
from .step import mfu, step_time
from .search import (MICRO_BATCH_SIZES, cheapest_recompute, configurations,
                     degree_options, evaluate, plan, rank_layout, settings_for, why_not)

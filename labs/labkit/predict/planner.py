"""The planner: every layout of N GPUs over five degrees, with its memory per GPU and its
step time, fastest first. No torch: the same code runs in labs/plan.py and in a browser.

Degrees, and where their ranks sit (the order of torchtitan's and Megatron-Core's device
meshes, tp innermost, pp outermost: [pp, dp, cp, tp]):
  tp  tensor parallelism with sequence parallelism, inside a node
  cp  context parallelism: each rank holds s/cp tokens of every sequence; attention's
      keys and values pass round a ring, overlapped with the blocks' compute
  dp  data parallelism, with ZeRO 0-3 over the dp x cp ranks that hold the same weights
      (the gradients of cp ranks are reduced together, as Megatron-Core and torchtitan do)
  pp  pipeline stages, 1F1B or interleaved with v chunks per rank, any m >= 1; or
      DualPipe where a layout names it (dualpipe=1, as DeepSeek-V3 ran): never searched,
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
them; activations per Korthikanti et al. (2022), split tp ways, of the micro-batches the
schedule keeps in flight (memory_model.pipeline_peak_microbatches); recomputation none,
selective (attention's s x s part rebuilt) or full (each layer keeps its input); a fused
attention (FlashAttention) keeps no s x s matrix; the last stage keeps the logits in fp32.

Time, per step: compute at a stated fraction of the peak, the routed experts' products
at the slower of that and their HBM traffic (expert_matmul_slowdown); the pipeline's idle time
(time_model.pipeline_bubble_fraction, m < p included); tensor-parallel collectives
(comm_model.tensor_parallel_collectives) on NVLink, a stated fraction overlapped, or
with tp_comm_overlap each beside a linear layer's product, as Transformer Engine runs them,
or torch's eight a layer (torch_tp), six of them fused with their products under async_tp
(tensor_parallel_overlapped_time); the
pipeline's sends; the data-parallel collectives (comm_model.data_parallel_step_collectives)
over NCCL's ring or tree (time_model.nccl_allreduce_time), hidden behind
backward as far as they fit; context parallelism's ring, exposed where a block's transfer
outlasts its compute; expert parallelism's dispatch, exposed (or, with ep_overlap or
DualPipe, hidden behind the computation as far as it lasts).

Precision (Settings.precision): bf16, or FP8 for the layers' linear products, which then
run precision_model.FP8_MATMUL_RATIO times faster, the H100's measured FP8 matrix rate over
its bf16 one (attention's products, the embedding and the head stay bf16), and whose
weights the parameter all-gathers carry in one byte;
with fp8_activations the activations are cached for backward as DeepSeek-V3 caches them,
most in FP8 (Model.layer_activation_values). The MFU reported stays against the bf16 peak.
"""

import dataclasses
import functools
import itertools
import math
from collections import Counter

from . import comm_model, hardware, memory_model, precision_model, time_model

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved")
ZERO = memory_model.STRATEGIES
MICRO_BATCH_SIZES = (1, 2, 4, 8)
CHUNKS = (1, 2, 4)             # interleaved: model chunks per rank considered
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


class HashedOnce:
    """A frozen dataclass that computes its hash once: the planner's caches look the model
    and the hardware up hundreds of thousands of times a plan, and a dataclass's own hash
    rebuilds the tuple of its fields every time."""

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(tuple(
            getattr(self, field.name) for field in dataclasses.fields(self))))

    def __hash__(self):
        return self._hash


@dataclasses.dataclass(frozen=True)
class Model(HashedOnce):
    """A decoder-only transformer. gpt=True is the course's model (labs/labkit/
    transformer.py, GPT-2/3 and Megatron-LM's GPT): biases, LayerNorms, learned positions,
    an MLP of ffn_hidden (4h) with GELU. gpt=False is a Llama-style model: no biases,
    RMSNorm, rotary positions, a SwiGLU MLP (three matrices of h x ffn_hidden) and
    kv_heads key-value heads (grouped-query attention, in either style). With experts > 0
    the MLPs of all layers after the first dense_layers are `experts` routed experts of
    expert_hidden, top_k per token, plus shared_experts always used. attention_params
    overrides the attention's parameter count per layer, and qk_head_dim and v_head_dim
    the widths of a head's queries and keys and of its values (0: hidden / heads), as
    DeepSeek's multi-head latent attention needs: its heads attend in 192 dimensions (128
    and 64 rotary) and return 128, whatever the hidden size."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn_hidden: int = 0            # 0: 4 x hidden
    kv_heads: int = 0              # 0: heads
    gpt: bool = True
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    expert_hidden: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    attention_params: int = 0
    qk_head_dim: int = 0
    v_head_dim: int = 0
    node_limit: int = 0            # routing reaches at most this many nodes (0: any)
    name: str = ""

    @property
    def ffn(self):
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_dim(self):
        """Width of the keys (and of the values) with hidden / heads per head: the K and V
        projections' output (grouped-query attention narrows it)."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def qk_dim(self):
        return self.qk_head_dim or self.hidden // self.heads

    @property
    def v_dim(self):
        return self.v_head_dim or self.hidden // self.heads

    def attention_widths(self):
        """(q, k, v, output) values per token as attention sees them: queries and output
        over all heads, keys and values over the key-value heads."""
        kv = self.kv_heads or self.heads
        return (self.heads * self.qk_dim, kv * self.qk_dim, kv * self.v_dim,
                self.heads * self.v_dim)

    @property
    def moe_layers(self):
        return self.layers - self.dense_layers if self.experts else 0

    def check(self):
        """A message saying what is wrong with the shape, or None."""
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                return f"--{name} must be a positive integer, got {getattr(self, name)}"
        if self.hidden % self.heads:
            return f"--hidden {self.hidden} is not divisible by --heads {self.heads}"
        if self.kv_heads and self.heads % self.kv_heads:
            return f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}"
        if self.experts and not (1 <= self.top_k <= self.experts and self.expert_hidden):
            return (f"a mixture of experts needs 1 <= --top-k <= --experts ({self.experts}) "
                    f"and --expert-hidden, got --top-k {self.top_k}")
        if self.dense_layers > self.layers:
            return f"--dense-layers {self.dense_layers} is more than --layers {self.layers}"
        return None

    # Parameters, per layer and outside the layers

    def attention(self):
        """(split tp ways, replicated) parameters of one layer's attention and norms."""
        h = self.hidden
        if self.attention_params:
            return self.attention_params, 2 * h
        if self.gpt:   # Q, K, V with biases, projection h^2 (+ its bias h, replicated),
            # 2 LNs 4h: 4h^2 + 3h with as many key-value heads as heads
            return 2 * h * h + 2 * h * self.kv_dim + h + 2 * self.kv_dim, 5 * h
        return 2 * h * h + 2 * h * self.kv_dim, 2 * h   # Q, O; K, V; two RMSNorms

    def mlp(self, ffn):
        """(split, replicated) parameters of one MLP (or expert) of width ffn."""
        h = self.hidden
        if self.gpt:   # fc1 h f + f, fc2 f h (+ its bias h, replicated)
            return 2 * h * ffn + ffn, h
        return 3 * h * ffn, 0

    def layer_params(self, layer, tp=1, ep=1, matrices_only=False, etp=None):
        """(dense, expert) parameters one rank holds of layer `layer`, split tp ways, its
        routed experts ep ways and their matrices etp ways (expert tensor parallelism;
        None: tp, Megatron-Core's default). matrices_only: the linear layers' weights
        alone (the split parts, their small column-parallel biases with them), what an
        FP8 recipe casts: no norms, no router."""
        split, replicated = self.attention()
        keep = 0 if matrices_only else 1
        if self.experts and layer >= self.dense_layers:
            e_split, e_repl = self.mlp(self.expert_hidden)
            shared = self.shared_experts * e_split
            router = self.hidden * self.experts
            dense = (split + shared) / tp + keep * (replicated + router
                                                    + self.shared_experts * e_repl)
            return dense, self.experts / ep * (e_split / (etp or tp) + keep * e_repl)
        m_split, m_repl = self.mlp(self.ffn)
        return (split + m_split) / tp + keep * (replicated + m_repl), 0

    def outside_params(self, first, last, tp=1):
        """Parameters of the embedding (first stage) and final norm and head (last)."""
        h = self.hidden
        count = 0
        if first:
            count += self.vocab * h / tp + (self.seq * h if self.gpt else 0)
        if last:
            count += (2 * h if self.gpt else h) + (0 if self.tied else self.vocab * h / tp)
        return count

    def params(self):
        """All parameters."""
        return sum(stage_params(self, 0, self.layers, 1, 1, True, True))

    @functools.lru_cache(maxsize=None)   # noqa: B019  a frozen model: its count never changes
    def active_params(self):
        """Parameters one token uses: its top_k routed experts of every MoE layer."""
        if not self.experts:
            return self.params()
        routed = self.mlp(self.expert_hidden)
        return self.params() - self.moe_layers * (self.experts - self.top_k) * sum(routed)

    @functools.lru_cache(maxsize=None)   # noqa: B019  a frozen model: its count never changes
    def active_matrix_params(self):
        """Of active_params, the layers' linear weights a token passes through (its top_k
        routed experts and the shared ones): the products an FP8 recipe runs in FP8."""
        total = 0
        for layer in range(self.layers):
            split, _ = self.attention()
            if self.experts and layer >= self.dense_layers:
                total += split + (self.top_k + self.shared_experts) * self.mlp(
                    self.expert_hidden)[0]
            else:
                total += split + self.mlp(self.ffn)[0]
        return total

    def linear_flops_per_token(self, layer):
        """(QKV, output projection, first MLP matrix, second MLP matrix) forward FLOPs per
        token of layer `layer`'s four linear layers, unsplit: 2 x their weights, the MLP's
        those of the experts a token passes through (top_k routed and the shared ones):
        the products beside which Transformer Engine runs a dense layer's tensor-parallel
        collectives."""
        h, (_, _, _, out) = self.hidden, self.attention_widths()
        split, _ = self.attention()
        projection = out * h
        qkv = split - projection
        if self.experts and layer >= self.dense_layers:
            width, copies = self.expert_hidden, self.top_k + self.shared_experts
        else:
            width, copies = self.ffn, 1
        second = h * width
        first = self.mlp(width)[0] - second      # GELU's fc1 (and its bias), SwiGLU's gate and up
        return 2 * qkv, 2 * projection, 2 * copies * first, 2 * copies * second

    def attention_flops_per_token(self):
        """Attention's two matrix products, forward and backward, per token: scores Q K^T
        (2 s heads d_qk forward) and weights x V (2 s heads d_v), three times that with
        backward, causal masking not discounted: 12 L h s when a head's widths are
        hidden / heads, as Megatron-LM, PaLM and torchtitan count them."""
        return 6 * self.layers * self.seq * self.heads * (self.qk_dim + self.v_dim)

    # Activations: values one layer keeps per token (Korthikanti et al., 2022)

    def layer_activation_values(self, layer, tp, sequence_parallel=True, flash=True,
                                fp8_activations=False, etp=None):
        """16-bit values per token one layer keeps for backward on one of tp ranks, no
        dropout: the norms' inputs 2h, the QKV input h, Q, K, V and attention's output
        at their widths (attention_widths: h, h_kv, h_kv and h with hidden / heads per
        head), the MLP's input h, the MLP's inner values (GELU's input and output 2f;
        SwiGLU's gate, up and their product 3f; a MoE layer: k routed copies of the input,
        inner values and output, and the shared experts'). The norms' and matmul inputs
        (4h) are replicated over tp unless sequence parallelism splits the tokens. A rank
        of a MoE layer's experts holds the routed copies of etp ranks' tokens (None: tp),
        gathered by Megatron-Core's dispatcher, their inputs whole and their inner values
        split etp ways: k (h etp + h + inner f) / tp per token of the tp group. The output
        h of each copy is the course's lab's (memory_model.moe_layer_activation_values: a
        gate applied to the expert's output); Megatron-Core applies the probabilities
        inside the experts' activation and keeps no output, k h / tp values fewer.
        Without a fused attention, the softmax's output: heads x s more per token.
        fp8_activations: cached as DeepSeek-V3 caches them (§3.3.3): the QKV and MLP
        inputs (and each routed slot's input) in FP8, half a 16-bit value; attention's
        output, the next linear's input, in its 12-bit E5M6, three quarters; SwiGLU's
        inputs (gate and up) in FP8 and its output recomputed in backward, not kept
        (GELU's input likewise, its output recomputed)."""
        h, split_inputs = self.hidden, (tp if sequence_parallel else 1)
        inner_per_width = 2 if self.gpt else 3
        moe = self.experts and layer >= self.dense_layers
        gathered = (etp or tp) if moe else 1   # ranks whose routed copies one rank holds
        if moe:   # the routing taken as even
            mlp = memory_model.moe_layer_activation_values(
                h, self.expert_hidden, self.top_k, self.shared_experts, inner_per_width)
        else:
            mlp = inner_per_width * self.ffn
        q, k, v, out = self.attention_widths()
        split = q + k + v + out + mlp
        values = 4 * h / split_inputs + split / tp
        if moe:   # the routed copies' inputs of the other etp - 1 ranks
            values += self.top_k * h * (gathered - 1) / tp
        if fp8_activations:
            # of an MLP's inner values: the gate and up halved, the product not kept (2f of
            # SwiGLU's 3f); GELU's input halved, its output not kept (1.5f of 2f)
            saved_inner = 2.0 if inner_per_width == 3 else 1.5
            if moe:
                inner = self.top_k * (0.5 * h * gathered + saved_inner * self.expert_hidden) \
                    + self.shared_experts * saved_inner * self.expert_hidden
            else:
                inner = saved_inner * self.ffn
            values -= 0.5 * 2 * h / split_inputs + (0.25 * out + inner) / tp
        if not flash:
            values += self.heads * self.seq / tp
        return values


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
for _cls in (Model, Hardware, Settings):
    _cls.__hash__ = HashedOnce.__hash__


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def group_time(op, bytes_, size, span_per_node, hw):
    """Seconds of one collective over `size` ranks of which `span_per_node` share a node:
    a ring on NVLink inside one node; across nodes the all-reduce as NCCL's flat ring or
    its tree, whichever is faster (time_model.nccl_allreduce_time), and an all-gather or
    reduce-scatter as the flat ring alone (time_model.hierarchical_shard_collective_time):
    NCCL has no tree for those two."""
    if size == 1:
        return 0.0
    if size <= span_per_node:
        if op == "all_reduce":
            return comm_model.allreduce_time(bytes_, size, *hw.nvlink)
        return time_model.shard_collective_time(bytes_, size, *hw.nvlink)
    if op == "all_reduce":
        return time_model.nccl_allreduce_time(bytes_, size, span_per_node, hw.nvlink,
                                              hw.network)
    return time_model.hierarchical_shard_collective_time(bytes_, size, span_per_node,
                                                         hw.nvlink, hw.network)


def priced(collectives, size, per_node, hw, gather_bytes=VALUE_BYTES, reduce_bytes=VALUE_BYTES):
    """Seconds of a list of (op, elements) collectives of 16-bit values (group_time), the
    all-gathers' at `gather_bytes` per element (less where FP8 weights are gathered), the
    reductions' at `reduce_bytes` (more where gradients are reduced in fp32)."""
    return sum(count * group_time(op, (gather_bytes if op == "all_gather" else reduce_bytes)
                                  * numel, size, per_node, hw)
               for (op, numel), count in Counter(collectives).items())


@functools.lru_cache(maxsize=65536)
def tensor_parallel_time(layers, seq, batch, hidden, tp, embedding, microbatches, recompute,
                         hw, fp8=False, moe_layers=0):
    """Seconds of one rank's tensor-parallel collectives in a step, sequence parallelism
    on (comm_model.tensor_parallel_collectives: the head's on the stage, the embedding's
    too when it is the only stage), each at its ring time on NVLink. With `fp8` the layers'
    all-gathers carry one byte a value: Transformer Engine casts a linear layer's input,
    and its output's gradient, to FP8 before gathering them. Of `layers`, `moe_layers`
    issue only their attention's half (the MLP's half has the same sizes): mixture-of-
    experts layers without a shared expert, whose routed experts' tokens move by the
    dispatcher's collectives instead (dispatch_collective_time)."""
    layer_part, outside, once = tensor_parallel_plan(layers, seq, batch, hidden, tp,
                                                     embedding, recompute)
    gather = 1 if fp8 else VALUE_BYTES
    in_layers = priced(layer_part, tp, tp, hw, gather_bytes=gather) \
        * (1 - moe_layers / layers / 2)
    return (microbatches * (in_layers + priced(outside, tp, tp, hw)) + priced(once, tp, tp, hw))


def moe_count(model, spans):
    """The mixture-of-experts layers of `spans`, layer_kinds' (a layer of the kind, how
    many) pairs."""
    return sum(count for index, count in spans
               if model.experts and index >= model.dense_layers)


def tensor_parallel_plan(layers, seq, batch, hidden, tp, embedding, recompute):
    """comm_model.tensor_parallel_collectives of one micro-batch with sequence parallelism,
    in three parts: the layers' (10 a layer, 14 recomputing), the embedding's, the head's
    and the loss's (every micro-batch issues both), and the replicated gradients'
    all-reduce (once per step)."""
    plan = comm_model.tensor_parallel_collectives(
        layers, seq, batch, hidden, tp, sequence_parallel=True, embedding=embedding,
        head=True, microbatches=1, recompute=recompute)
    in_layers = layers * (14 if recompute else 10)
    return plan[:in_layers], plan[in_layers:-1], plan[-1:]


@functools.lru_cache(maxsize=65536)
def tensor_parallel_overlapped_time(model, spans, seq, batch, tp, embedding,
                                    microbatches, recompute, hw, rate, fp8, style="te",
                                    fused=True):
    """Seconds of one rank's tensor-parallel collectives in a step when each of a layer's
    sequence-parallel all-gathers and reduce-scatters runs beside a linear layer's product,
    approximated as: only what outlasts that product is exposed.

    style "te": as Transformer Engine's comm-GEMM overlap runs them (Megatron-LM's
    --tp-comm-overlap, NeMo's ub_tp_comm_overlap), ten a layer. Its three methods, per
    layer and micro-batch:
      ring_exchange  the all-gathers before QKV and the MLP's first matrix, and of the
                     gradient before the output projection's and the second matrix's
                     input-gradient products (dgrad): chunks passed between peers while
                     the product runs on the chunks already there;
      pipeline       the reduce-scatters after the output projection and the second
                     matrix: the product cut into chunks, each reduce-scattered as it is
                     produced;
      bulk           for QKV and the first matrix in backward, the input gathered again
                     (for the weight gradient) whole, beside the dgrad product, and the
                     dgrad's reduce-scatter whole, beside the weight-gradient product
                     (wgrad, as many FLOPs as the forward).
    The products run at `rate` FLOP/s, the linear layers'
    precision_model.FP8_MATMUL_RATIO times faster where `fp8`; an FP8 run also moves its
    all-gathers and the pipelined reduce-scatters in one byte a value (Transformer
    Engine's FP8 communication buffers; NeMo's FP8 overlap configuration sets fp8_buf for
    the reduce-scatters), the bulk reduce-scatters in two. Not charged: the SMs the
    transfers take from the products (the pipelined and bulk methods run on some), the
    last chunk of each pipelined reduce-scatter, which nothing hides, and what cutting a
    product into chunks costs it.

    style "torch": torch's tensor parallelism (DTensor's sequence parallelism, as
    torchtitan applies it), which keeps the gathered inputs for the weights' gradients, so
    a layer issues eight: forward, the all-gathers before QKV and the MLP's first matrix
    and the reduce-scatters after the output projection and the second matrix; backward,
    the gradient's all-gathers before the output projection's and the second matrix's
    dgrad and the reduce-scatters after QKV's and the first matrix's dgrad. Under FP8
    (torchao's float8 with its tensor-parallel styles) the all-gathers carry FP8, the
    inputs forward and the gradients backward; the reduce-scatters stay bf16. fused=False:
    plain tensor parallelism, all eight exposed. fused=True: asynchronous tensor
    parallelism (torchtitan's enable_async_tensor_parallel): torch.compile's micro-pipeline
    pass fuses each all-gather with the product that consumes it and each reduce-scatter
    with the product that feeds it, the fused kernels moving the shards by copy engine
    while the product works on those already there; the two backward reduce-scatters
    stay whole, since what they reduce is the sum of several products (QKV's three, the
    gate's and up's), which the pass cannot fuse. Not charged: what cutting a product into
    tp pieces costs it, the partial results' reduction on the SMs, and the local copy and
    barrier that start each fused kernel.

    Full recomputation repeats the forward's four in either style. In a mixture-of-experts
    layer the MLP's collectives are its shared experts' (a tensor-parallel MLP, as in
    Megatron-Core), beside their products; with no shared expert it issues none. The
    routed experts' tokens move by the dispatcher's collectives (dispatch_collective_time),
    priced with expert parallelism. The embedding's, the head's and the loss's collectives
    and the replicated gradients' all-reduce stay exposed, at their plain times."""
    speed = precision_model.FP8_MATMUL_RATIO if fp8 else 1.0
    values = seq * batch * model.hidden

    def transfer(value_bytes):
        return time_model.shard_collective_time(value_bytes * values, tp, *hw.nvlink)

    narrow, wide = transfer(1 if fp8 else VALUE_BYTES), transfer(VALUE_BYTES)
    exposed = 0.0
    layers = sum(count for _, count in spans)   # the rank's, over its chunks ((first, count))
    for layer in (i for start, count in spans for i in range(start, start + count)):
        qkv, proj, fc1, fc2 = (flops * batch * seq / tp / rate / speed
                               for flops in model.linear_flops_per_token(layer))
        moe = model.experts and layer >= model.dense_layers
        if moe:   # the shared experts' products hide their collectives; the routed
            # experts' collectives are the dispatcher's
            share = model.shared_experts / (model.top_k + model.shared_experts)
            fc1, fc2 = fc1 * share, fc2 * share
        if style == "te":
            attention = [(narrow, qkv), (narrow, proj)]
            mlp = [(narrow, fc1), (narrow, fc2)]
            pairs = [(narrow, proj), (narrow, qkv), (wide, qkv)]    # ring_exchange dgrad, bulk
            pairs += [(narrow, fc2), (narrow, fc1), (wide, fc1)]    # the same of the MLP
        else:   # torch: gathers in FP8 under torchao, reduce-scatters bf16
            if not fused:                          # plain: no product hides anything
                qkv = proj = fc1 = fc2 = 0.0
            attention = [(narrow, qkv), (wide, proj)]
            mlp = [(narrow, fc1), (wide, fc2)]
            # dgrad: the gradient's gathers fused; the reduce-scatters of summed products not
            pairs = [(narrow, proj), (wide, 0.0), (narrow, fc2), (wide, 0.0)]
        if moe and not model.shared_experts:   # no MLP collectives of its own
            mlp, pairs = [], pairs[:len(pairs) // 2]
        forward = attention + mlp
        pairs += forward * (2 if recompute else 1)
        exposed += sum(max(0.0, comm - product) for comm, product in pairs)
    _, outside, once = tensor_parallel_plan(layers, seq, batch, model.hidden, tp, embedding,
                                            recompute)
    return microbatches * (exposed + priced(outside, tp, tp, hw)) + priced(once, tp, tp, hw)


@functools.lru_cache(maxsize=65536)
def data_parallel_time(zero, params, microbatches, units, size, per_node, hw,
                       gather_bytes=VALUE_BYTES, reduce_bytes=VALUE_BYTES):
    """Seconds of a step's data-parallel collectives (comm_model.
    data_parallel_step_collectives) over `size` replicas, `per_node` of them per node, the
    parameters gathered at `gather_bytes` per element, the gradients reduced at
    `reduce_bytes`."""
    return priced(comm_model.data_parallel_step_collectives(zero, params, microbatches,
                                                            units), size, per_node, hw,
                  gather_bytes, reduce_bytes)


@functools.lru_cache(maxsize=65536)
def stage_params(model, first_layer, layers, tp, ep, first, last, matrices_only=False,
                 etp=None):
    """(dense, expert) parameters one rank of a stage holds: `layers` layers from
    `first_layer`, the embedding if `first`, the final norm and head if `last`;
    matrices_only: the layers' linear weights alone (Model.layer_params)."""
    return rank_params(model, ((first_layer, layers),), tp, ep, first, last, matrices_only,
                       etp)


@functools.lru_cache(maxsize=65536)
def rank_params(model, spans, tp, ep, first, last, matrices_only=False, etp=None):
    """stage_params of a rank whose chunks hold the layers of `spans`, ((first layer,
    layers), ...)."""
    dense = expert = 0
    for index, count in layer_kinds(model, spans):   # a layer's count depends on its kind
        d, e = model.layer_params(index, tp, ep, matrices_only, etp)
        dense, expert = dense + count * d, expert + count * e
    if matrices_only:
        return dense, expert
    return dense + model.outside_params(first, last, tp), expert


@functools.lru_cache(maxsize=65536)
def stage_footprints(model, cut, tp, ep, replicas, zero, recompute, flash,
                     fp8_activations=False, states="mixed", chunks=1, etp=None):
    """Per pipeline stage, what one rank holds whatever the micro-batches: (its model
    states {params, grads, optimizer, total} in mixed-precision Adam, the dense weights
    over `replicas` ranks and each expert's over replicas x tp / (ep x etp), the experts'
    own data parallelism (etp None: tp); the activation values per
    token it keeps for a micro-batch in flight; those of the one layer that full
    recomputation rebuilds at a time), the ranks holding `cut`'s chunks (chunk_split).
    Many layouts share these, so they are kept."""
    footprints = []
    ranks = rank_layers(model, cut, chunks)
    for stage, chunk_spans in ranks:
        first, last = stage == 0, stage == len(ranks) - 1
        count = sum(layers for _, layers in chunk_spans)
        dense, experts = rank_params(model, chunk_spans, tp, ep, first, last, False, etp)
        held = state_bytes(dense, replicas, zero, states)
        if experts:
            e = state_bytes(experts, expert_replicas(replicas, tp, ep, etp), zero, states)
            held = {k: held[k] + e[k] for k in held}
        if zero == "zero3":
            # the layer that runs is gathered whole, its 16-bit weights and its 16-bit
            # gradients before they are reduce-scattered: 4 bytes a parameter of the largest
            # transformer layer, the rate DeepSpeed's stage-3 estimate charges for its
            # largest module (memory_model.zero_offload_gpu_bytes), a lower bound for FSDP,
            # which also prefetches the next layer; of a MoE layer, its dense part and the
            # experts of this rank's ep share
            largest = largest_layer_params(model, chunk_spans, tp, ep, etp)
            whole = {"params": held["params"] + VALUE_BYTES * largest,
                     "grads": held["grads"] + VALUE_BYTES * largest}
            held = {**held, **whole, "total": held["total"] + 2 * VALUE_BYTES * largest}
        if recompute == "full":     # each layer's input, and one layer rebuilt at a time
            kept = count * model.hidden / tp
            rebuilt = max(stage_activation_values(model, start, layers, tp, flash,
                                                  fp8_activations, etp)[1]
                          for start, layers in chunk_spans)
        else:   # selective recomputation rebuilds attention's s x s part: none kept
            kept = sum(stage_activation_values(model, start, layers, tp,
                                               flash or recompute != "none",
                                               fp8_activations, etp)[0]
                       for start, layers in chunk_spans)
            rebuilt = 0
        footprints.append((held, kept, rebuilt))
    return tuple(footprints)


def layer_kinds(model, spans):
    """[(a layer of the kind, how many)] of spans' layers, dense then MoE, those present:
    a layer's parameters and activations depend on its kind alone (Model.layer_params).
    Each pair is also a span of that many layers of its kind (the dense ones come first),
    so the cached functions that take spans take these, and ranks alike share them."""
    moe = sum(max(0, start + count - max(start, model.dense_layers))
              for start, count in spans) if model.experts else 0
    dense = sum(count for _, count in spans) - moe
    return [(index, count) for index, count in ((0, dense), (model.dense_layers, moe)) if count]


@functools.lru_cache(maxsize=4096)
def rank_layers(model, cut, chunks=1):
    """[(rank, its layers as layer_kinds gives them)] of a cut of pp x chunks virtual
    stages: what each rank holds, not where, so that ranks alike share the caches of what
    is priced from them."""
    return [(rank, tuple(layer_kinds(model, spans))) for rank, spans in stage_spans(cut, chunks)]


@functools.lru_cache(maxsize=65536)
def largest_layer_params(model, spans, tp, ep, etp=None):
    """The parameters one rank holds of its largest layer, its chunks holding `spans`."""
    return max(sum(model.layer_params(index, tp, ep, False, etp))
               for index, _ in layer_kinds(model, spans))


def expert_replicas(replicas, tp, ep, etp=None):
    """The ranks holding the same expert weights, the experts' data parallelism, of
    `replicas` ranks holding the same dense weights: Megatron-Core lays the experts' etp x
    ep x edp over the same tp x cp x dp ranks (memory_model.expert_data_parallel_size of a
    stage's ranks), so edp = tp x cp x dp / (ep x etp)."""
    return memory_model.expert_data_parallel_size(replicas * tp, 1, ep, etp or tp)


@functools.lru_cache(maxsize=65536)
def state_bytes(params, replicas, zero, states):
    """memory_model.state_bytes_per_gpu, kept: middle ranks often hold as many parameters.
    Read it, never change it."""
    return memory_model.state_bytes_per_gpu(params, replicas, zero, precision=states)


@functools.lru_cache(maxsize=65536)
def stage_activation_values(model, first_layer, layers, tp, flash, fp8_activations=False,
                            etp=None):
    """(sum, largest) of layer_activation_values over a stage's layers."""
    values = [model.layer_activation_values(i, tp, True, flash, fp8_activations, etp)
              for i in range(first_layer, first_layer + layers)]
    return sum(values), max(values, default=0)


def chunk_flops(model, cut, flash=True):
    """[FLOPs per token of each virtual stage (chunk) holding `cut`'s layers, in order]: each
    layer 6 x its active parameters and attention's products, the head's 6 V h on the last."""
    attention = model.attention_flops_per_token() / model.layers * (0.5 if flash else 1)
    routed_unused = (model.experts - model.top_k) * sum(model.mlp(model.expert_hidden)) \
        if model.experts else 0

    def layer_flops(i):
        unused = routed_unused if model.experts and i >= model.dense_layers else 0
        return 6 * (sum(model.layer_params(i)) - unused) + attention

    chunks, start = [], 0
    for count in cut:
        chunks.append(sum(layer_flops(i) for i in range(start, start + count)))
        start += count
    chunks[-1] += 6 * model.vocab * model.hidden   # the logits' product, tied weights or not
    return chunks


def stage_flops(model, cut, flash=True, chunks=1):
    """[FLOPs per token of each pipeline rank]: the sum of its chunks' (chunk_flops); `cut`
    holds the layers of each of pp x chunks virtual stages, virtual stage j on rank j mod
    pp, as Megatron-LM and torch's interleaved schedules place them."""
    pp = len(cut) // chunks
    per_chunk = chunk_flops(model, cut, flash)
    return [sum(per_chunk[rank::pp]) for rank in range(pp)]


def expert_matmul_slowdown(model, tokens, etp, ep, rate, hw, fp8=False,
                           grad_bytes=VALUE_BYTES):
    """How much longer the routed experts' matrix products take than their FLOPs at `rate`
    say (>= 1), by the roofline: a product runs at the slower of its FLOPs and the HBM
    traffic of its operands and result, read and written once (Williams et al., 2009).
    One of a rank's experts sees ep x tokens x top_k / experts tokens per micro-batch
    (`tokens`: a micro-batch's on the etp ranks of an expert tensor-parallel group, whose
    routed copies Megatron-Core's dispatcher gathers for each of them; routing balanced)
    against weights of hidden x expert_hidden / etp: a few hundred tokens bring it near
    the roofline's ridge, where HBM traffic rather than arithmetic can bound it. Each of
    the two matrices runs three products of the same FLOPs: forward, the inputs' gradient, and the weights' gradient,
    which adds into the gradient buffer (`grad_bytes` a value, read and written, as
    Megatron-Core's fused gradient accumulation does). A lower bound on the time: the
    datasheet's bandwidth, and none of the tile and wave quantization small products also
    pay."""
    rows = ep * tokens * model.top_k / model.experts
    width = model.expert_hidden / etp
    first = width * (1 if model.gpt else 2)          # fc1, or SwiGLU's gate and up
    in_bytes = 1 if fp8 else VALUE_BYTES             # FP8 operands, 16-bit results
    speed = rate * (precision_model.FP8_MATMUL_RATIO if fp8 else 1)
    bandwidth = hw.memory_tb_s * 1e12
    compute = slow = 0.0
    for k, n in ((model.hidden, first), (width, model.hidden)):
        seconds = 2 * rows * k * n / speed
        for traffic in (in_bytes * (rows * k + k * n) + VALUE_BYTES * rows * n,   # Y = X W
                        in_bytes * (rows * n + k * n) + VALUE_BYTES * rows * k,   # dX = dY W'
                        in_bytes * (rows * k + rows * n) + 2 * grad_bytes * k * n):  # dW +=
            compute += seconds
            slow += max(seconds, traffic / bandwidth)
    return slow / compute


# Layers an end stage may give up to the others (Llama 3 took one off each end; Megatron-LM
# sets the end stages' counts with --decoder-first/last-pipeline-num-layers)
MAX_END_TRIM = 2


def rank_chunks(totals, chunks, size):
    """The layers of each of pp x chunks virtual stages, in order (virtual stage j on rank
    j mod pp), from each rank's total: a middle rank's as even as they go (the later chunks
    one more), an end rank's in chunks of `size`, the end chunk (the embedding's on the
    first rank, the head's on the last) keeping what is left, none or more; None where a
    chunk other than an end one would be empty."""
    pp = len(totals)
    per_rank = []
    for rank, total in enumerate(totals):
        end = chunks > 1 and rank in (0, pp - 1)
        if chunks == 1:
            own = [total]
        elif end and 0 <= total - (chunks - 1) * size <= size:
            own = [total - (chunks - 1) * size] + [size] * (chunks - 1)
        elif total >= chunks:
            own = memory_model.stage_layers(total, chunks)
        elif end and total == chunks - 1:   # the end chunk with none, the others one each
            own = [0] + [1] * (chunks - 1)
        else:
            return None
        if end and rank == pp - 1:
            own.reverse()              # the head's chunk, the smallest, last
        per_rank.append(own)
    return tuple(per_rank[j % pp][j // pp] for j in range(pp * chunks))


@functools.lru_cache(maxsize=4096)
def chunk_split(model, pp, chunks=1, flash=True):
    """The layers of each of the pp x chunks virtual stages (virtual stage j on rank j mod
    pp; one per rank without interleaving), as the planner cuts them, or None where no cut
    can run. From the even cut of the ranks (memory_model.stage_layers), up to MAX_END_TRIM
    layers come off the first and the last rank and spread over the others, as Llama 3
    balanced its pipeline (Dubey et al., 2024, section 3.3.2): the last stage also runs the
    head, and the first holds the most micro-batches in flight. Each rank's layers then go
    to its chunks (rank_chunks), in chunks of L / (pp v) layers rounded up on the end
    ranks, whose end chunk takes what is left, down to no layer at all, only the embedding
    or the head: Llama 3's 126 layers over 16 stages of 8 chunks (§3.3.2), or
    Megatron-Bridge's DeepSeek-V3 layout on H100s (one layer in the first of 32 virtual
    stages, two in each of the next 30, none in the last). The cut whose slowest rank has
    the fewest FLOPs wins; of cuts as fast, the one that takes most off the first rank,
    then least off the last."""
    layers = model.layers
    if layers < pp or pp * chunks > most_virtual_stages(model, chunks):
        return None
    even = memory_model.stage_layers(layers, pp)
    size = -(-layers // (pp * chunks))
    best = None
    for first_trim in range(MAX_END_TRIM + 1):
        for last_trim in range(MAX_END_TRIM + 1):
            first, last = even[0] - first_trim, even[-1] - last_trim
            if pp == 1:
                if first_trim or last_trim:
                    continue
                totals = (layers,)
            elif pp == 2:
                if first_trim:      # two stages: what the last gives up, the first takes
                    continue
                totals = (layers - last, last)
            else:
                rest = layers - first - last
                if first < 0 or last < 0 or rest < pp - 2:
                    continue
                totals = (first, *memory_model.stage_layers(rest, pp - 2), last)
            cut = rank_chunks(totals, chunks, size)
            if cut is None or (chunks == 1 and min(cut) < 1):
                continue
            key = (max(stage_flops(model, cut, flash, chunks)), -first_trim, last_trim)
            if best is None or key < best[0]:
                best = (key, cut)
    return None if best is None else best[1]


def most_virtual_stages(model, chunks):
    """The most virtual stages a cut can have: a layer each, and interleaved, an end chunk
    at either end with none (chunk_split)."""
    return model.layers + (2 if chunks > 1 else 0)


@functools.lru_cache(maxsize=4096)
def stage_split(model, pp, chunks=1, flash=True):
    """The layers each of the pp ranks holds (the sum of its chunks, chunk_split), or None
    where no cut can run."""
    cut = chunk_split(model, pp, chunks, flash)
    return None if cut is None else tuple(sum(cut[rank::pp]) for rank in range(pp))


@functools.lru_cache(maxsize=4096)
def stage_imbalance(model, cut, flash=True, chunks=1):
    """The slowest pipeline rank's FLOPs over the mean rank's (stage_flops)."""
    if len(cut) == chunks:
        return 1.0
    stages = stage_flops(model, cut, flash, chunks)
    return max(stages) * len(stages) / sum(stages)


@functools.lru_cache(maxsize=4096)
def stage_spans(cut, chunks=1):
    """[(rank, ((first layer, layers) of each of its chunks))] of a cut of pp x chunks
    virtual stages."""
    pp = len(cut) // chunks
    starts = (0, *itertools.accumulate(cut))
    return [(rank, tuple((starts[j], cut[j]) for j in range(rank, len(cut), pp)))
            for rank in range(pp)]


@functools.lru_cache(maxsize=65536)
def slowest_data_parallel_time(model, cut, tp, ep, zero, microbatches, replicas, precision,
                               hw, states, chunks=1, etp=None, dualpipe=False):
    """The longest of the ranks' data-parallel times (stage_data_parallel_time): the
    pipeline moves at its slowest stage. Under DualPipe a rank holds stages r and
    pp - 1 - r, each over twice the replicas (as memory() counts them), and reduces both."""
    ranks = rank_layers(model, cut, chunks)
    copies = 2 if dualpipe else 1
    per_stage = [stage_data_parallel_time(model, chunk_spans, stage == 0,
                                          stage == len(ranks) - 1, tp, ep, zero, microbatches,
                                          copies * replicas, precision, hw, states, etp)
                 for stage, chunk_spans in ranks]
    if dualpipe:
        return max(t + per_stage[-1 - r] for r, t in enumerate(per_stage))
    return max(per_stage)


@functools.lru_cache(maxsize=4096)
def most_moe_layers(model, cut, chunks=1):
    """The MoE layers of the rank that holds most of them."""
    return max(moe_count(model, spans) for _, spans in rank_layers(model, cut, chunks))


@functools.lru_cache(maxsize=65536)
def stage_data_parallel_time(model, spans, first, last, tp, ep, zero, microbatches,
                             replicas, precision, hw, states="mixed", etp=None):
    """Seconds of one rank's data-parallel collectives in a step, its chunks holding the
    layers of `spans` ((first layer, layers), ...): its dense parameters over the dp x cp
    replicas (tp apart), its experts' over their own data parallelism (expert_replicas,
    etp x ep apart), the parameters gathered in the recipe's bytes (FP8 for the linear
    weights under fp8)."""
    etp = etp or tp
    dense, experts = rank_params(model, spans, tp, ep, first, last, False, etp)
    matrices = rank_params(model, spans, tp, ep, first, last, True, etp)
    count = sum(layers for _, layers in spans)
    total = 0.0
    for params, fp8_params, size, inner in (
            (dense, matrices[0], replicas, tp),
            (experts, matrices[1], expert_replicas(replicas, tp, ep, etp), etp * ep)):
        if params and size > 1:
            per_node = members_per_node(inner, size, hw)
            gather = precision_model.gather_bytes_per_value(precision, fp8_params / params)
            total += data_parallel_time(zero, params, microbatches, count, size, per_node, hw,
                                        gather, precision_model.RECIPES[states].reduce)
    return total


@functools.lru_cache(maxsize=4096)
def dispatch_collective_time(model, tokens, ep, etp, hw):
    """Seconds of one of a MoE layer's four dispatcher passes for one micro-batch (the
    dispatch and the combine forward, and their gradients backward), a rank's `tokens`
    (its sequence-parallel share of a micro-batch) reaching the experts of its etp x ep
    ranks (etp innermost). The cheaper of two of Megatron-Core's dispatchers; a run fixes
    one for all its layouts, so for a layout it did not tune this is a lower bound:
      all-to-all  each token to its top_k experts over the ep ranks, which sit etp apart,
                  then each copy a rank receives gathered over the etp ranks that split its
                  expert's matrices (an all-gather on NVLink; the combine reduce-scatters
                  it back). Across nodes, where routing is node-limited (node_limit), one
                  copy per node reached and forwarded inside it, as DeepEP and HybridEP
                  (Megatron-Core's flex dispatcher) send them, not one per expert as
                  NCCL's all-to-all would;
      all-gather  every token gathered over the etp x ep ranks, each rank keeping those
                  routed to its experts (the combine reduce-scatters): Megatron-Core's
                  default, cheaper with few ranks and a large top_k.
    The routing map and probabilities that travel with the tokens are left out."""
    all_to_all = 0.0
    if ep > 1:
        per_node = members_per_node(etp, ep, hw)
        nodes = max(1, ep // per_node)
        copies = model.top_k * (ep - 1) / ep
        nv_bytes = VALUE_BYTES * tokens * model.hidden * copies
        if nodes > 1:
            # node-limited: one copy per node reached, forwarded inside it; otherwise one
            # copy per routed expert on another node
            off_node = float(comm_model.expected_network_copies(
                model.experts, nodes, model.top_k, model.node_limit or None,
                once_per_node=bool(model.node_limit)))
            net_bytes = VALUE_BYTES * tokens * model.hidden * off_node
            all_to_all += max(hw.network[0] + net_bytes / hw.network[1],
                              hw.nvlink[0] + nv_bytes / hw.nvlink[1])
        else:
            all_to_all += hw.nvlink[0] + nv_bytes / hw.nvlink[1]
    if etp > 1:   # the gathered copies of the etp ranks' tokens, top_k of each
        gathered = VALUE_BYTES * etp * tokens * model.top_k * model.hidden
        all_to_all += time_model.shard_collective_time(gathered, etp, *hw.nvlink)
    group = etp * ep
    all_gather = group_time("all_gather", VALUE_BYTES * tokens * group * model.hidden, group,
                            members_per_node(1, group, hw), hw)
    return min(all_to_all, all_gather)


def members_per_node(inner, size, hw):
    """Ranks of a group of `size` (its members `inner` ranks apart) on one node: as many
    as the node holds, in whole shares of the group."""
    return math.gcd(size, hw.gpus_per_node // inner) if inner < hw.gpus_per_node else 1


def memory(model, layout, settings, hw):
    """{params, grads, optimizer, states, activations, logits, total, stage} bytes on the
    fullest GPU of `layout` (dp, tp, pp, cp, ep, v, micro_batch, microbatches, zero,
    recompute; dualpipe). With dualpipe = 1, DualPipe (DeepSeek-V3 §3.2.1): rank r holds
    stages r and pp - 1 - r, two copies of the parameters (the report's Table 2), each with
    its own weights and gradients; a stage's two copies are one parameter set with twice
    the replicas (DualPipe's example sums their gradients), so ZeRO shards over 2 dp cp
    ranks, as memory_model.moe_bytes_per_gpu(param_copies=2) does. The micro-batches are
    memory_model.dualpipe_peak_microbatches'; "stage" is then the rank and "stages" its two
    stages."""
    tp, pp, cp, ep, v = (layout[k] for k in ("tp", "pp", "cp", "ep", "chunks"))
    b, m, zero, recompute = (layout[k] for k in ("micro_batch", "microbatches", "zero",
                                                  "recompute"))
    replicas = layout["dp"] * cp                 # ranks holding the same dense weights
    if layout.get("dualpipe"):                   # and as many again on rank pp - 1 - r
        replicas *= 2
    schedule = "interleaved" if v > 1 else "1f1b"
    in_flight = memory_model.pipeline_peak_microbatches(schedule, pp, m, v)
    tokens = model.seq // cp * b                  # of one micro-batch, on this rank
    cut = chunk_split(model, pp, v, settings.flash_attention)
    footprints = stage_footprints(model, cut, tp, ep, replicas, zero, recompute,
                                  settings.flash_attention, settings.fp8_activations,
                                  settings.states, v, layout.get("etp", tp))
    # the last stage's head: the final norm's input and output (split by sequence
    # parallelism) and the logits' softmax in fp32, split over the vocabulary, for the
    # micro-batch whose backward comes next (memory_model.stage_activation_bytes)
    head_bytes = (VALUE_BYTES * 2 * model.hidden / tp + 4 * model.vocab / tp) * tokens
    if not layout.get("dualpipe"):
        # one stage per rank, micro-batches (1F1B) or chunk-micro-batches of 1/v of the
        # layers in flight: the loop below, written out, as the planner runs it most
        worst_total, worst_stage = None, None
        for stage, (states, kept_values, rebuilt_values) in enumerate(footprints):
            head = head_bytes if stage == pp - 1 else 0
            kept = VALUE_BYTES * tokens * in_flight[stage] / v * kept_values
            if recompute == "full":
                activations = kept + max(VALUE_BYTES * tokens * rebuilt_values, head)
            else:
                activations = kept + head
            if worst_total is None or states["total"] + activations > worst_total:
                worst_total = states["total"] + activations
                worst_stage = (stage, states, activations, head)
        stage, states, activations, head = worst_stage
        return {"params": states["params"], "grads": states["grads"],
                "optimizer": states["optimizer"], "states": states["total"],
                "activations": activations, "logits": head, "total": worst_total,
                "stage": stage}
    holdings = memory_model.dualpipe_peak_microbatches(pp, m)   # [(stage, held)] per rank
    worst = None
    for rank, held_stages in enumerate(holdings):
        states = footprints[held_stages[0][0]][0]
        for stage, _ in held_stages[1:]:
            states = {k: states[k] + footprints[stage][0][k] for k in states}
        kept = sum(VALUE_BYTES * tokens * held * footprints[stage][1]
                   for stage, held in held_stages)
        rebuilt = max(footprints[stage][2] for stage, _ in held_stages)
        last = any(stage == pp - 1 for stage, _ in held_stages)
        head = head_bytes if last else 0
        if recompute == "full":   # backward starts at the head, then rebuilds layer by layer
            activations = kept + max(VALUE_BYTES * tokens * rebuilt, head)
        else:
            activations = kept + head
        total = states["total"] + activations
        if worst is None or total > worst["total"]:
            worst = {"params": states["params"], "grads": states["grads"],
                     "optimizer": states["optimizer"], "states": states["total"],
                     "activations": activations, "logits": head, "total": total,
                     "stage": rank}
            worst["stages"] = tuple(stage for stage, _ in held_stages)
    return worst


def step_time(model, layout, settings, hw):
    """{compute, recompute, bubble, tp, pp, dp, cp, ep, step} seconds of one step."""
    dp, tp, pp, cp, ep, v = (layout[k] for k in ("dp", "tp", "pp", "cp", "ep", "chunks"))
    etp = layout.get("etp", tp)
    b, m, zero, recompute = (layout[k] for k in ("micro_batch", "microbatches", "zero",
                                                  "recompute"))
    n, rate = hw.gpus, hw.peak_tflops * 1e12 * settings.mfu
    tokens = settings.global_batch_tokens
    # Attention's products as executed: a fused kernel skips the blocks a causal mask hides
    attention = model.attention_flops_per_token() * (0.5 if settings.flash_attention else 1)
    dense = 6 * model.active_params()
    # FP8 runs the layers' linear products at its measured higher rate, the rest stays bf16
    fp8 = 6 * model.active_matrix_params() if settings.precision == "fp8" else 0
    compute = (dense - fp8 + fp8 / precision_model.FP8_MATMUL_RATIO + attention) \
        * tokens / n / rate
    if model.experts:   # the routed experts' products where their operands' traffic bounds them
        routed = 6 * model.top_k * model.moe_layers * model.mlp(model.expert_hidden)[0]
        routed_s = routed / (precision_model.FP8_MATMUL_RATIO if fp8 else 1) * tokens / n / rate
        slowdown = expert_matmul_slowdown(
            model, b * (model.seq // cp) // tp * etp, etp, ep, rate, hw,
            settings.precision == "fp8", precision_model.RECIPES[settings.states].grads)
        compute += routed_s * (slowdown - 1)
    forward = compute / 3
    extra = {"none": 0.0, "full": forward,
             "selective": attention / 3 * tokens / n / rate}[recompute]
    work = compute + extra
    # The pipeline waits for its slowest stage (the embedding's and the head's work sit on
    # the first and last), and idles in the schedule's fill and drain. Interleaved, the
    # fill and drain wait on the other ranks' first chunks: a rank's time over v stands in
    # for them, exact when the chunks hold the same layers
    cut = chunk_split(model, pp, v, settings.flash_attention)
    split = stage_split(model, pp, v, settings.flash_attention)
    slowest = work * stage_imbalance(model, cut, settings.flash_attention, v)
    if layout.get("dualpipe"):
        # DeepSeek-V3's Table 2: (pp/2 - 1)(F&B + B - 3W) per micro-batch, F&B the
        # overlapped forward and backward (F + B when compute-bound), B the backward with
        # any recomputed forward, W the weights' gradients, half the backward proper (= F):
        # 2B - 2F, two thirds of a micro-batch's work without recomputation
        b_time = work - forward
        bubble = slowest - work + (pp / 2 - 1) * (2 * b_time - 2 * forward) / work * slowest / m
    else:
        fraction = time_model.pipeline_bubble_fraction(pp, m, v)
        bubble = slowest / (1 - fraction) - work

    seq = model.seq // cp
    node = hw.gpus_per_node
    # tensor parallelism: the one traffic model (comm_model), the stage with most layers;
    # a MoE layer's MLP collectives are its shared experts' (its routed experts' tokens
    # move by the dispatcher's collectives, priced with expert parallelism below): without
    # a shared expert it issues only its attention's half
    tp_s = 0.0
    torch_tp = settings.torch_tp or settings.async_tp
    if tp > 1 and (settings.tp_comm_overlap or torch_tp):
        # the stage whose exposed traffic is longest
        style = "torch" if torch_tp else "te"
        tp_s = max(tensor_parallel_overlapped_time(
            model, spans, seq, b, tp, pp == 1, m, recompute == "full", hw, rate,
            settings.precision == "fp8", style, settings.tp_comm_overlap or settings.async_tp)
            for _, spans in rank_layers(model, cut, v))
        if not (settings.tp_comm_overlap or settings.async_tp):   # plain torch TP
            tp_s *= 1 - settings.tp_overlap
    elif tp > 1:   # a stated fraction hidden (--tp-overlap), or none
        tp_s = max(tensor_parallel_time(
            sum(count for _, count in spans), seq, b, model.hidden, tp, pp == 1, m,
            recompute == "full", hw, settings.precision == "fp8",
            0 if model.shared_experts else moe_count(model, spans))
            for _, spans in rank_layers(model, cut, v)) * (1 - settings.tp_overlap)
    # pipeline: an activation forward and its gradient back per micro-batch and chunk; each
    # tensor-parallel rank sends its own 1/tp of the tokens (sequence parallelism splits
    # them, as Megatron-LM's scatter/gather does without it) of its s/cp
    pp_s = 0.0
    if pp > 1:
        alpha, beta = hw.nvlink if tp * cp * dp * pp <= node else hw.network
        pp_s = m * v * 2 * (alpha + VALUE_BYTES * b * seq * model.hidden / tp / beta)
    # data parallelism over the dp x cp replicas (experts over expert_replicas), hierarchical:
    # the stage whose collectives take longest (the pipeline moves at its slowest stage)
    dp_s = slowest_data_parallel_time(model, cut, tp, ep, zero, m, dp * cp,
                                      settings.precision, hw, settings.states, v, etp,
                                      bool(layout.get("dualpipe")))
    backward = 2 * forward
    window = {"ddp": backward / m, "zero1": backward / m, "zero2": backward,
              "zero3": work}[zero]
    dp_exposed = max(0.0, dp_s - window)
    # context parallelism: the ring passes K and V blocks; each step overlaps one block
    cp_s = 0.0
    if cp > 1:
        link = hw.nvlink if tp * cp <= node else hw.network
        q, k_width, v_width, out = model.attention_widths()
        block = VALUE_BYTES * b * seq * (k_width + v_width) / tp   # this rank's heads' K, V
        send = link[0] + block / link[1]
        # scores and weighted values of one block, forward and backward, causal
        block_flops = 2 * b * seq * seq * (q + out) / tp * 0.5 * 3
        per_layer = (cp - 1) * max(0.0, 2 * send - block_flops / rate) if cp > 1 else 0.0
        cp_s = per_layer * max(split) * m
    # expert parallelism: the dispatcher's dispatch and combine, forward and backward,
    # exposed, and the forward's again where full recomputation reruns it, as it reruns
    # the tensor-parallel collectives
    ep_s = 0.0
    if model.experts and (ep > 1 or etp > 1):
        passes = 6 if recompute == "full" else 4
        ep_s = passes * dispatch_collective_time(model, b * seq / tp, ep, etp, hw) \
            * most_moe_layers(model, cut, v) * m
    if layout.get("dualpipe"):   # one micro-batch's all-to-alls run beside another's compute
        exposed = max(0.0, ep_s + pp_s - work)   # what outlasts the computation, as ep
        ep_s, pp_s = exposed, 0.0
    elif settings.ep_overlap:
        ep_s = max(0.0, ep_s - work)
    result = {"compute": compute, "recompute": extra, "bubble": bubble, "tp": tp_s,
              "pp": pp_s, "dp": dp_exposed, "cp": cp_s, "ep": ep_s}
    result["step"] = sum(result.values())
    return result


def mfu(model, settings, hw, step_s, with_attention=False):
    """Model FLOPs over the step's peak FLOPs: 6 x (active) parameters per token, plus
    attention's 12 L h s with_attention (Megatron-LM's and PaLM's count, recomputation
    not counted)."""
    flops = 6 * model.active_params() + (model.attention_flops_per_token()
                                         if with_attention else 0)
    return flops * settings.global_batch_tokens / (step_s * hw.gpus * hw.peak_tflops * 1e12)


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
            "fits": mem["total"] <= hw.gpu_memory_gb * 1e9,
            "time_s": time_s,
            "tokens_per_s_per_gpu": settings.global_batch_tokens / time_s["step"] / hw.gpus,
            "mfu": mfu(model, settings, hw, time_s["step"]),
            "mfu_with_attention": mfu(model, settings, hw, time_s["step"], True)}


def settings_for(model, degrees, settings):
    """Every (micro-batch, chunks, ZeRO stage, recomputation) to try with `degrees`."""
    sequences = settings.global_batch_tokens // model.seq // degrees["dp"]
    pp = degrees["pp"]
    chunk_options = [degrees["chunks"]] if "chunks" in degrees else \
        [v for v in CHUNKS if pp > 1 or v == 1]
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
                           "recompute": recompute, "sequence_parallel": degrees["tp"] > 1}


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
            if mem["total"] <= hw.gpu_memory_gb * 1e9:   # only what fits is timed
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
                  f"recompute {smallest['recompute']}), more than "
                  f"{hw.gpu_memory_gb:g} GB")
        return {**layout, "rank": None, "step_time_s": None, "best_step_time_s": best_time,
                "reason": reason}
    mine = fitting[0]
    rank = 1 + sum(1 for c in found if c["time_s"]["step"] < mine["time_s"]["step"])
    return {**mine, "rank": rank, "step_time_s": mine["time_s"]["step"],
            "best_step_time_s": min(best_time or math.inf, mine["time_s"]["step"]),
            "reason": None}


def parse_layout(text):
    """'tp=8,pp=16,dp=128[,cp=..,ep=..,etp=..,v=..,dualpipe=1]' -> {dp, tp, pp, cp, ep,
    etp[, chunks, dualpipe]}; etp is tp where not given (Megatron-Core's default)."""
    names = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "etp": "etp",
             "v": "chunks", "dualpipe": "dualpipe"}
    layout = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in names or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"not a layout: {text!r} "
                             f"(tp=8,pp=16,dp=128[,cp=2,ep=8,etp=1,v=2,dualpipe=1], "
                             f"each a positive whole number)")
        layout[names[key]] = int(value)
    missing = {"dp", "tp", "pp"} - set(layout)
    if missing:
        raise ValueError(f"the layout {text!r} needs {', '.join(sorted(missing))}")
    return {"cp": 1, "ep": 1, "etp": layout["tp"], **layout}


def plan(model, settings, hw, cp=None, ep=None):
    """The fitting configurations, fastest first, one per setting of everything but the
    recomputation when that is 'auto' (settings.recompute = RECOMPUTE)."""
    found = configurations(model, settings, hw, cp, ep)
    return cheapest_recompute(found) if len(settings.recompute) > 1 else found


ASPECT = 128             # hidden / layers of GPT-3's models: a shape from a parameter count
HEAD_DIM = 128
GPT_VOCAB = 51200        # GPT-2's vocabulary, padded as Megatron-LM pads it


def shape_from_params(params, seq, vocab=GPT_VOCAB):
    """A GPT-3-like Model of about `params` parameters: hidden = 128 x layers, heads of
    128, hidden a multiple of 128 (Brown et al., 2020, Table 2.1 keeps hidden / layers
    near 128 for the larger models)."""
    hidden = max(HEAD_DIM, round((ASPECT * params / 12) ** (1 / 3) / HEAD_DIM) * HEAD_DIM)
    layers = max(1, round((params - (2 * vocab + seq) * hidden) / (12 * hidden ** 2)))
    return Model(layers=layers, hidden=hidden, heads=hidden // HEAD_DIM, seq=seq, vocab=vocab)


def _deepseek_v3():
    c = memory_model.DEEPSEEK_V3
    attention = memory_model.mla_attention_params(
        c["hidden"], c["heads"], c["q_rank"], c["kv_rank"], c["head_dim"], c["rope_dim"],
        c["v_head_dim"])
    return Model(layers=c["layers"], hidden=c["hidden"], heads=c["heads"], seq=4096,
                 vocab=c["vocab"], ffn_hidden=c["dense_ffn"], gpt=False,
                 experts=c["routed_experts"], top_k=c["top_k"], expert_hidden=c["expert_ffn"],
                 shared_experts=c["shared_experts"], dense_layers=c["dense_layers"],
                 attention_params=attention, qk_head_dim=c["head_dim"] + c["rope_dim"],
                 v_head_dim=c["v_head_dim"], node_limit=4, name="DeepSeek-V3")


# Published shapes. GPT-3: Brown et al. (2020), Table 2.1, its vocabulary padded to 51,200
# as Megatron-LM pads GPT-2's. Llama 3: Dubey et al. (2024), Table 3 (8,192-token
# pre-training sequences). DeepSeek-V3: its report, section 2 and 4.2 (4,096-token
# sequences), memory_model.DEEPSEEK_V3.
PRESETS = {
    "gpt3-175b": Model(96, 12288, 96, 2048, 51200, name="GPT-3 175B"),
    "llama3-8b": Model(32, 4096, 32, 8192, 128256, ffn_hidden=14336, kv_heads=8, gpt=False,
                       name="Llama 3 8B"),
    "llama3-70b": Model(80, 8192, 64, 8192, 128256, ffn_hidden=28672, kv_heads=8, gpt=False,
                        name="Llama 3 70B"),
    "llama3-405b": Model(126, 16384, 128, 8192, 128256, ffn_hidden=53248, kv_heads=8,
                         gpt=False, name="Llama 3 405B"),
    "deepseek-v3": _deepseek_v3(),
}

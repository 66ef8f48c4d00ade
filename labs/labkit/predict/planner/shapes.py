"""The model's shape and what it holds: a decoder-only transformer (Model), the parameters one
rank holds of a span of its layers split tp and ep ways, and a GPT-3-like shape from a
parameter count. Imports nothing of the planner: every other file of it builds on this one."""

import dataclasses
import functools

from .. import memory_model, time_model


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
        """Parameters of the embedding (first stage) and final norm and head (last). A
        head tied to the embedding shares its weights where one stage holds both; on a last
        stage that is not the first, Megatron-LM keeps a copy of them for the head, whose
        gradient it sums with the embedding's (memory_model.stage_params_per_rank)."""
        h = self.hidden
        count = 0
        if first:
            count += self.vocab * h / tp + (self.seq * h if self.gpt else 0)
        if last:   # a tied head on another stage than the embedding keeps a copy of it
            count += (2 * h if self.gpt else h) + (0 if self.tied and first
                                                   else self.vocab * h / tp)
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

    def attention_flops_executed_per_token(self, flash=True):
        """Attention's products as a kernel runs them, forward and backward, per token: the
        forward's two (attention_flops_per_token's third) and a backward of
        time_model.attention_products_flops' ratio to it, 2.5 times the forward where a
        fused kernel (FlashAttention) recomputes Q K^T, twice where the weights P are
        kept; a fused kernel also skips the blocks a causal mask hides, half of them. The
        MFU keeps the conventional count (attention_flops_per_token), not this one."""
        products = time_model.attention_products_flops(self.seq, 1, 1, fused=flash)
        forward = self.attention_flops_per_token() / 3
        return forward * (1 + products["backward"] / products["forward"]) \
            * (0.5 if flash else 1)

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


# dataclass(frozen=True) writes a __hash__ of its own into the class: put the cached one back
Model.__hash__ = HashedOnce.__hash__


def layer_kinds(model, spans):
    """[(a layer of the kind, how many)] of spans' layers, dense then MoE, those present:
    a layer's parameters and activations depend on its kind alone (Model.layer_params).
    Each pair is also a span of that many layers of its kind (the dense ones come first),
    so the cached functions that take spans take these, and ranks alike share them."""
    moe = sum(max(0, start + count - max(start, model.dense_layers))
              for start, count in spans) if model.experts else 0
    dense = sum(count for _, count in spans) - moe
    return [(index, count) for index, count in ((0, dense), (model.dense_layers, moe)) if count]


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
def largest_layer_params(model, spans, tp, ep, etp=None):
    """The parameters one rank holds of its largest layer, its chunks holding `spans`."""
    return max(sum(model.layer_params(index, tp, ep, False, etp))
               for index, _ in layer_kinds(model, spans))


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

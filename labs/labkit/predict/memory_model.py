"""Memory cost models: bytes per GPU of parameters, gradients and optimizer state under
DDP and ZeRO-1/2/3, the parameter count and activation memory of a transformer, and the
exact shard layouts of torch's ZeRO-1 and FSDP2 implementations.

Pure functions, no process group: the chapter computes its predictions with them, the
memory lab reports them beside what it measures, and the tests check them against the
ZeRO paper's numbers and by hand.

Symbols follow the ZeRO paper (Rajbhandari et al., 2020): psi parameters, N data-parallel
ranks, K bytes of optimizer state per parameter.
"""

import math

from . import precision_model

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
OPTIMIZERS = ("adam", "sgd", "momentum")
PRECISIONS = ("fp32", "mixed")   # the memory chapter's two; precision_model.RECIPES has more

# Bytes of optimizer state per parameter, kept in fp32 whatever the training precision.
OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}  # -, momentum, (momentum, variance)
FP32_MASTER_BYTES = 4  # mixed precision keeps an fp32 copy of the weights for the update


def bytes_per_parameter(optimizer="adam", precision="mixed"):
    """(parameter, gradient, optimizer) bytes per parameter, before any sharding.

    fp32: 4 + 4 + state. Mixed precision (fp16/bf16 weights and gradients, the update in
    fp32): 2 + 2 + K, where K = fp32 master copy + fp32 state; Adam gives K = 12 and 16
    bytes in all, the ZeRO paper's 16 psi. `precision` may also name any other recipe of
    precision_model.RECIPES: FSDP2's mixed precision keeps the fp32 shard itself as the
    master (4 + 4 + state), and differs only in what it gathers and reduces.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if precision not in precision_model.RECIPES:
        raise ValueError(f"unknown precision {precision!r}; choose from "
                         f"{', '.join(precision_model.RECIPES)}")
    recipe = precision_model.RECIPES[precision]
    return recipe.params, recipe.grads, recipe.master + OPTIMIZER_STATE_BYTES[optimizer]


def _whole_if_integral(x):
    return int(x) if float(x).is_integer() else x


def state_bytes_per_gpu(params, gpus, strategy, optimizer="adam", precision="mixed"):
    """{params, grads, optimizer, total} bytes one GPU holds for `params` parameters.

    ddp    replicates all three:            (P + G + K) psi
    zero1  shards the optimizer state:      P psi + G psi + K psi / N
    zero2  ... and the gradients:           P psi + (G + K) psi / N
    zero3  ... and the parameters:          (P + G + K) psi / N
    """
    if params < 0 or gpus < 1:
        raise ValueError(f"need params >= 0 and gpus >= 1, got {params} and {gpus}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    p, g, k = bytes_per_parameter(optimizer, precision)
    sharded = STRATEGIES.index(strategy)  # zero1 shards 1 of the 3 states, zero3 all three
    divisor = {name: (gpus if sharded >= level else 1)
               for name, level in (("optimizer", 1), ("grads", 2), ("params", 3))}
    result = {"params": p * params / divisor["params"],
              "grads": g * params / divisor["grads"],
              "optimizer": k * params / divisor["optimizer"]}
    result["total"] = sum(result.values())
    return {name: _whole_if_integral(value) for name, value in result.items()}


def optimizer_step_temporary_bytes(local_params, optimizer="adam", foreach=True):
    """Bytes an optimizer's step allocates for a moment beyond its state (torch 2.13), for a
    rank that updates `local_params` fp32 values. Adam with foreach kernels (torch's default
    on CUDA, not on CPU: _default_to_fused_or_foreach) makes one list, sqrt(exp_avg_sq), as
    large as exp_avg_sq: 4 bytes a value, half of Adam's state. Single-tensor Adam (CPU's
    default) holds such a temporary for one tensor at a time, and SGD with or without
    momentum none: 0 here. They live during the step, once the activations are freed."""
    return 4 * local_params if optimizer == "adam" and foreach else 0


def zero_offload_gpu_bytes(params, gpus, stage, largest_layer_params=0):
    """Bytes of model states one GPU keeps under ZeRO-Offload (Ren et al., 2021), with
    mixed-precision Adam: the gradients, the fp32 master weights and Adam's two buffers
    live in host memory, and the optimizer steps on the CPU.

    stage 2  every 16-bit weight on every GPU:                    2 psi
    stage 3  its 1/N shard of them, and one layer gathered at a time with that layer's
             16-bit gradients:                                     2 psi / N + 4 x largest layer
    These are DeepSpeed's own estimates (estimate_zero2/3_model_states_mem_needs with
    cpu_offload=True, parameters on the GPU).
    """
    if stage == 2:
        return 2 * params
    if stage == 3:
        return _whole_if_integral(2 * params / gpus) + 4 * largest_layer_params
    raise ValueError(f"ZeRO-Offload is defined for stages 2 and 3, not {stage!r}")


def transformer_params(layers, hidden, vocab, seq, tied_head=False):
    """Parameters of a GPT-style transformer (labs/transformer.py).

    Per block: QKV 3h^2 + 3h, output projection h^2 + h, MLP 8h^2 + 5h (h -> 4h -> h with
    biases), two LayerNorms 4h: 12h^2 + 13h. Outside the blocks: token and position
    embeddings (V + s) h, a final LayerNorm 2h, and an output head V h unless it is tied
    to the token embedding.
    """
    per_block = 12 * hidden ** 2 + 13 * hidden
    outside = (vocab + seq) * hidden + 2 * hidden + (0 if tied_head else vocab * hidden)
    return layers * per_block + outside


FLOP_CONVENTIONS = ("6psi", "attention", "megatron")


def flops_per_token(layers, hidden, seq, vocab, convention="6psi", tied_head=False):
    """Training FLOPs per token of the course's transformer, counted by `convention`: a
    throughput in TFLOP/s means nothing until one knows which. tied_head: the output head
    shares the token embedding's weights, and 6 psi counts them once.

      6psi       6 x transformer_params: 2 per parameter forward, 4 backward (Kaplan et al.,
                 2020). The course's time model and the planner's MFU count this.
      attention  6 psi plus attention's two matrix products, Q K^T and the weights times V:
                 4 L h s per token forward, twice that backward, 12 L h s (causal masking not
                 discounted), as torchtitan's MFU adds them (get_dense_model_nparams_and_flops).
      megatron   Narayanan et al. (2021), Eq. 3 divided by the B s tokens of a batch:
                 96 L h^2 (1 + s / (6h) + V / (16 L h)). It counts the layers' matrix products
                 four times (forward, the forward recomputed under activation checkpointing,
                 backward at twice the forward), attention's products, and the logits' (6 V h),
                 and the embedding lookup not at all.
    """
    if convention == "6psi":
        return 6 * transformer_params(layers, hidden, vocab, seq, tied_head)
    if convention == "attention":
        return (6 * transformer_params(layers, hidden, vocab, seq, tied_head)
                + 12 * layers * hidden * seq)
    if convention == "megatron":
        return 96 * layers * hidden ** 2 * (1 + seq / (6 * hidden)
                                            + vocab / (16 * layers * hidden))
    raise ValueError(f"unknown convention {convention!r}; choose from "
                     f"{', '.join(FLOP_CONVENTIONS)}")


def activation_bytes_per_layer(seq, batch, hidden, heads, value_bytes=2, dropout=True):
    """Bytes one transformer layer keeps for its backward pass (Korthikanti et al., 2022).

    Stored values, each s*b*h unless noted: the inputs of both LayerNorms (2), QKV's input
    (1), Q, K and V (3), the softmax output (a*s^2*b), the projection's input (1), the
    MLP's input (1), the GELU's input and output (4 + 4): 16 sbh + a s^2 b values. Dropout
    adds its output after softmax (a s^2 b values) and three 1-byte masks (a s^2 b + 2 sbh).
    With 16-bit values and dropout: s b h (34 + 5 a s / h), the paper's formula.
    Small terms it leaves out: LayerNorm's mean and 1/std, 2 s*b fp32 values per norm.
    """
    sbh, as2b = seq * batch * hidden, heads * seq ** 2 * batch
    values = 16 * sbh + as2b + (as2b if dropout else 0)
    masks = (as2b + 2 * sbh) if dropout else 0
    return value_bytes * values + masks


def layer_norm_statistics_bytes(seq, batch, norms=2, tokens_split=1):
    """Bytes of the statistics LayerNorm keeps for backward besides its input: a mean and
    a 1/std per token, fp32, for each of `norms` norms (2 per layer) over the s*b tokens,
    or the 1/tokens_split of them a sequence-parallel rank normalises. Korthikanti et al.'s
    count leaves them out as small; a measurement finds them."""
    return norms * 2 * 4 * seq * batch // tokens_split


def embedding_activation_bytes(seq, batch, hidden, dropout=True):
    """Bytes the embedding keeps: the 1-byte mask of the dropout after it (s*b*h), with
    dropout; nothing without (a lookup needs no saved input but the ids)."""
    return seq * batch * hidden if dropout else 0


def tensor_parallel_activation_bytes_per_layer(seq, batch, hidden, heads, tp,
                                              sequence_parallel=False, value_bytes=2,
                                              dropout=True, gathered_inputs_kept=False):
    """Bytes one layer keeps for backward on each of tp ranks (Korthikanti et al., 2022):
    with 16-bit values and dropout, s b h (10 + 24/t + 5 a s/(h t)) with tensor
    parallelism, s b h (34/t + 5 a s/(h t)) with sequence parallelism too.

    Split across the ranks: Q, K and V, the attention's output, the GELU's input and output
    (12 s b h values) and the attention matrix, whose heads are divided among the ranks.
    Replicated on every rank unless sequence parallelism splits the tokens: the inputs of
    both LayerNorms and of the two column-parallel linears (4 s b h values) and the masks
    of the two dropouts after the row-parallel linears (2 s b h bytes). At tp = 1 this is
    activation_bytes_per_layer.

    Under sequence parallelism Megatron-LM keeps only its 1/t of a column-parallel linear's
    input and gathers it again in backward. torch's SequenceParallel plan keeps the gathered
    input: gathered_inputs_kept=True counts those two inputs whole, 2 s b h (1 - 1/t)
    values more.
    """
    sbh, as2b = seq * batch * hidden, heads * seq ** 2 * batch
    replicated_split = tp if sequence_parallel else 1
    values = (4 * sbh / replicated_split + 12 * sbh / tp
              + (as2b + (as2b if dropout else 0)) / tp)
    if sequence_parallel and gathered_inputs_kept:
        values += 2 * sbh * (1 - 1 / tp)
    masks = (2 * sbh / replicated_split + as2b / tp) if dropout else 0
    return _whole_if_integral(value_bytes * values + masks)


def tensor_parallel_params_per_rank(layers, hidden, vocab, seq, tp, vocab_parallel=True):
    """Parameters each of tp ranks holds of the course's transformer split as in Megatron-LM.

    Per layer, split: QKV's and fc1's weights and biases (column-parallel) and the weights
    of proj and fc2 (row-parallel): 12 h^2 + 7 h over t. Replicated: the two LayerNorms and
    the row-parallel biases, which are added once the partial sums are reduced: 6 h.
    Outside: the token embedding and the head split by vocabulary (vocab_parallel) or
    replicated, the positions and the final LayerNorm replicated.
    """
    per_layer = (12 * hidden ** 2 + 7 * hidden) / tp + 6 * hidden
    vocabulary = 2 * vocab * hidden / (tp if vocab_parallel else 1)
    return _whole_if_integral(layers * per_layer + vocabulary + seq * hidden + 2 * hidden)


def head_activation_bytes(seq, batch, hidden, vocab, value_bytes=2):
    """Bytes the head keeps: the final LayerNorm's input and output (2 sbh values) and the
    softmax of the logits for the loss, s*b*V values in fp32 (4 bytes each)."""
    return value_bytes * 2 * seq * batch * hidden + 4 * seq * batch * vocab


def activation_bytes(layers, seq, batch, hidden, heads, vocab, value_bytes=2, dropout=True,
                     checkpointing=False):
    """(end_of_forward, peak): activation bytes of the whole model for one micro-batch.

    Without checkpointing, every layer keeps its activations until its backward: the
    peak is at the end of the forward pass, the embedding's dropout mask, L layers and the
    head. With full activation checkpointing each layer keeps only its input (s b h values)
    and recomputes the rest during backward, one layer at a time: the peak is the kept
    inputs and mask plus the larger of one layer's activations and the head's.
    """
    one_layer = activation_bytes_per_layer(seq, batch, hidden, heads, value_bytes, dropout)
    embedding = embedding_activation_bytes(seq, batch, hidden, dropout)
    head = head_activation_bytes(seq, batch, hidden, vocab, value_bytes)
    if not checkpointing:
        total = embedding + layers * one_layer + head
        return total, total
    kept = embedding + layers * value_bytes * seq * batch * hidden
    return kept + head, kept + max(one_layer, head)


# Sharding in units: ZeRO-3 over flat buffers, and the memory one step goes through.

def padded_numel(numel, world_size):
    """A unit's flat size rounded up to a multiple of N: N equal shards, the last padded."""
    return math.ceil(numel / world_size) * world_size


def step_timeline(strategy, unit_numels, world_size, value_bytes=4):
    """Live parameter and gradient bytes on each rank at the start and end of every unit's
    forward (units in order) and backward (units in reverse), one training step.

    ddp    every parameter and gradient, all the time (gradients as views of the buckets)
    zero3  its shards of both (padded flat units, 1/N each), plus the one unit it works
           on: gathered parameters during forward, gathered parameters and the unit's
           flat gradient during backward; each unit freed again at its end.
    Returns [{phase, unit, point, param_bytes, grad_bytes}].
    """
    b, n = value_bytes, world_size
    padded = [padded_numel(numel, n) for numel in unit_numels]
    units = range(len(unit_numels))
    order = [("forward", i, point) for i in units for point in ("start", "end")]
    order += [("backward", i, point) for i in reversed(units) for point in ("start", "end")]
    events = []
    for phase, i, point in order:
        if strategy == "ddp":
            params = grads = b * sum(unit_numels)
        elif strategy == "zero3":
            params = grads = b * sum(padded) // n
            if point == "start":
                params += b * padded[i]
                grads += b * padded[i] if phase == "backward" else 0
        else:
            raise ValueError(f"no timeline for strategy {strategy!r}; choose ddp or zero3")
        events.append({"phase": phase, "unit": i, "point": point,
                       "param_bytes": params, "grad_bytes": grads})
    return events


def timeline_peak(events):
    """The largest parameters + gradients of a step_timeline (or a measured one)."""
    return max(event["param_bytes"] + event["grad_bytes"] for event in events)


# The exact layouts of torch's implementations: what rank r really holds.

def fsdp2_shard_numel(shape, world_size, rank):
    """Elements of a parameter of `shape` that FSDP2 gives rank `rank` (unpadded).

    fully_shard splits dim 0 like torch.chunk: ceil(d0 / N) rows per rank, the last
    ranks get fewer or none. So rank 0 holds more than 1/N whenever N does not divide d0,
    and at least one row of every parameter: a row is the smallest shard there is.
    """
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    per_rank = math.ceil(rows / world_size)
    start = min(rank * per_rank, rows)
    return (min(start + per_rank, rows) - start) * row_numel


def fsdp2_gathered_numel(shapes, world_size):
    """Elements one FSDP2 all-gather (or reduce-scatter) of a unit moves in full: each
    parameter's dim 0 padded to a multiple of N (fsdp2_shard_numel's ceil(d0 / N) rows on
    every rank), summed over the unit's parameters."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        total += math.ceil(rows / world_size) * world_size * math.prod(shape[1:])
    return total


def fsdp2_held_param_numel(shapes, world_size, gathered):
    """Parameter elements rank 0 of N holds under FSDP2 (torch 2.13), from every storage it
    keeps rather than the parameters the module shows: each parameter's padded shard of
    ceil(d0 / N) rows (`_sharded_param_data`, kept all along) and, while its unit is
    `gathered`, the all-gather output beside it, padded to N such shards. So a unit kept
    gathered from forward to backward (reshard_after_forward=False, ZeRO-2's memory) costs
    psi + psi / N where N divides every d0, not psi."""
    shard = sum(math.ceil((shape[0] if shape else 1) / world_size)
                * math.prod(shape[1:]) for shape in shapes)
    return shard + (fsdp2_gathered_numel(shapes, world_size) if gathered else 0)


def fsdp2_step_collectives(unit_shapes, world_size, reshard_after_forward=True):
    """[(phase, op, unit, output elements, input elements)] of the collectives FSDP2 issues
    in one training step, one unit's parameter shapes per entry of `unit_shapes` (units
    in forward order; a root unit that holds no parameters issues none): before each
    unit's forward an all-gather of its padded shards (fsdp2_gathered_numel in, that over N
    from each rank); in backward, units in reverse, the same all-gather again unless the
    unit stayed gathered (reshard_after_forward=False), and a reduce-scatter of its padded
    gradients. Backward prefetching issues unit i-1's all-gather before unit i's
    reduce-scatter: the order within each op is fixed, not how the two ops interleave. A
    group of one issues none: each parameter is its own shard, and torch 2.13's FSDP2
    skips both collectives there (_fsdp_param_group.py, unshard; _fsdp_collectives.py,
    foreach_reduce)."""
    n = world_size
    if n == 1:
        return []
    gathered = [fsdp2_gathered_numel(shapes, n) for shapes in unit_shapes]
    units = range(len(unit_shapes))
    forward = [("forward", "all_gather", i, gathered[i], gathered[i] // n) for i in units]
    backward = []
    for i in reversed(units):
        if reshard_after_forward:
            backward.append(("backward", "all_gather", i, gathered[i], gathered[i] // n))
        backward.append(("backward", "reduce_scatter", i, gathered[i] // n, gathered[i]))
    return forward + backward


def fsdp2_step_peak_bytes(unit_shapes, world_size, activation_bytes, optimizer_buffers=1,
                          value_bytes=4):
    """Rank 0's peak over one FSDP2 step, by the sawtooth model (step_timeline's zero3) on
    FSDP2's layout: its shards of the parameters, their gradients and `optimizer_buffers`
    optimizer states (fsdp2_shard_numel, rank 0's padded chunks), plus the largest unit
    gathered with its full gradient, plus the activations of one micro-batch. FSDP2
    differs in what the model leaves out: gradients set to None between steps exist only
    after their unit's reduce-scatter; backward prefetching gathers a second unit; the
    reduce-scatter reads a padded copy of the unit's gradients."""
    shard = sum(fsdp2_shard_numel(shape, world_size, 0)
                for shapes in unit_shapes for shape in shapes)
    largest = max(fsdp2_gathered_numel(shapes, world_size) for shapes in unit_shapes)
    return value_bytes * ((2 + optimizer_buffers) * shard + 2 * largest) + activation_bytes


def zero1_partition(numels, world_size):
    """Which rank owns each tensor under torch's ZeroRedundancyOptimizer.

    It assigns whole tensors, largest first, each to the rank with the fewest elements so
    far (the lowest rank on a tie). Returns one rank per entry of `numels`.
    """
    loads = [0] * world_size
    owner = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = loads.index(min(loads))
        owner[index] = rank
        loads[rank] += numels[index]
    return owner


def formula_is_exact(strategy, world_size, first_dims):
    """Whether rank 0 holds exactly what state_bytes_per_gpu says, for parameters whose
    dim-0 sizes are `first_dims`: always for DDP; for FSDP2 (zero2, zero3) when N divides
    every dim 0; for ZeRO-1's whole-tensor partition only on one rank."""
    if strategy == "zero1":
        return world_size == 1
    if strategy in ("zero2", "zero3"):
        return all(rows % world_size == 0 for rows in first_dims)
    return True


def parse_count(text):
    """'7.5B' -> 7500000000, '350M', '1.3e9', '120000' -> a parameter count (decimal units).

    ValueError if it is not a non-negative number."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    text = str(text).strip()
    scale = units.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"bad parameter count {text!r}: use e.g. 7.5B, 350M or 1.3e9") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"the parameter count must be a non-negative number, got {text!r}")
    return round(value)


def pipeline_peak_microbatches(schedule, stages, microbatches, chunks=1):
    """Per stage, the most micro-batches whose activations it holds at once (forward done,
    backward not yet): [one entry per stage].

      gpipe        every forward before any backward: m on every stage
      1f1b         stage s runs p-1-s forwards before its first backward, then one forward
                   per backward: p - s at most (Narayanan et al., 2021), m if fewer
      interleaved  v chunks per rank, counted in chunk-micro-batches (each 1/v of the
                   stage's layers): the warm-up of Megatron-LM's schedule, which torch's
                   ScheduleInterleaved1F1B follows, is (v-1)r + 2(p-1-s) forwards, with r
                   micro-batches per round (p when p divides m; torch takes m // (m // p)
                   otherwise, and refuses an m that this round size does not divide), and
                   the steady state adds one: at most m v
    """
    p, m, v = stages, microbatches, chunks
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(p - s, m) for s in range(p)]
    if schedule == "interleaved":
        per_round = m // max(1, m // p)
        return [min((v - 1) * per_round + 2 * (p - 1 - s) + 1, m * v) for s in range(p)]
    raise ValueError(f"unknown schedule {schedule!r}")


# A configuration of data, pipeline and tensor parallelism: what one GPU holds.

def stage_layers(layers, stages):
    """[layers of each pipeline stage]: contiguous, as even as they go, the later stages
    taking one more when p does not divide L (how split_pieces cuts the model)."""
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} pipeline stages")
    bounds = [stage * layers // stages for stage in range(stages + 1)]
    return [bounds[s + 1] - bounds[s] for s in range(stages)]


def stage_params_per_rank(layers, hidden, vocab, seq, pp, tp, stage, tied_head=False,
                          split=None):
    """Parameters one rank of pipeline stage `stage` holds, the model split tp ways as in
    Megatron-LM (tensor_parallel_params_per_rank) and its layers over pp stages: each
    layer (12 h^2 + 7 h)/t + 6 h; the first stage adds the token embedding (V h / t) and
    the positions (s h), the last the final LayerNorm (2 h) and the head (V h / t). A tied
    head costs nothing more only when the embedding sits on the same stage (pp = 1); across
    stages the last keeps its own copy, as Megatron-LM does. `split`: the stages' layer
    counts, when not stage_layers' even cut."""
    per_layer = (12 * hidden ** 2 + 7 * hidden) / tp + 6 * hidden
    count = (split or stage_layers(layers, pp))[stage] * per_layer
    if stage == 0:
        count += vocab * hidden / tp + seq * hidden
    if stage == pp - 1:
        count += 2 * hidden + (0 if tied_head and pp == 1 else vocab * hidden / tp)
    return _whole_if_integral(count)


def stage_activation_bytes(layers, seq, micro_batch, hidden, heads, vocab, tp=1,
                           sequence_parallel=False, in_flight=1, first=True, last=True,
                           value_bytes=2, dropout=True, checkpointing=False):
    """Peak activation bytes of one rank of a pipeline stage holding `layers` layers and
    `in_flight` micro-batches of `micro_batch` sequences at once (pipeline_peak_microbatches),
    split tp ways (tensor_parallel_activation_bytes_per_layer); the first stage adds the
    embedding's dropout mask, the last the head's activations (its logits' softmax split by
    vocabulary). Without checkpointing every in-flight micro-batch keeps all of it. With
    full checkpointing each keeps only its layers' inputs (1/t of them under sequence
    parallelism) and the embedding's mask, and backward rebuilds one layer at a time: the
    larger of one layer's activations and the head's comes on top. At tp = pp = 1 and one
    micro-batch this is activation_bytes's peak."""
    sp_split = tp if sequence_parallel else 1
    one_layer = tensor_parallel_activation_bytes_per_layer(
        seq, micro_batch, hidden, heads, tp, sequence_parallel, value_bytes, dropout)
    embedding = embedding_activation_bytes(seq, micro_batch, hidden, dropout) / sp_split if first else 0
    head = (value_bytes * 2 * seq * micro_batch * hidden / sp_split
            + 4 * seq * micro_batch * vocab / tp) if last else 0
    if not checkpointing:
        return _whole_if_integral(in_flight * (embedding + layers * one_layer + head))
    kept = embedding + layers * value_bytes * seq * micro_batch * hidden / sp_split
    return _whole_if_integral(in_flight * kept + max(one_layer if layers else 0, head))


def config_bytes_per_gpu(layers, hidden, heads, seq, vocab, dp=1, pp=1, tp=1, strategy="ddp",
                         micro_batch=1, microbatches=1, schedule="1f1b",
                         sequence_parallel=False, checkpointing=False, optimizer="adam",
                         precision="mixed", dropout=True, tied_head=False, split=None):
    """{params, grads, optimizer, states, activations, total, stage} on the fullest GPU of
    a dp x pp x tp configuration: for each pipeline stage, its rank's parameters
    (stage_params_per_rank) with their states sharded over dp by `strategy`
    (state_bytes_per_gpu), plus the activations of the micro-batches it holds at once
    (stage_activation_bytes); the stage with the largest total is returned. At
    dp = pp = tp = 1 this is state_bytes_per_gpu and activation_bytes's peak. `split`: the
    stages' layer counts, when not stage_layers' even cut (the planner trims end stages)."""
    value_bytes = 2 if precision == "mixed" else 4
    in_flight = pipeline_peak_microbatches(schedule, pp, microbatches)
    per_stage_layers = list(split) if split else stage_layers(layers, pp)
    if len(per_stage_layers) != pp or sum(per_stage_layers) != layers:
        raise ValueError(f"stage layers {per_stage_layers} do not cut {layers} layers into "
                         f"{pp} stages")
    worst = None
    for stage in range(pp):
        params = stage_params_per_rank(layers, hidden, vocab, seq, pp, tp, stage, tied_head,
                                       per_stage_layers)
        states = state_bytes_per_gpu(params, dp, strategy, optimizer, precision)
        activations = stage_activation_bytes(
            per_stage_layers[stage], seq, micro_batch, hidden, heads, vocab, tp,
            sequence_parallel, in_flight[stage], stage == 0, stage == pp - 1, value_bytes,
            dropout, checkpointing)
        row = {"params": states["params"], "grads": states["grads"],
               "optimizer": states["optimizer"], "states": states["total"],
               "activations": activations, "total": states["total"] + activations,
               "stage": stage}
        if worst is None or row["total"] > worst["total"]:
            worst = row
    return worst


# Context parallelism: the attention matrix each rank keeps

def context_parallel_attention_matrix_bytes(method, seq, batch, heads, cp, layout="zigzag",
                                            value_bytes=4):
    """[bytes of attention probabilities one layer keeps for backward on rank r]: the
    softmax's output, which the product with V saves (the scores before it are not kept).
      allgather  the rank's s/N queries against all s keys, masked, not skipped:
                 a (s/N) s b values
      ulysses    a/N whole heads over the whole sequence: a/N s^2 b values
      ring       only the blocks its causal mask does not wholly hide
                 (time_model.causal_chunk_pairs), each a c^2 b values for chunks of c
                 tokens: under zig-zag (2N + 1)/(4N) of the all-gather's matrix
    Without context parallelism (N = 1) allgather and ulysses keep a s^2 b, the whole
    layer's matrix (activation_bytes_per_layer's a s^2 b)."""
    from .time_model import causal_chunk_pairs
    if method == "allgather":
        return [value_bytes * heads * (seq // cp) * seq * batch] * cp
    if method == "ulysses":
        return [value_bytes * (heads // cp) * seq * seq * batch] * cp
    if method == "ring":
        c = seq // (cp if layout == "contiguous" else 2 * cp)
        return [value_bytes * heads * c * c * batch * pairs
                for pairs in causal_chunk_pairs(cp, layout)]
    raise ValueError(f"unknown method {method!r}")


def context_parallel_layer_activation_bytes(seq, batch, hidden, heads, cp, tp=1,
                                            attention_matrix=False, value_bytes=2):
    """Bytes one layer of the course's shape keeps on a GPU of a cp x tp group, tensor- and
    sequence-parallel over tp, no dropout: its s/cp tokens' 16 sbh values split over tp
    (Korthikanti et al.'s count), and, if the attention matrix is kept (no fused kernel),
    a (s/cp) s b / tp more values. A fused (flash) kernel keeps instead one fp32 log-sum-exp
    per query and head, a (s/cp) b / tp values of 4 bytes."""
    tokens = seq // cp
    values = 16 * tokens * batch * hidden / tp
    if attention_matrix:
        values += heads * tokens * seq * batch / tp
        extra = 0
    else:
        extra = 4 * heads * tokens * batch / tp
    return _whole_if_integral(value_bytes * values + extra)


# Mixture of experts: parameters in total, per token (active) and per rank.

def moe_transformer_params(layers, hidden, vocab, seq, experts, ffn_hidden, experts_held=None):
    """Parameters of labs/labkit/model/moe.py's transformer: the course's transformer whose MLPs
    are E experts h -> f -> h (2hf + f + h each) behind a router (hE + E). On an
    expert-parallel rank `experts_held` = E / ep of them; everything else is replicated."""
    held = experts if experts_held is None else experts_held
    attention_and_norms = 4 * hidden ** 2 + 4 * hidden + 4 * hidden
    router = hidden * experts + experts
    expert = 2 * hidden * ffn_hidden + ffn_hidden + hidden
    outside = transformer_params(0, hidden, vocab, seq)
    return layers * (attention_and_norms + router + held * expert) + outside


def mla_attention_params(hidden, heads, q_rank, kv_rank, head_dim, rope_dim, v_head_dim):
    """DeepSeek's multi-head latent attention (DeepSeek-V2 §2.1; V3 §2.1.1), no biases:
    queries through a rank-q_rank bottleneck, keys and values through a rank-kv_rank
    latent plus a shared rotary key of rope_dim, an RMSNorm on each latent, the output
    projection from heads x v_head_dim."""
    q = hidden * q_rank + q_rank + q_rank * heads * (head_dim + rope_dim)
    kv = hidden * (kv_rank + rope_dim) + kv_rank + kv_rank * heads * (head_dim + v_head_dim)
    return q + kv + heads * v_head_dim * hidden


# DeepSeek-V3 (technical report §2, §4.2; the published config): 61 layers, hidden 7168,
# 128 heads of 128 (+64 rotary), query rank 1536, key-value rank 512; the first 3 layers
# dense (SwiGLU of 18432), the other 58 with 1 shared and 256 routed SwiGLU experts of
# 2048, 8 routed per token; vocabulary 129280, untied head. RMSNorms; the multi-token
# prediction module (14B more) is left out, as the report's 671B leaves it out.
DEEPSEEK_V3 = dict(layers=61, dense_layers=3, hidden=7168, heads=128, q_rank=1536,
                   kv_rank=512, head_dim=128, rope_dim=64, v_head_dim=128, dense_ffn=18432,
                   routed_experts=256, shared_experts=1, expert_ffn=2048, top_k=8,
                   vocab=129280)


def deepseek_v3_params(config=DEEPSEEK_V3):
    """{total, active, routed_experts, other, shared_experts}: parameters of the
    DeepSeek-V3 layout, all of them and those one token uses (its k routed experts); the
    shared experts (DeepSeekMoE's, every token through them) are part of `other`."""
    c = config
    h = c["hidden"]
    attention = mla_attention_params(h, c["heads"], c["q_rank"], c["kv_rank"], c["head_dim"],
                                     c["rope_dim"], c["v_head_dim"]) + 2 * h   # + 2 RMSNorms
    swiglu = lambda ffn: 3 * h * ffn   # noqa: E731  gate, up, down; no biases
    moe_layers = c["layers"] - c["dense_layers"]
    routed = moe_layers * c["routed_experts"] * swiglu(c["expert_ffn"])
    router = moe_layers * c["routed_experts"] * h
    shared = moe_layers * c["shared_experts"] * swiglu(c["expert_ffn"])
    dense = c["dense_layers"] * swiglu(c["dense_ffn"])
    other = c["layers"] * attention + dense + shared + router + 2 * c["vocab"] * h + h
    active_routed = moe_layers * c["top_k"] * swiglu(c["expert_ffn"])
    return {"total": other + routed, "active": other + active_routed, "routed_experts": routed,
            "other": other, "shared_experts": shared}


def expert_data_parallel_size(gpus, pp, ep, etp=1):
    """Replicas of each routed expert (EDP) when the MoE layers get their own mesh
    ETP x EP x EDP x PP over the same GPUs as the attention's TP x CP x DP x PP
    (Megatron-Core's MoE parallel folding, Liu et al. 2025; parallel_state.py,
    initialize_model_parallel: expert_data_parallel_size = world / (etp ep pp)): so ep
    need not divide dp, only the GPUs of a pipeline stage."""
    if gpus % (etp * ep * pp):
        raise ValueError(f"etp {etp} x ep {ep} x pp {pp} does not divide {gpus} GPUs")
    return gpus // (etp * ep * pp)


def moe_bytes_per_gpu(gpus, pp, ep, config=DEEPSEEK_V3, zero1=True, param_copies=1):
    """Bytes of weights, gradients and Adam state per GPU for DeepSeek-V3's layout: pp
    pipeline stages of equal parameter counts, each MoE layer's routed experts over ep GPUs,
    everything else replicated within a stage; mixed precision (2 + 2 bytes, 12 of fp32
    state), ZeRO-1 sharding the 12 over each parameter's data-parallel replicas: gpus / pp
    for the rest, gpus / (pp ep) (expert_data_parallel_size) for a routed expert. The
    course's accounting, not DeepSeek's own storage choices.

    param_copies: pipeline stages each GPU holds. 1 under 1F1B; 2 under DualPipe, whose
    rank i holds stage i and stage pp - 1 - i (DeepSeek-V3 §3.2.1 and Table 2, "2x"
    parameters; the DualPipe README's table, which counts parameters). Stage i then sits on
    pipeline ranks i and pp - 1 - i, and the two copies are one parameter set with twice
    the replicas: DualPipe's examples/example_dualpipe.py sums the pair's gradients
    (p0.grad += p1all[pp_size - 1 - rank]). Each copy keeps its own weights and gradients
    (2 + 2 bytes, doubled); ZeRO-1 shards the 12 bytes of state over all the replicas,
    2 gpus / pp for the rest and 2 gpus / (pp ep) for a routed expert, so the state per GPU
    is one copy's."""
    params = deepseek_v3_params(config)
    dp_rest, dp_expert = gpus // pp, expert_data_parallel_size(gpus, pp, ep)
    rest = param_copies * params["other"] / pp
    experts = param_copies * params["routed_experts"] / (pp * ep)
    p, g, k = bytes_per_parameter("adam", "mixed")
    # every copy of a stage is a replica: the state shards over param_copies x dp of them
    state = lambda n, dp: (p + g) * n + k * n / (param_copies * dp if zero1 else 1)  # noqa: E731
    return {"other": state(rest, dp_rest), "experts": state(experts, dp_expert),
            "total": state(rest, dp_rest) + state(experts, dp_expert),
            "params_per_gpu": rest + experts}


def moe_layer_activation_values(hidden, expert_hidden, top_k, shared_experts=0,
                                inner_per_width=3, load=1):
    """16-bit values per token that one MoE layer's expert MLPs keep for backward on the
    GPU holding the experts: each of a token's k routed slots keeps a copy of its input
    (h: the weight gradient of the first matrix needs it), the expert's inner values
    (inner_per_width x f: SwiGLU's gate, up and their product 3f; GELU's input and output
    2f) and the expert's output (h: the gate's gradient needs it); each shared expert,
    which every token passes through in place, its inner values. `load` is the rows the
    busiest GPU receives over the mean: 1 when the routing is even, at most the capacity
    factor with a capacity, the busiest expert's count over the mean when dropless."""
    routed = top_k * load * (2 * hidden + inner_per_width * expert_hidden)
    return routed + shared_experts * inner_per_width * expert_hidden


def dualpipe_peak_microbatches(stages, microbatches):
    """Per rank of DualPipe (DeepSeek-V3 §3.2.1), [(stage, micro-batches whose activations
    it holds at its peak), ...] for the two stages it holds: rank r holds stage r of the
    micro-batches fed from rank 0 and stage p - 1 - r of those fed from rank p - 1, m/2 of
    each. Counted from the schedule of DualPipe's dualpipe.py (DualPipe.step): at the first
    overlapped forward-backward of its main phase rank r holds p - r of the first kind
    and r + 1 of the second, p + 1 in all on every rank (the README's "PP+1"). step()
    asserts an even p and an even m >= 2p; so does this."""
    if stages % 2 or microbatches % 2 or microbatches < 2 * stages:
        raise ValueError(f"DualPipe needs an even number of stages p and an even number "
                         f"of micro-batches m >= 2p, got p = {stages} and m = {microbatches}")
    return [((r, stages - r), (stages - 1 - r, r + 1)) for r in range(stages)]


def zero_bubble_peak_microbatches(schedule, stages, microbatches, chunks=2):
    """Per rank of a zero-bubble schedule (time_model.zero_bubble_order: zb1p, zbv,
    dualpipev), the most piece-micro-batches it holds at once, from a forward until the
    backward that frees it: its W, or its whole backward B. After its I a micro-batch keeps
    only what W reads (each weight's input), less than before (Qi et al. 2024, Table 1), so
    this counts what is held at all, not its size. A piece is 1/v of a rank's layers for
    zb1p, half for zbv and dualpipev. With m large: zb1p (v-1) r + p on every rank (r
    micro-batches per round, p when p divides m), p stage-sized ones at v = 2, 1F1B's first
    stage's; zbv 2p, as many; dualpipev 2p + 1, one piece-micro-batch more (DeepSeek-V3's
    Table 2: PP + 1 over PP = 2p stages)."""
    from . import time_model   # the order is the time model's; it imports nothing of this
    peaks = []
    for stage in range(stages):
        held = peak = 0
        for op, _, _ in time_model.zero_bubble_order(schedule, stages, stage, microbatches,
                                                     chunks):
            held += {"F": 1, "I": 0, "W": -1, "B": -1}[op]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks

"""A small GPT-style transformer whose memory can be counted exactly.

Every tensor it creates is the one the memory formulas count: a fused QKV projection,
attention written out (matmul, softmax, matmul) rather than a fused kernel that keeps
different tensors for backward, a 4h MLP with GELU, pre-LayerNorm, learned positions and
an untied output head. Its parameter count is `memory_model.transformer_params` exactly.

The embedding, each block and the head are separate modules (`units()`), so a sharding
wrapper such as FSDP2 can treat each as one unit and leave the root holding nothing.
"""

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def check(self):
        """Return a message saying what is wrong with the shape, or None."""
        for name, value in dataclasses.asdict(self).items():
            if value < 1:
                return f"--{name} must be a positive integer, got {value}"
        if self.hidden % self.heads:
            return f"--hidden {self.hidden} is not divisible by --heads {self.heads}"
        return None


class Embedding(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.positions = nn.Embedding(shape.seq, shape.hidden)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-LN attention + MLP, with residuals: 12h^2 + 13h parameters."""

    def __init__(self, shape):
        super().__init__()
        h = shape.hidden
        self.head_dim = h // shape.heads
        self.norm1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        causal = torch.ones(shape.seq, shape.seq, dtype=torch.bool).triu(1)
        self.register_buffer("future", causal, persistent=False)

    def forward(self, x):
        qkv = self.qkv(self.norm1(x))
        # The whole sequence, and as many heads as the width holds: the same code runs on a
        # tensor-parallel rank, whose qkv gives whole heads, some of them (Q, K and V of
        # each), and gathers the tokens that sequence parallelism splits.
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        weights = scores.masked_fill(self.future[:s, :s], float("-inf")).softmax(dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))

    def mlp(self, x):
        """The feed-forward part, on its own so that a mixture of experts can replace it."""
        return self.fc2(F.gelu(self.fc1(x)))


class Head(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.norm = nn.LayerNorm(shape.hidden)
        self.out = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class Transformer(nn.Module):
    def __init__(self, shape, device=None):
        """Built where it will run: device=env.device makes the parameters there (on a GPU
        from the GPU's generator), with no copy on the host first; None: torch's default."""
        super().__init__()
        self.shape = shape
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.embed = Embedding(shape)
            self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
            self.head = Head(shape)

    def units(self):
        """The modules a sharding wrapper should wrap one by one, in forward order."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_batch(shape, batch, generator, device):
    """Token ids and next-token targets drawn at random: memory does not care what they say.
    generator=None draws from torch's global generator."""
    # drawn on the host from a CPU generator, so that every device draws the same ids
    ids = torch.randint(shape.vocab, (batch, shape.seq + 1), generator=generator, device="cpu")
    ids = ids.to(device)
    return ids[:, :-1], ids[:, 1:]



def add_shape_args(parser, default):
    """--layers --hidden --heads --seq --vocab, each a positive integer, `default`'s values
    by default: the model options of every lab that trains this transformer."""
    from ..runtime.distenv import positive_int
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name}", type=positive_int,
                            default=getattr(default, field.name), help=f"model {field.name}")


def shape_from_args(args):
    """The Shape the options give, or exit with one line saying what is wrong with it."""
    from ..runtime.distenv import fail
    shape = Shape(*(getattr(args, field.name) for field in dataclasses.fields(Shape)))
    problem = shape.check()
    if problem:
        fail(problem)
    return shape

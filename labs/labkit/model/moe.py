"""A mixture-of-experts feed-forward block for the course's transformer.

Each block's MLP becomes E experts (each an MLP h -> f -> h) and a router that sends every
token to k of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021):

  router     a linear layer gives E logits per token; their softmax p; each token goes to
             its k most probable experts, its output weighted by their p (the gates,
             Switch's form: not renormalised over the k)
  capacity   an expert takes at most C = ceil(factor x k x T / E) of the T tokens a rank
             routes (comm_model.expert_capacity); first choices are placed before second
             choices (GShard), tokens in order; the rest are dropped: their MLP output is
             zero, the residual carries them on
  balance    the auxiliary loss E x sum_e f_e P_e, with f_e the share of the k T routed
             slots that went to expert e and P_e the mean probability of e (Switch, eq. 4);
             or, without a loss, a bias per expert added to the probabilities for choosing
             the k only, the gates still the unbiased p, and moved by a fixed step after
             each training step: down for an expert that got more than the mean, up for one
             that got less (DeepSeek-V3's auxiliary-loss-free balancing, §2.1.2;
             Megatron-Core's get_updated_expert_bias)

Where the experts live is the dispatcher's business (labkit/parallel/expert_dispatch.py): all here
(`LocalExperts`), or sharded over ranks and reached by all-to-all or all-gather.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..predict.comm_model import expert_capacity
from .transformer import Block, Embedding, Head


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    experts: int
    top_k: int
    capacity_factor: float
    ffn_hidden: int


@dataclasses.dataclass
class Routing:
    """One layer's routing of T tokens: idx and gates [T, k], kept [T, k] (within
    capacity), counts [E] (slots routed to each expert, kept or not), aux (the loss)."""
    idx: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    aux: torch.Tensor

    def assignments(self):
        """(token, expert, gate) of every kept slot, first choices first, tokens in order:
        the order in which every dispatcher sums a token's outputs."""
        tokens = torch.arange(self.idx.shape[0], device=self.idx.device)
        tokens = tokens.repeat(self.idx.shape[1])
        keep = self.kept.T.reshape(-1)
        return (tokens[keep], self.idx.T.reshape(-1)[keep], self.gates.T.reshape(-1)[keep])


def route(logits, top_k, capacity_factor, expert_bias=None):
    """Top-k gating with a capacity and the load-balancing loss, for one group of tokens.
    `expert_bias` [E], if given, is added to the probabilities to choose the k experts
    only; the gates are the unbiased probabilities of the chosen."""
    tokens, experts = logits.shape
    probs = logits.softmax(dim=-1)
    if expert_bias is None:
        gates, idx = probs.topk(top_k, dim=-1)
    else:
        idx = (probs.detach() + expert_bias).topk(top_k, dim=-1).indices
        gates = probs.gather(1, idx)
    # each slot's place in its expert's queue: first choices of every token, then seconds
    slots = F.one_hot(idx.T.reshape(-1), experts)                 # [k T, E]
    place = (slots.cumsum(0) * slots).sum(1) - 1
    capacity = expert_capacity(tokens, experts, top_k, capacity_factor)
    kept = (place < capacity).view(top_k, tokens).T
    counts = slots.sum(0)
    share = counts.to(probs.dtype) / (top_k * tokens)             # f_e: no gradient
    aux = experts * (share * probs.mean(0)).sum()                 # P_e: the gradient
    return Routing(idx, gates, kept, counts, aux)


class Expert(nn.Module):
    def __init__(self, hidden, ffn_hidden):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoELayer(nn.Module):
    """Router + experts. Holds all E experts when built; a dispatcher may keep only its
    rank's (`keep_experts`). After each forward: `routing` (for the load-balancing loss,
    the counts and the dropped tokens)."""

    def __init__(self, hidden, config):
        super().__init__()
        self.config = config
        self.router = nn.Linear(hidden, config.experts)
        self.experts = nn.ModuleList(Expert(hidden, config.ffn_hidden)
                                     for _ in range(config.experts))
        self.first_expert = 0          # global index of self.experts[0]
        self.dispatcher = LocalExperts()
        self.routing = None
        self.expert_bias = None        # [E] for auxiliary-loss-free balancing, if enabled

    def update_expert_bias(self, counts, speed):
        """After a step: each expert's bias down by `speed` if it got more slots than the
        mean (`counts` [E]), up if fewer (DeepSeek-V3 §2.1.2, its bias update speed)."""
        if self.expert_bias is None:
            self.expert_bias = torch.zeros(len(counts), device=counts.device)
        mean = counts.double().mean()
        self.expert_bias += speed * torch.sign(mean - counts.double()).to(self.expert_bias.dtype)

    def keep_experts(self, first, count):
        """Keep experts [first, first + count) only: what an expert-parallel rank holds."""
        self.experts = nn.ModuleList(list(self.experts)[first:first + count])
        self.first_expert = first

    def run_experts(self, rows, expert_ids):
        """Each row through the (local) expert its global id names; ids outside give 0."""
        out = rows.new_zeros(rows.shape)
        for i, expert in enumerate(self.experts):
            sel = (expert_ids == self.first_expert + i).nonzero().squeeze(1)
            out = out.index_copy(0, sel, expert(rows[sel]))
        return out

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        self.routing = route(self.router(tokens), self.config.top_k,
                             self.config.capacity_factor, self.expert_bias)
        return self.dispatcher(self, tokens, self.routing).view_as(x)


class LocalExperts:
    """Every expert in this process: each kept slot through its expert, times its gate,
    summed into its token."""

    def __call__(self, layer, tokens, routing):
        token, expert, gate = routing.assignments()
        out = layer.run_experts(tokens[token], expert)
        return tokens.new_zeros(tokens.shape).index_add(0, token, gate[:, None] * out)


class MoEBlock(Block):
    """The course's block with its MLP replaced by a mixture of experts."""

    def __init__(self, shape, config):
        super().__init__(shape)
        del self.fc1, self.fc2
        self.moe = MoELayer(shape.hidden, config)

    def mlp(self, x):
        return self.moe(x)


class MoETransformer(nn.Module):
    def __init__(self, shape, config):
        super().__init__()
        self.shape, self.config = shape, config
        self.embed = Embedding(shape)
        self.blocks = nn.ModuleList(MoEBlock(shape, config) for _ in range(shape.layers))
        self.head = Head(shape)

    def moe_layers(self):
        return [block.moe for block in self.blocks]

    def expert_parameters(self):
        return [p for layer in self.moe_layers() for p in layer.experts.parameters()]

    def shared_parameters(self):
        """Everything but the experts: replicated on every rank."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]

    def aux_loss(self):
        """The load-balancing loss of the last forward, summed over the layers."""
        return sum(layer.routing.aux for layer in self.moe_layers())

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

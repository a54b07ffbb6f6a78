"""Mixture of experts: a router sends each token to its top-k of many SwiGLU experts (Mixtral,
DeepSeek, Qwen-MoE), in place of a block's dense MLP.

    x ─ router (fp32) ─ top-k per token ─ dispatch: tokens sorted by expert ─ expert MLPs ─
      combine: each token's outputs weighted by its router weights ─ (+ shared experts) ─ out

The experts' weights are stacked, (n_experts, ...) per matrix, so that expert parallelism
(partrain.parallel.expert) shards them along the first dimension, and a checkpoint holds one
tensor per matrix whatever the layout. The dispatch is a `Dispatcher`: the local one below runs
every expert on this rank; expert parallelism swaps in one that moves tokens to the rank of their
expert and back (all-to-all).

Every layout must route every token the same way: the router runs in fp32, the top-k is a stable
sort (ties go to the lower expert id), and everything that depends on more than one token (the
balancing loss, the capacity) is per sequence, which no layout splits but context and sequence
parallelism, whose groups (`seq_group`) sum the per-sequence statistics.

Balancing (`balance`):
- `aux_loss`: Switch/GShard's loss, coef * E * sum_e f_e * P_e per sequence (f_e the share of
  the sequence's top-k choices that went to expert e, P_e its mean router probability), averaged
  over sequences. Its gradient enters backward through the block's output (`_AuxLossGrad`,
  Megatron's MoEAuxLossAutoScaler), so it reaches the router on every pipeline stage and the
  reported loss stays the language-model loss.
- `bias`: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores
  for the choice of experts only (never to the weights), moved each step by `bias_update_rate`
  towards the mean load (`update_expert_bias`, after the step's global counts are known).
- `none`.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from partrain.models.arith import expert_ffn_dim
from partrain.models.recompute import recomputing


class _AuxLossGrad(Function):
    """Forward: the block output unchanged; backward: its gradient, and the MoE's aux_scale times
    its loss_scale as the gradient of the auxiliary loss, so the loss is trained without being
    added to the model's output. Both are read at backward time: fp16's loss scale is the one
    the language-model loss was multiplied by in this backward (Megatron's
    MoEAuxLossAutoScaler.set_loss_scale does the same)."""

    @staticmethod
    def forward(ctx, out, aux, moe):
        ctx.moe = moe
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.moe.aux_scale * ctx.moe.loss_scale
        return grad, grad.new_full(ctx.aux_shape, scale, dtype=torch.float32), None


class _SumOverSequence(Function):
    """Forward: sum a per-sequence statistic over the ranks that hold parts of the sequence
    (context parallelism, and tp under sequence parallelism); backward: the gradient times
    `scale`, the number of those ranks whose losses are averaged (cp), not summed (tp): every
    rank computes the same loss from the sum, so the true gradient of each part is that many
    times what one rank's backward sees."""

    @staticmethod
    def forward(ctx, x, group, scale):
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


class GroupedExperts(nn.Module):
    """n SwiGLU experts with stacked weights: w1, w3 (n, hidden, dim), w2 (n, dim, hidden)
    (expert parallelism keeps a slice of them)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows sorted by local expert, counts[e] rows for expert e."""
        outs = []
        for e, rows in enumerate(x.split(counts)):
            if rows.shape[0]:
                outs.append(F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]),
                                     self.w2[e]))
        if not outs:
            # No row for any local expert. The (empty) result stays a function of every weight
            # (each gets a zero gradient, as an idle expert beside a busy one does, so every rank
            # reduces and steps the same tensors) and of x: under expert parallelism x is what the
            # all-to-all brought, and its backward (a collective every rank of the ep group must
            # enter) runs only if x is in the graph.
            untouched = self.w1.sum() + self.w3.sum() + self.w2.sum() + x.sum()
            return x.new_zeros(0, self.w2.shape[1]) + 0 * untouched
        return torch.cat(outs)


class LocalDispatcher:
    """Every expert on this rank: sort the chosen (token, expert) pairs by expert, run each
    expert on its rows."""

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, expert_ids: torch.Tensor,
                 n_experts: int) -> torch.Tensor:
        counts = torch.bincount(expert_ids, minlength=n_experts).tolist()
        return experts(rows, counts)


class MoE(nn.Module):
    """The MoE MLP of one block. `seq_group`/`seq_scale` are set by context or sequence
    parallelism (the ranks a sequence is split over); `aux_scale` when the worker is built (the
    loss's 1/micro_batches: partrain.parallel.parallelize.setup_moe); `loss_scale` before each
    backward under fp16 (DeepSpeed's loss scale, which multiplies the language-model loss and
    divides every gradient at the step: the auxiliary loss's gradient must be multiplied too, or
    it arrives divided by it, 2^16 at the start: balancing off in all but name)."""

    def __init__(self, model_cfg, dense_ffn: int):
        super().__init__()
        moe = model_cfg.moe
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.balance, self.norm_topk = moe.balance, moe.norm_topk
        self.aux_loss_coef, self.bias_update_rate = moe.aux_loss_coef, moe.bias_update_rate
        self.capacity_factor = moe.capacity_factor
        hidden = expert_ffn_dim(model_cfg, dense_ffn)
        self.router = nn.Linear(model_cfg.dim, moe.n_experts, bias=False)
        self.experts = GroupedExperts(moe.n_experts, model_cfg.dim, hidden)
        self.shared = None
        if moe.n_shared_experts:
            from partrain.models.layers import FeedForward

            self.shared = FeedForward(model_cfg.dim, hidden * moe.n_shared_experts)
        # DeepSeek-V3's balancing bias: state, not a weight (no gradient), saved in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts))
        self.dispatcher = LocalDispatcher()
        self.seq_group, self.seq_scale = None, 1
        self.aux_scale, self.loss_scale = 1.0, 1.0
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start a step's accounting: tokens chosen per expert (kept on the weights' device, no
        host sync per micro-batch), the sum of the aux loss values and their number."""
        device = self.router.weight.device
        self.load = torch.zeros(self.n_experts, dtype=torch.float64, device=device)
        self.routed = 0  # (token, expert) choices made, kept or dropped
        self.aux_sum, self.aux_calls = torch.zeros((), device=device), 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (N, E) fp32, chosen experts (N, k), their weights (N, k)) for tokens x (N, dim)."""
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.softmax(dim=-1)
        choice = scores + self.expert_bias if self.balance == "bias" else scores
        # A stable sort: equal scores go to the lower expert id on every rank and layout.
        chosen = torch.sort(choice.detach(), dim=-1, descending=True, stable=True).indices
        chosen = chosen[:, :self.top_k]
        weights = scores.gather(-1, chosen)
        if self.norm_topk and self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, chosen, weights

    def _kept(self, chosen: torch.Tensor, bsz: int, seq: int) -> torch.Tensor | None:
        """Under a capacity factor, which (token, choice) pairs fit (bsz*seq, k): the earliest
        tokens of each sequence first, a token's choices in rank order."""
        if not self.capacity_factor:
            return None
        cap = math.ceil(self.capacity_factor * seq * self.top_k / self.n_experts)
        one_hot = F.one_hot(chosen.reshape(bsz, seq * self.top_k), self.n_experts)
        position = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1  # place in its expert's queue
        return (position < cap).reshape(bsz * seq, self.top_k)

    def _aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, bsz: int,
                  seq: int) -> torch.Tensor:
        """Switch/GShard's balancing loss per sequence, averaged over the micro-batch."""
        counts = F.one_hot(chosen, self.n_experts).sum(1).view(bsz, seq, -1).sum(1).float()
        prob_sum = scores.view(bsz, seq, -1).sum(1)
        tokens = seq
        if self.seq_group is not None:
            dist.all_reduce(counts, group=self.seq_group)
            prob_sum = _SumOverSequence.apply(prob_sum, self.seq_group, self.seq_scale)
            tokens = seq * dist.get_world_size(self.seq_group)
        f = counts * self.n_experts / (self.top_k * tokens)
        p = prob_sum / tokens
        return self.aux_loss_coef * (f * p).sum(-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, chosen, weights = self.route(tokens)
        kept = self._kept(chosen, bsz, seq)
        training = self.training and torch.is_grad_enabled()
        if training and not recomputing():
            self.routed += chosen.numel()
            self.load += torch.bincount(chosen.flatten() if kept is None else chosen[kept],
                                        minlength=self.n_experts).to(self.load)

        # Dispatch: the kept (token, expert) pairs sorted by expert (stable: token order within).
        token_ids = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert_ids, pair_weights = chosen.flatten(), weights.flatten()
        if kept is not None:
            token_ids, expert_ids = token_ids[kept.flatten()], expert_ids[kept.flatten()]
            pair_weights = pair_weights[kept.flatten()]
        order = torch.argsort(expert_ids, stable=True)
        token_ids, expert_ids = token_ids[order], expert_ids[order]
        expert_out = self.dispatcher(self.experts, tokens[token_ids], expert_ids, self.n_experts)
        weighted = expert_out * pair_weights[order].unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_ids, weighted.to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(bsz, seq, dim)
        if self.balance == "aux_loss" and training:
            aux = self._aux_loss(scores, chosen, bsz, seq)
            if not recomputing():
                self.aux_sum = self.aux_sum + aux.detach()
                self.aux_calls += 1
            out = _AuxLossGrad.apply(out, aux, self)
        return out


@torch.no_grad()
def update_expert_bias(moe: MoE, global_load: torch.Tensor) -> None:
    """DeepSeek-V3: raise the bias of experts below the mean load, lower those above."""
    delta = torch.sign(global_load.mean() - global_load) * moe.bias_update_rate
    moe.expert_bias += delta.to(moe.expert_bias.dtype).to(moe.expert_bias.device)

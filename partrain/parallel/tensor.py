"""Tensor parallelism (parallel.tp): Megatron-style sharded layers over the "tp" mesh dimension.

`apply_tensor_parallel` takes the full model, built from the seed, and replaces the modules that
the model's `tensor_parallel_plan()` names with sharded versions whose weights are slices of the
full ones, so tp=1 and tp=N start from the same function. In each transformer block:

    x ─ norm ─ [enter region] ─ wq/wk/wv (column) ─ attention on H/tp heads ─ wo (row) ─ all-reduce ─ +
    h ─ norm ─ [enter region] ─ w1/w3 (column) ─ SwiGLU on ffn/tp ─ w2 (row) ─ all-reduce ─ +

One all-reduce per attention and one per MLP forward; backward, entering the region is the
all-reduce (Megatron's f and g). The embedding is vocabulary-parallel (masked lookup, all-reduce)
and the output head is column-parallel over the vocabulary; the loss is computed from the vocab
shards by `vocab_parallel_cross_entropy` without gathering the logits.

With sequence parallelism the residual stream, norms included, lives on a sequence shard: the
region entry becomes an all-gather along the sequence and the row-parallel all-reduce a
reduce-scatter, the same bytes in twice as many collectives, and activations outside the regions
take 1/tp of the memory. Norm weights then see only their shard's tokens, so their gradients are
summed over tp once per step (`sync_sequence_parallel_grads`).

A column-parallel linear's bias (Qwen2's q/k/v) is split with its rows. A per-head norm inside
the attention (Qwen3's q/k norm) is replicated, but each rank norms only its own heads, so its
gradient is summed over tp in the backward (`HeadNorm`).

Parameters that are sharded carry `tp_sharded = True`; gradient-norm clipping sums their squares
over tp and counts the replicated ones once.

A weight shared by two planned modules (the embedding and head of a model with tied embeddings)
stays one Parameter: both are split over the vocabulary into the same row slice, so the second
module takes the first one's shard, and both gradients (the masked lookup's rows and the head's)
accumulate into it.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from partrain.models.layers import rms_norm
from partrain.models.tp_plan import STYLES
from partrain.parallel.dist import local
from partrain.parallel.tp_collectives import (
    copy_to_tp_region,
    enter_region,
    gather_from_tp_region,
    leave_region,
    note_collective,
    scatter_to_tp_region,
)

# ---------------------------------------------------------------------------------------------
# Sharded layers. Each is built from the full weight and keeps only its slice.

def _shard(full: torch.Tensor, dim: int, group) -> nn.Parameter:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if full.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split over tp={tp}")
    param = nn.Parameter(full.detach().chunk(tp, dim=dim)[rank].clone())
    param.tp_sharded = True
    param.tp_shard_dim = dim  # checkpoints record the shard as this slice of the full tensor
    return param


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W's rows (output features) split: rank r computes output features
    [r·out/tp, (r+1)·out/tp). The input enters the tp region here unless `input_in_region` (a
    parent already did it once for several linears that read the same input, like q/k/v).
    `gather_output` all-gathers the full output; otherwise it stays sharded for a row-parallel
    layer or the vocabulary-parallel loss. A bias (Qwen2's q/k/v) is split with the rows it adds
    to."""

    def __init__(self, weight: torch.Tensor, group, *, bias: torch.Tensor | None = None,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 input_in_region: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.input_in_region = sequence_parallel, input_in_region
        self.weight = _shard(weight, 0, group)
        self.bias = _shard(bias, 0, group) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_region(x, self.group, self.sequence_parallel)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W's columns (input features) split: each rank multiplies its slice of the
    input features and the partial outputs are summed (all-reduce, or reduce-scatter along the
    sequence under sequence parallelism). `input_is_parallel=False` splits a full input first."""

    def __init__(self, weight: torch.Tensor, group, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _shard(weight, 1, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        return leave_region(F.linear(x, self.weight), self.group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split: rank r holds rows [r·V/tp, (r+1)·V/tp). Tokens outside
    the shard look up zeros; the all-reduce (or sequence reduce-scatter) fills them in."""

    def __init__(self, weight: torch.Tensor, group, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(weight, 0, group)
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.group, self.sequence_parallel)


class _VocabParallelCrossEntropy(Function):
    """Per-token cross-entropy from vocabulary-sharded logits (N, V/tp): three all-reduces of N
    numbers (max, target logit, sum of exponentials) instead of gathering N·V logits. Backward
    is local: softmax minus the one-hot target, on this rank's shard."""

    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        shard = logits.shape[-1]
        start = dist.get_rank(group) * shard
        row_max = logits.max(dim=-1).values
        note_collective("all_reduce", row_max)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        local = target - start
        outside = (local < 0) | (local >= shard)
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        note_collective("all_reduce", target_logit)
        dist.all_reduce(target_logit, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        note_collective("all_reduce", sum_exp)
        dist.all_reduce(sum_exp, group=group)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(local.numel(), device=local.device)
        grad_logits[rows, local] -= (~outside).to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Mean cross-entropy over tokens; logits (..., V/tp) sharded over the vocabulary."""
    per_token = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.flatten(), group)
    return per_token.mean()


class HeadNorm(nn.Module):
    """A per-head RMSNorm (Qwen3's q/k norm) inside the attention's tp region. Its gain is
    replicated, but each rank applies it to its own heads only, so each rank's gradient is a
    part of the whole: the gain enters through copy_to_tp_region (forward identity, backward
    all-reduce over tp), and every rank then holds the full gradient. The Parameter is the
    norm's own, under the same name."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.group, self.eps, self.weight = group, norm.eps, norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_tp_region(self.weight, self.group), self.eps)


# ---------------------------------------------------------------------------------------------
# Applying a plan to a built model.

def _enter_region_hook(group, sequence_parallel: bool):
    def hook(module, args):
        return (enter_region(args[0], group, sequence_parallel), *args[1:])
    return hook


def apply_tensor_parallel(model: nn.Module, tp_mesh, cfg) -> nn.Module:
    """Shard `model` in place by its `tensor_parallel_plan()` over the 1-D tp mesh; cfg is the
    `parallel` config section (reads `sequence_parallel`)."""
    group = tp_mesh.get_group()
    tp = dist.get_world_size(group)
    sp = bool(cfg.sequence_parallel)
    plan = model.tensor_parallel_plan()
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ValueError(f"tensor-parallel plan uses unknown styles {unknown}; known: {STYLES}")
    regions = {name for name, style in plan.items() if style in ("region", "attention")}
    shared = _shared_weights(model, plan)

    for name, style in plan.items():
        module = model.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        if style in ("region", "attention"):
            module.register_forward_pre_hook(_enter_region_hook(group, sp))
            if style == "attention":
                # The module computes only this rank's heads; GQA stays intact because query head
                # h uses kv head h // (n_heads / n_kv_heads), and both split into contiguous runs.
                module.n_heads //= tp
                module.n_kv_heads //= tp
            continue
        if style in ("norm", "replicated"):
            # Replicated over tp (norm gains, a MoE's experts). Under sequence parallelism each
            # rank sees only its shard's tokens, so the gradients are partial sums.
            if sp:
                for param in module.parameters():
                    param.sequence_parallel_partial = True
            continue
        if style == "head_norm":
            setattr(model.get_submodule(parent_name), child, HeadNorm(module, group))
            continue
        if style == "colwise":
            new = ColumnParallelLinear(module.weight, group, bias=module.bias, sequence_parallel=sp,
                                       input_in_region=parent_name in regions)
        elif style == "vocab_head":
            new = ColumnParallelLinear(module.weight, group, sequence_parallel=sp)
        elif style == "rowwise":
            new = RowParallelLinear(module.weight, group, sequence_parallel=sp)
        else:
            new = VocabParallelEmbedding(module.weight, group, sequence_parallel=sp)
        if style != "colwise" and getattr(module, "bias", None) is not None:
            raise ValueError(f"{name}: tensor parallelism here supports bias-free layers only")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for name, owner in shared.items():
        module, weight = model.get_submodule(name), model.get_submodule(owner).weight
        dims = {getattr(w, "tp_shard_dim", None) for w in (module.weight, weight)}
        if module.weight.shape != weight.shape or len(dims) > 1:
            raise ValueError(f"{name} shares {owner}'s weight but is split differently over tp")
        module.weight = weight
    return model


def _shared_weights(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Planned modules whose weight is an earlier planned module's Parameter (tied embeddings):
    {module: the module that owns the weight}."""
    owners, shared = {}, {}
    for name in plan:
        weight = getattr(model.get_submodule(name), "weight", None)
        if not isinstance(weight, nn.Parameter):
            continue
        if id(weight) in owners:
            shared[name] = owners[id(weight)]
        else:
            owners[id(weight)] = name
    return shared


def sync_sequence_parallel_grads(model: nn.Module, group) -> None:
    """Sum over tp the gradients of weights that saw only a sequence shard (norms under sequence
    parallelism); once per step, after the last micro-batch's backward, in one collective."""
    grads = [local(p.grad) for p in model.parameters()
             if getattr(p, "sequence_parallel_partial", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    note_collective("all_reduce", flat)
    dist.all_reduce(flat, group=group)
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))


"""Gradients after backward: averaging over dp where DDP is not used, and gradient-norm clipping
that counts every parameter of the sharded model exactly once.

A tensor-parallel shard (`tp_sharded`) holds a different slice of a weight on each tp rank, so
its squared norm is summed over tp; a replicated parameter (norm gains) has the same gradient on
every tp rank and is counted once. Pipeline stages hold disjoint parameters, so their sums add
over pp, except a tied embedding's copy on the last stage (`tied_to`): its gradient is the first
stage's, counted there, and only scaled here.
"""

import math

import torch
import torch.distributed as dist

from partrain.parallel.dist import local
from partrain.parallel.tp_collectives import note_collective


def _sum_of_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([local(g).detach().float().pow(2).sum() for g in grads]).sum()


def _spans(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def global_grad_norm(parameters, tp_group=None, pp_group=None, ep_group=None,
                     shard_group=None) -> torch.Tensor:
    """The norm of every gradient of the sharded model, each parameter counted once. Under FSDP
    (`shard_group`) each rank holds a shard of every gradient: its sums are summed there first."""
    params = [p for p in parameters if p.grad is not None]
    device = local(params[0].grad).device
    counted = [p for p in params if not getattr(p, "tied_to", None)]
    experts = [p.grad for p in counted if getattr(p, "ep_sharded", False)]
    counted = [p for p in counted if not getattr(p, "ep_sharded", False)]
    sharded = [p.grad for p in counted if getattr(p, "tp_sharded", False)]
    replicated = [p.grad for p in counted if not getattr(p, "tp_sharded", False)]
    sharded_sq = _sum_of_squares(sharded, device)
    expert_sq = _sum_of_squares(experts, device)
    replicated_sq = _sum_of_squares(replicated, device)
    if _spans(shard_group):
        sums = torch.stack([sharded_sq, expert_sq, replicated_sq])
        dist.all_reduce(sums, group=shard_group)
        sharded_sq, expert_sq, replicated_sq = sums.unbind()
    if _spans(tp_group):
        note_collective("all_reduce", sharded_sq)
        dist.all_reduce(sharded_sq, group=tp_group)
    if _spans(ep_group):
        dist.all_reduce(expert_sq, group=ep_group)
    total_sq = sharded_sq + expert_sq + replicated_sq
    if _spans(pp_group):
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_grads(parameters, total: torch.Tensor, max_norm: float) -> None:
    """Scale gradients whose global norm is `total` so that it is at most max_norm (inf: no
    clipping)."""
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([local(p.grad) for p in parameters if p.grad is not None], coef)


def clip_grad_norm(parameters, max_norm: float, tp_group=None, pp_group=None,
                   ep_group=None) -> torch.Tensor:
    """Scale gradients so that their global norm is at most max_norm (inf: no clipping);
    return the norm before clipping, as torch.nn.utils.clip_grad_norm_ does."""
    params = list(parameters)
    total = global_grad_norm(params, tp_group, pp_group, ep_group)
    clip_grads(params, total, max_norm)
    return total


def average_gradients(parameters, dp_group) -> None:
    """Average gradients over dp in one flat all-reduce: the data-parallel step when the pipeline
    executor, not DDP, runs forward and backward. Expert-parallel slices are left to
    partrain.parallel.expert.average_expert_gradients."""
    grads = [p.grad for p in parameters
             if p.grad is not None and not getattr(p, "ep_sharded", False)]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= dist.get_world_size(dp_group)
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))

"""Gradient-norm clipping that counts every parameter of the sharded model exactly once.

A tensor-parallel shard (`tp_sharded`) holds a different slice of a weight on each tp rank, so
its squared norm is summed over tp; a replicated parameter (norm gains) has the same gradient on
every tp rank and is counted once. Gradients are already averaged over dp by DDP.
"""

import math

import torch
import torch.distributed as dist

from partrain.parallel.tensor import note_collective


def _sum_of_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()


def clip_grad_norm(parameters, max_norm: float, tp_group=None) -> torch.Tensor:
    """Scale gradients so that their global norm is at most max_norm (inf: no clipping);
    return the norm before clipping, as torch.nn.utils.clip_grad_norm_ does."""
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device
    sharded = [p.grad for p in params if getattr(p, "tp_sharded", False)]
    replicated = [p.grad for p in params if not getattr(p, "tp_sharded", False)]
    sharded_sq = _sum_of_squares(sharded, device)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        note_collective("all_reduce", sharded_sq)
        dist.all_reduce(sharded_sq, group=tp_group)
    total = (sharded_sq + _sum_of_squares(replicated, device)).sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef)
    return total

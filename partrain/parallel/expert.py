"""Expert parallelism (parallel.ep): a MoE's experts split over groups of ep consecutive dp ranks.

ep is not a world-size factor: it divides dp. Rank j of an ep group keeps experts
[j·E/ep, (j+1)·E/ep) of every MoE block; the same experts are replicated on the dp/ep groups (and
over cp and tp: experts are replicated within tp). Every rank routes its own tokens, then:

    counts per expert ── all-to-all (E numbers) ──► how many rows each rank sends me, per expert
    rows sorted by expert ── all-to-all (uneven splits) ──► my experts' rows from every rank
    my experts, expert by expert ── all-to-all back (the reverse splits) ──► combine as if local

Backward runs the two row exchanges in reverse (`_AllToAll`). gloo's all_to_all_single takes
split sizes; its list form does not exist on gloo.

Gradients: an expert weight receives the gradients of the tokens of its whole ep group through
the all-to-all's backward, so it is summed over the expert-data-parallel group (the ranks holding
the same experts: dp/ep x cp) and divided by dp x cp, the ranks whose mean loss the step
minimises: the same as averaging over dp x cp if every rank held every expert
(`average_expert_gradients`). DDP leaves the expert weights alone (`expert_parameter_names`).
"""

from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from partrain.models.moe import MoE

_traffic: dict | None = None


@contextmanager
def count_traffic():
    """Within the block: {"rows_sent", "bytes_sent", "calls"} of this rank's expert all-to-alls,
    rows and bytes sent to other ranks only (a rank's rows for itself stay in memory)."""
    global _traffic
    previous, _traffic = _traffic, defaultdict(int)
    try:
        yield _traffic
    finally:
        _traffic = previous


def _note(x: torch.Tensor, in_splits: list[int], group) -> None:
    if _traffic is not None:
        rows = sum(in_splits) - in_splits[dist.get_rank(group)]
        _traffic["calls"] += 1
        _traffic["rows_sent"] += rows
        _traffic["bytes_sent"] += rows * x[0].numel() * x.element_size() if x.shape[0] else 0


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    _note(x, in_splits, group)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(Function):
    """Forward: rows to other ranks by `in_splits`, `out_splits` back; backward: the same
    exchange reversed (the gradient of a row goes back to the rank it came from)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class ExpertParallelDispatcher:
    """Moves each (token, expert) row to the rank holding the expert, runs the local experts,
    and brings the outputs back in the order the rows left."""

    def __init__(self, group, ep: int, n_local: int):
        self.group, self.ep, self.n_local = group, ep, n_local

    def __call__(self, experts: nn.Module, rows: torch.Tensor, expert_ids: torch.Tensor,
                 n_experts: int) -> torch.Tensor:
        counts = torch.bincount(expert_ids, minlength=n_experts)
        # recv[s, e]: rows source rank s sends for my local expert e
        recv = torch.empty_like(counts)
        if _traffic is not None:
            _traffic["count_bytes"] += (n_experts - self.n_local) * counts.element_size()
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(self.ep, self.n_local)
        send_splits = counts.view(self.ep, self.n_local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        received = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        # Received rows come by source rank, then expert: regroup them by expert.
        local_ids = torch.arange(self.n_local, device=rows.device).repeat(self.ep)
        local_ids = local_ids.repeat_interleave(recv.flatten())
        order = torch.argsort(local_ids, stable=True)
        out = experts(received[order], recv.sum(0).tolist())
        out = out[torch.argsort(order)]
        return _AllToAll.apply(out, send_splits, recv_splits, self.group)


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> nn.Module:
    """Keep this rank's slice of every MoE's experts and dispatch through the ep group.
    Each kept weight is marked `ep_sharded` (its slice of dim 0 over `ep_mesh`: checkpoints
    record it so, gradient-norm clipping sums it over ep)."""
    group = ep_mesh.get_group()
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for moe in moe_modules(model):
        n_local = moe.n_experts // ep
        experts = moe.experts
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            param = nn.Parameter(full.detach()[rank * n_local:(rank + 1) * n_local].clone())
            param.__dict__.update(full.__dict__)  # what tp marked (sequence-parallel partials)
            param.ep_sharded, param.ep_mesh = True, ep_mesh
            setattr(experts, name, param)
        moe.dispatcher = ExpertParallelDispatcher(group, ep, n_local)
    return model


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if getattr(p, "ep_sharded", False)]


def average_expert_gradients(model: nn.Module, edp_group, ranks_averaged: int) -> None:
    """Sum the expert gradients over the ranks holding the same experts, divide by dp x cp
    (`ranks_averaged`); one flat all-reduce."""
    grads = [p.grad for p in model.parameters()
             if getattr(p, "ep_sharded", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    if dist.get_world_size(edp_group) > 1:
        dist.all_reduce(flat, group=edp_group)
    flat /= ranks_averaged
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))


def finish_moe_step(layers: list[MoE], moe_cfg, n_moe_blocks: int, load_group, pp_group,
                    device, applied: bool = True) -> dict:
    """After a step's forward and backward (every rank calls it, with or without MoE blocks of
    its own): each local block's tokens per expert summed over the ranks that routed different
    tokens (`load_group`: dp x cp, and tp under sequence parallelism), the DeepSeek bias moved
    by them, and the step's router metrics (equal on every rank, summed over pp stages):
    `moe_load_balance`, max over mean tokens per expert averaged over the MoE blocks;
    `moe_aux_loss`, the balancing loss summed over blocks (mean over micro-batches and ranks);
    `moe_dropped`, the share of (token, expert) choices over capacity (with a capacity factor).
    A step whose update was skipped (`applied` False: divergence guard) leaves the bias too."""
    from partrain.models.moe import update_expert_bias

    stats = torch.zeros(4, dtype=torch.float64, device=device)
    if layers:
        loads = torch.stack([m.load for m in layers])
        aux = torch.stack([m.aux_sum / max(m.aux_calls, 1) for m in layers]).to(loads)
        routed = torch.tensor([float(sum(m.routed for m in layers))]).to(loads)
        packed = torch.cat([loads.flatten(), aux, routed])
        if load_group is not None and dist.get_world_size(load_group) > 1:
            dist.all_reduce(packed, group=load_group)
            # aux is the same on the tp ranks of a load group (sequence parallelism): the mean
            # over the group is the mean over dp x cp.
            packed[loads.numel():-1] /= dist.get_world_size(load_group)
        loads = packed[:loads.numel()].view_as(loads)
        for moe, load in zip(layers, loads):
            if moe.balance == "bias" and applied:
                update_expert_bias(moe, load)
            moe.reset_stats()
        balance = (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-12)).sum()
        stats = torch.stack([balance, packed[loads.numel():-1].sum(), loads.sum(), packed[-1]])
    if pp_group is not None:
        dist.all_reduce(stats, group=pp_group)
    record = {"moe_load_balance": stats[0].item() / n_moe_blocks}
    if moe_cfg.balance == "aux_loss":
        record["moe_aux_loss"] = stats[1].item()
    if moe_cfg.capacity_factor:
        record["moe_dropped"] = 1.0 - stats[2].item() / max(stats[3].item(), 1.0)
    return record

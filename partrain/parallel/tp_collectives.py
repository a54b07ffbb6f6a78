"""Tensor parallelism's collectives (partrain.parallel.tensor uses them): each a small autograd
Function whose docstring names its forward/backward pair (Megatron's f and g, and their
sequence-parallel forms), and the count of every tp collective's payload that
scripts/bench_tp.py and the tests hold against the planner's formulas."""

from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd import Function


# ---------------------------------------------------------------------------------------------
# Collective accounting: payload bytes of every tp collective (the full, unsharded tensor), used
# by scripts/bench_tp.py and the tests to check the count against theory.

_counter: dict | None = None


@contextmanager
def count_collectives():
    """Within the block, record {op: {"calls": n, "bytes": b}} for every tp collective."""
    global _counter
    previous, _counter = _counter, defaultdict(lambda: {"calls": 0, "bytes": 0})
    try:
        yield _counter
    finally:
        _counter = previous


def note_collective(op: str, full: torch.Tensor) -> None:
    """Record one collective whose full (unsharded) payload is `full`, inside count_collectives()."""
    if _counter is not None:
        _counter[op]["calls"] += 1
        _counter[op]["bytes"] += full.numel() * full.element_size()


# ---------------------------------------------------------------------------------------------
# Raw collectives (no autograd) along one dimension of a tensor.

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    note_collective("all_reduce", x)
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    tp = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((tp * front.shape[0], *front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    note_collective("all_gather", out)
    # Contiguous once here: a strided result would be copied by each linear layer it feeds
    # (q, k and v; w1 and w3), and each copy kept for the backward.
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    tp = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // tp, *front.shape[1:]))
    note_collective("reduce_scatter", front)
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk along dim (no communication)."""
    chunks = x.chunk(dist.get_world_size(group), dim=dim)
    return chunks[dist.get_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------
# Autograd collectives: each names its forward / backward pair.

class _CopyToRegion(Function):
    """Forward identity, backward all-reduce (Megatron's f): enter the tp region with a
    replicated input whose gradient is the sum of every rank's partial gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(Function):
    """Forward all-reduce, backward identity (Megatron's g): sum the partial outputs of a
    row-parallel layer; the gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLastDim(Function):
    """Forward: keep this rank's chunk of the last dimension; backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherLastDim(Function):
    """Forward: all-gather the last dimension; backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ReduceScatterSequence(Function):
    """Forward: reduce-scatter along the sequence (dim 1); backward: all-gather along it.
    Leaves a row-parallel layer under sequence parallelism."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group), None


class _GatherSequence(Function):
    """Forward: all-gather along the sequence (dim 1); backward: reduce-scatter along it.
    Enters the tp region under sequence parallelism."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


def copy_to_tp_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x, group):
    return _ScatterLastDim.apply(x, group)


def gather_from_tp_region(x, group):
    return _GatherLastDim.apply(x, group)


def reduce_scatter_to_sequence_region(x, group):
    return _ReduceScatterSequence.apply(x, group)


def gather_from_sequence_region(x, group):
    return _GatherSequence.apply(x, group)


def enter_region(x, group, sequence_parallel: bool):
    return gather_from_sequence_region(x, group) if sequence_parallel else copy_to_tp_region(x, group)


def leave_region(x, group, sequence_parallel: bool):
    return (reduce_scatter_to_sequence_region(x, group) if sequence_parallel
            else reduce_from_tp_region(x, group))

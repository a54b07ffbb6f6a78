"""Data parallelism (parallel.zero_stage=0): DDP over the "dp" mesh dimension, and the one small
interface every data-parallel backend answers (DDP here, DeepSpeed ZeRO in zero.py).

A backend owns how gradients meet across the data-parallel ranks and who steps the optimizer, so
the train step never branches on the backend (Lightning Fabric's Strategy): `no_sync(last)` around
each micro-batch, `backward(loss)`, and `step(tracer, loss_finite)`, which reduces, clips and steps
and returns an `Update`: the gradient norm before clipping, and whether the parameters changed.
Neither backend updates on a non-finite loss or gradient norm (the divergence guard,
partrain.train.guard, counts those steps): the optimizer's state is untouched and the gradients
are dropped.

Each dp rank holds the whole (or tp/pp-sharded) model and a slice of the global batch; DDP
all-reduces (averages) gradients over the dp group in buckets, overlapped with backward. Under
gradient accumulation the train loop calls `no_sync()` on all but the last micro-batch, so there
is one all-reduce per optimizer step.

DDP keeps its first bucket layout for the whole run (`find_unused_parameters=True`; by default it
rebuilds the buckets after the first step in the order gradients became ready). With three or
more dp ranks the layout decides in which order gloo's ring sums each element, so a run resumed
from a checkpoint, whose first step would use the first layout again, would differ from the
uninterrupted run in the last bits. The price is one walk of the autograd graph per step, and
torch's C++ warning that no parameter was unused, once in each rank's log (it bypasses Python's
warnings filters).

Expert-parallel slices (`ep_sharded`) differ between dp ranks: DDP neither broadcasts them at
start nor averages them (partrain.parallel.expert reduces them over their own group).
"""

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from partrain.parallel.dist import local
from partrain.parallel.expert import average_expert_gradients
from partrain.parallel.grads import average_gradients, clip_grads, global_grad_norm
from partrain.parallel.mesh import flattened
from partrain.parallel.tensor import sync_sequence_parallel_grads


@dataclass
class Update:
    """What one optimizer step did."""

    grad_norm: float  # global, before clipping (the same on every rank)
    applied: bool  # the parameters and the optimizer's state changed
    nonfinite: nn.Parameter | None = None  # not applied: this rank's parameter nearest the
    # output whose gradient was not finite, where backward met it first (None: all finite)
    scaler_skipped: bool = False  # fp16: the loss scaler skipped an overflow (not a divergence)


def first_nonfinite(params) -> nn.Parameter | None:
    """The first parameter in backward's order (the last of `params`, the model's order) whose
    gradient holds a NaN or an infinity: where a non-finite value entered the gradients."""
    for param in reversed(list(params)):
        if param.grad is not None and not torch.isfinite(local(param.grad)).all():
            return param
    return None


class DataParallelBackend(Protocol):
    """What the train step asks of a data-parallel backend."""

    model: nn.Module  # what forward runs: the wrapped model
    module: nn.Module  # the model under the wrapper (the pipeline executor under pp)
    optimizer: torch.optim.Optimizer

    def no_sync(self, last: bool) -> ContextManager:
        """Around one micro-batch's forward and backward: skip the gradient reduction unless
        `last` (one reduction per optimizer step)."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def after_evaluation(self) -> None:
        """After forward-only passes: free what they left gathered (FSDP keeps weights it would
        free in backward), so that the parameters are the ones the optimizer steps again."""

    def step(self, tracer, loss_finite: bool) -> Update:
        """Reduce the accumulated gradients and clip; step the optimizer when `loss_finite` and
        the global gradient norm is finite; zero the gradients."""


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    device_ids = None if dp_mesh.device_type == "cpu" else [next(model.parameters()).device]
    experts = [name for name, p in model.named_parameters() if getattr(p, "ep_sharded", False)]
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    with warnings.catch_warnings():
        # Newer torch deprecates broadcast_buffers in favour of forward_sync_buffers, whose False
        # still syncs at init; broadcast_buffers=False remains the way to skip buffers entirely.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(
            model,
            process_group=dp_mesh.get_group(),
            device_ids=device_ids,
            # Buffers (the rotary tables) are derived from the config, identical on every rank.
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
            find_unused_parameters=True,  # one bucket layout for the whole run (docstring)
        )


class DDPBackend:
    """zero_stage=0: DDP's bucketed all-reduce during backward (or, under pp, one flat average
    after the schedule), then partrain's clipping over every model-parallel group and the
    optimizer's step."""

    def __init__(self, model: nn.Module, optimizer, dims, mesh, expert_mesh,
                 sequence_parallel: bool, grad_clip: float):
        self.model, self.optimizer = model, optimizer
        self.module = model.module if isinstance(model, DistributedDataParallel) else model
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        # Under pp the executor, not DDP, runs backward: the backend averages over dp x cp.
        self.dp_group = flattened(mesh, "dp_cp").get_group() if dims.pp_enabled and dims.dp_cp > 1 else None
        # Expert slices: summed over the ranks holding the same experts, / (dp x cp).
        self.edp_group = flattened(expert_mesh, "edp_cp").get_group() if expert_mesh is not None else None
        self.dp_cp = dims.dp_cp
        self.tp_group = mesh["tp"].get_group() if dims.tp_enabled else None
        self.pp_group = mesh["pp"].get_group() if dims.pp_enabled else None
        self.ep_group = expert_mesh["ep"].get_group() if expert_mesh is not None else None
        self.sequence_parallel = sequence_parallel

    def no_sync(self, last: bool) -> ContextManager:
        ddp = isinstance(self.model, DistributedDataParallel)
        return self.model.no_sync() if ddp and not last else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def after_evaluation(self) -> None:
        pass

    def step(self, tracer, loss_finite: bool) -> Update:
        with tracer.span("gradients: dp average, clip", "comm"):
            if self.dp_group is not None:
                average_gradients(self.model.parameters(), self.dp_group)
            if self.edp_group is not None:
                average_expert_gradients(self.model, self.edp_group, self.dp_cp)
            if self.sequence_parallel:
                sync_sequence_parallel_grads(self.model, self.tp_group)
            grad_norm = global_grad_norm(self.model.parameters(), self.tp_group, self.pp_group,
                                         self.ep_group)
            norm = grad_norm.item()
            update = Update(norm, applied=loss_finite and math.isfinite(norm))
            if update.applied:
                clip_grads(self.model.parameters(), grad_norm, self.max_norm)
            else:
                # Before the gradients go: where backward met a non-finite value first.
                update.nonfinite = first_nonfinite(self.model.parameters())
        with tracer.span("optimizer", "compute"):
            if update.applied:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return update

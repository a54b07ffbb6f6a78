"""FSDP2 (parallel.zero_backend=fsdp): PyTorch's own sharded data parallelism, per-parameter DTensor
shards over the data-parallel ranks (dp x cp), instead of DeepSpeed's ZeRO.

`apply_fsdp` shards the model after tp, cp and compile have rewritten it (torchtitan's order):
every transformer block is one FSDP unit, then the root (embedding, final norm, head). What
`parallel.zero_stage` means here:

- 3: parameters, gradients and optimizer state sharded; a block's parameters are gathered for its
  forward, freed after it (`reshard_after_forward`), gathered again for its backward.
- 2: the same, but a block keeps its gathered parameters from its forward until its backward ends
  (one gather per micro-batch instead of two; the memory of the gathered blocks meanwhile).
- 1 (optimizer state only) is not an FSDP mode: FSDP2 shards parameters, so its least sharded
  form is stage 2. Validation refuses it and says so.

Under pp each of a rank's pipeline chunks is a root; the executor runs a backward per
micro-batch, so a stage keeps its weights gathered and its gradients whole through the schedule
and reduce-scatters once after it (`_sync_gradients`): stages 2 and 3 are one there. HSDP
(`parallel.dp_replicate`) shards over a replica's ranks of a 2-D (dp_replicate, dp_shard x cp)
mesh and all-reduces across replicas (FSDP2 does both from the mesh).

Otherwise each micro-batch's gradients are reduce-scattered as its backward ends (in fp32:
`MixedPrecisionPolicy(reduce_dtype=float32)`) and accumulate in the shards, so gradients are never
held whole, as ZeRO-2/3 do. With `train.dtype=bf16` FSDP gathers bf16 copies for compute and keeps
the fp32 shards as master weights (`param_dtype=bfloat16`); autocast is off then.
`parallel.offload_params=cpu` or `offload_optimizer=cpu` keep the shards, their gradients and the
optimizer step on the host (`CPUOffloadPolicy`: FSDP2 offloads them together).

Under ep a MoE's experts (this ep rank's slice) are a unit of their own inside their block's,
sharded over the ranks holding the same experts (edp x cp, `ExpertSharding`), their gradients
summed there and divided by dp x cp; a checkpoint records each piece over (ep, edp x cp).

Tensor parallelism already splits some weights (partrain's TP keeps local slices, marked
`tp_shard_dim`): FSDP then shards the other dimension of a matrix, so that a rank's piece stays
one rectangle of the full weight, which a checkpoint records as a DTensor over (dp x cp, tp) with
its offsets (`saved_mesh`, partrain.checkpoint.state.as_saved). The marks partrain puts on
parameters (tp, pipeline ties, sequence-parallel partials) are carried over to the DTensor
parameters FSDP puts in their place.

`FSDPBackend` is the data-parallel backend the train step drives (partrain.parallel.data): it
adds one all-reduce of the local squared norms over the shards to the usual norm.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from partrain.models.family import blocks
from partrain.models.moe import MoE
from partrain.parallel.data import Update, first_nonfinite
from partrain.parallel.grads import clip_grads, global_grad_norm
from partrain.parallel.pipeline import PipelineModel
from partrain.parallel.tensor import sync_sequence_parallel_grads

# What partrain marks on a parameter (the checkpoint names, the norm's counting, the gradients'
# extra reductions); FSDP replaces each parameter by a DTensor one, and these go along.
MARKS = ("tp_sharded", "tp_shard_dim", "tied_to", "sequence_parallel_partial", "ep_sharded",
         "ep_mesh")


def shard_dim(param: nn.Parameter) -> int:
    """The dimension FSDP splits `param` on: 0, or 1 where tp already splits dim 0."""
    if getattr(param, "tp_shard_dim", None) == 0:
        if param.dim() < 2:
            raise ValueError("a 1-D weight split by tp cannot be sharded by FSDP as well")
        return 1
    return 0


@dataclass
class ExpertSharding:
    """Under ep: where a MoE's expert slices are sharded. `mesh`: the ranks holding the same
    experts (edp x cp); `saved_mesh`: (ep, edp x cp), where a checkpoint records each piece;
    `divide`: what their summed gradients are divided by (dp x cp, the ranks whose mean loss
    the step minimises)."""
    mesh: object
    saved_mesh: object
    divide: int


def apply_fsdp(model: nn.Module, dp_mesh, saved_mesh, stage: int, param_dtype: torch.dtype | None,
               offload: bool, experts: ExpertSharding | None = None) -> nn.Module:
    """Shard `model` in place over `dp_mesh` (dp x cp; HSDP: (dp_replicate, dp_shard x cp)),
    every block a unit, then the root (under pp, each of this rank's chunks is a root).
    `saved_mesh`, dp_mesh's dims and tp, is where a checkpoint records tp-split weights (None
    without tp). Under ep (`experts`) each MoE's experts are a unit of their own inside their
    block's, over the expert-data ranks."""
    marks = {name: {k: v for k, v in vars(p).items() if k in MARKS}
             for name, p in model.named_parameters()}
    options = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        offload_policy=(CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if offload
                        else OffloadPolicy()),
        shard_placement_fn=lambda p: Shard(shard_dim(p)))
    pipeline = isinstance(model, PipelineModel)
    roots = list(model.chunks) if pipeline else [model]
    reshard = stage == 3 and not pipeline
    for root in roots:
        for block in blocks(root):
            if experts is not None and isinstance(getattr(block, "feed_forward", None), MoE):
                _shard_experts(block.feed_forward.experts, experts, reshard, options)
            # Under pp a stage's weights stay gathered for the whole schedule (below), as
            # torchtitan does: not gathered again for every micro-batch.
            fully_shard(block, reshard_after_forward=reshard, **options)
        # The root's weights (the head) are the first the backward needs: not freed after forward.
        fully_shard(root, reshard_after_forward=False, **options)
    for name, param in model.named_parameters():
        vars(param).update(marks[name])
        if getattr(param, "ep_sharded", False):
            param.saved_mesh = experts.saved_mesh
        elif saved_mesh is not None and getattr(param, "tp_sharded", False):
            param.saved_mesh = saved_mesh
    if pipeline:
        # The executor runs a backward per micro-batch: gradients accumulate whole and the
        # weights stay gathered until the schedule ends; then one reduce-scatter per step.
        for root in roots:
            _defer_gradient_sync(root)
        model.finish_backward = partial(_sync_gradients, roots)
        model.retie()  # the tied embedding's copy is now FSDP's parameter
    return model


def _shard_experts(experts: nn.Module, sharding: ExpertSharding, reshard: bool,
                   options: dict) -> None:
    """An ep rank's expert slices, one FSDP unit over the ranks that hold the same experts.
    Each rank's expert gradients hold the gradients of its ep group's tokens (the all-to-all's
    backward brought them): summed over the unit's ranks and divided by dp x cp, not averaged
    over the unit's ranks alone (partrain.parallel.expert.average_expert_gradients does the same
    sum under DDP). Over several ranks the sum is a plain SUM then a division (gloo has no
    PREMUL_SUM); alone, FSDP copies the gradient divided, and forcing the SUM there would divide
    it twice (torch 2.13)."""
    fully_shard(experts, reshard_after_forward=reshard, **{**options, "mesh": sharding.mesh})
    experts.set_gradient_divide_factor(float(sharding.divide))
    if sharding.mesh.size() > 1:
        experts.set_force_sum_reduction_for_comms(True)


def _defer_gradient_sync(root: FSDPModule) -> None:
    root.set_is_last_backward(False)
    root.set_reshard_after_backward(False)
    root.set_requires_gradient_sync(False)


def _sync_gradients(roots: list[FSDPModule]) -> None:
    """After a pipeline schedule's last backward: reduce-scatter the accumulated gradients of
    every unit and free the gathered weights, as FSDP does itself at the end of a backward that
    autograd drives whole (torch.distributed.pipelining's stage does the same), then defer again
    for the next step."""
    for root in roots:
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        state = fully_shard.state(root)
        for unit in state._state_ctx.all_states:
            for group in unit._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        _defer_gradient_sync(root)


class FSDPBackend:
    """zero_backend=fsdp: FSDP2's reduce-scatter at each micro-batch's backward, then the global
    norm over every shard (dp x cp, tp, pp) and the optimizer's step on the DTensor shards."""

    def __init__(self, model: nn.Module, optimizer, dims, mesh, sequence_parallel: bool,
                 grad_clip: float, shard_mesh):
        self.model = self.module = model
        self.optimizer = optimizer
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        # The local squared norms add over one shard group (HSDP's replicas hold the same).
        self.shard_group = shard_mesh.get_group() if shard_mesh.size() > 1 else None
        self.tp_group = mesh["tp"].get_group() if dims.tp_enabled else None
        self.pp_group = mesh["pp"].get_group() if dims.pp_enabled else None
        self.sequence_parallel = sequence_parallel

    def no_sync(self, last: bool) -> ContextManager:
        # Every micro-batch reduce-scatters: gradients stay sharded (ZeRO-2/3), never whole.
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def after_evaluation(self) -> None:
        # A forward without backward leaves the units that keep their weights gathered until
        # backward (the root; every block at stage 2) unsharded: their module attributes are then
        # whole tensors, not the DTensor shards the optimizer steps and checkpoints save.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def step(self, tracer, loss_finite: bool) -> Update:
        params = list(self.model.parameters())
        with tracer.span("gradients: clip", "comm"):
            if self.sequence_parallel:
                sync_sequence_parallel_grads(self.model, self.tp_group)
            grad_norm = global_grad_norm(params, self.tp_group, self.pp_group,
                                         shard_group=self.shard_group)
            norm = grad_norm.item()
            update = Update(norm, applied=loss_finite and math.isfinite(norm))
            if update.applied:
                clip_grads(params, grad_norm, self.max_norm)
            else:
                update.nonfinite = first_nonfinite(params)
        with tracer.span("optimizer", "compute"):
            if update.applied:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return update

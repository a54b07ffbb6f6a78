"""DeepSpeed ZeRO (parallel.zero_stage = 1, 2, 3): optimizer state, gradients and parameters
sharded over the "dp" mesh dimension (dp x cp under context parallelism), instead of DDP.

`deepspeed_config(cfg)` derives the whole DeepSpeed JSON from partrain's config in one place
(pure, no DeepSpeed import, so `partrain show` and validation use it); `parallel.deepspeed` adds
raw keys on top, and one that contradicts a derived key is a config error. `apply_zero` hands the
(possibly tensor- or pipeline-parallel) model to `deepspeed.initialize` with partrain's mesh as
its `mpu`, so ZeRO partitions over dp replicas of the same tp shard / pp stage and the gradient
norm is summed over the rest of the model.

Choices that keep layout parity: gradient accumulation is ours (`managed_gradient_accumulation`
off: each micro-batch's backward accumulates, `engine.step()` reduces and steps once per
optimizer step), the learning rate follows partrain's warmup + cosine (set on the optimizer's
groups each step, as for every other layout) and weight decay skips norm gains (two parameter
groups). DeepSpeed clips and reports the norm before clipping.

Under expert parallelism (ZeRO-1/2) DeepSpeed's own MoE support takes the expert slices: they are
marked as its expert parameters (`allreduce=False`, a `group_name`), partrain's ep and
expert-data-parallel (edp x cp) groups are registered as DeepSpeed's expert groups of that name,
and the engine is shown partrain's MoE modules as its MoE class while it is built
(`_expert_parallel`). DeepSpeed then partitions each slice over the ranks holding it, sums its
gradients there divided by dp x cp (the same as `average_expert_gradients`), and sums its norm
over every dp rank (the slices of the ep group once each).
"""

import logging
import os
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn

from partrain.errors import ConfigError
from partrain.parallel.dist import compute_dtype


def _offload(device: str, path, on_cuda: bool) -> dict:
    # Pinned host buffers on CUDA: the copies to and from the GPU go by DMA, overlapped.
    section = {"device": device, "pin_memory": on_cuda and device != "none"}
    if device == "nvme":
        section["nvme_path"] = str(path)
    return section


def derived_config(cfg, on_cuda: bool = False) -> dict:
    """The DeepSpeed config that partrain's keys fix; cfg must be resolved (batch triple filled).

    Bucket sizes follow HF Accelerate's "auto" rule, hidden size squared (DeepSpeed's fixed 5e8
    elements is 2 GB in fp32, allocated whole, whatever the model's size); parameters under
    10 x hidden (norm gains) stay whole under ZeRO-3 rather than gathered at every use."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    bucket = cfg.model.dim ** 2
    # Expert slices are reduced over their own group only on DeepSpeed's contiguous-gradient
    # path: without it ZeRO-1 all-reduces them over every dp rank, summing different experts.
    zero = {"stage": p.zero_stage, "contiguous_gradients": p.zero_stage >= 2 or p.ep > 1,
            "overlap_comm": on_cuda and p.zero_stage >= 2,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "offload_optimizer": _offload(p.offload_optimizer, p.offload_nvme_path, on_cuda),
            "offload_param": _offload(p.offload_params, p.offload_nvme_path, on_cuda)}
    if p.zero_stage == 3:
        zero.update({"stage3_param_persistence_threshold": 10 * cfg.model.dim,
                     "stage3_prefetch_bucket_size": int(0.9 * bucket)})
    dtype = compute_dtype(t.dtype, on_cuda)
    return {
        # DeepSpeed counts a sequence once per data-parallel rank that sees it, and under cp its
        # data-parallel group is dp x cp: cp times partrain's batch (bookkeeping only, as the
        # accumulation and the loss scaling are partrain's).
        "train_batch_size": t.global_batch_size * p.cp,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.micro_batches,
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "gradient_clipping": o.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay,
            # torch's AdamW unless the optimizer runs on the CPU (ZeRO-Offload's
            # DeepSpeedCPUAdam): on CUDA its fused kernel, the one partrain uses without ZeRO
            # (DeepSpeed's own FusedAdam would need nvcc for a JIT build).
            "torch_adam": p.offload_optimizer == "none",
            **({"fused": True} if on_cuda and p.offload_optimizer == "none" else {})}},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Raw keys that would break what partrain does around the engine, with the reason.
FORBIDDEN = {
    "scheduler": "the learning rate follows optim.lr / warmup_steps / min_lr_ratio (partrain's "
                 "warmup + cosine, the same for every layout)",
    "managed_gradient_accumulation": "partrain accumulates gradients over train.micro_batches "
                                     "itself and steps the engine once per optimizer step",
}

# Derived keys that partrain's own config fixes, and which key that is. Other derived keys are
# partrain's defaults (bucket sizes, overlap, torch_adam, ...): raw keys may override those.
SOURCES = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.micro_batches",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_param.device": "parallel.offload_params",
    "bf16.enabled": "train.dtype",
    "fp16.enabled": "train.dtype",
    "gradient_clipping": "optim.grad_clip",
    "optimizer.type": "optim.name",
    "optimizer.params.lr": "optim.lr",
    "optimizer.params.betas": "optim.beta1 / optim.beta2",
    "optimizer.params.eps": "optim.eps",
    "optimizer.params.weight_decay": "optim.weight_decay",
}


def deepspeed_config(cfg, on_cuda: bool = False) -> dict:
    """The derived config with `parallel.deepspeed`'s raw keys merged in. Raises ConfigError when a
    raw key contradicts one that partrain's config fixes (both named) or is one partrain owns."""
    from omegaconf import OmegaConf

    derived = derived_config(cfg, on_cuda)
    raw = cfg.parallel.get("deepspeed") or {}
    raw = OmegaConf.to_container(raw, resolve=True) if not isinstance(raw, dict) else raw
    for key, why in FORBIDDEN.items():
        if key in raw:
            raise ConfigError(f"parallel.deepspeed.{key} is not allowed: {why}")
    fixed = {k: v for k, v in _flatten(derived).items() if k in SOURCES}
    for key, value in _flatten(raw).items():
        if key in fixed and fixed[key] != value:
            raise ConfigError(
                f"parallel.deepspeed.{key}={value!r} contradicts the derived {key}={fixed[key]!r} "
                f"(from {SOURCES[key]}); set {SOURCES[key]} instead, or drop the raw key")
        # A raw value where partrain derives a section (or the reverse) contradicts it too.
        for other in fixed:
            if other.startswith(key + ".") or key.startswith(other + "."):
                raise ConfigError(
                    f"parallel.deepspeed.{key} clashes with the derived {other} (from "
                    f"{SOURCES[other]}); set {SOURCES[other]} instead")
    merged = _merge(derived, raw)
    if cfg.parallel.ep > 1 and not merged["zero_optimization"]["contiguous_gradients"]:
        raise ConfigError(
            "parallel.deepspeed.zero_optimization.contiguous_gradients=false cannot be used with "
            f"parallel.ep={cfg.parallel.ep}: DeepSpeed reduces expert slices over their own ranks "
            "only on the contiguous-gradient path; drop the raw key")
    return merged


class MeshMPU:
    """DeepSpeed's `mpu` interface over partrain's (pp, dp, cp, tp) mesh.

    ZeRO partitions over the data-parallel group. DeepSpeed's "model parallel" group is every
    rank holding a different piece of one replica (pp x tp), over which it sums the gradient
    norm; parameters not marked `tensor_model_parallel` count only on tp rank 0, so replicated
    norm gains are counted once per pipeline stage."""

    def __init__(self, mesh, dims):
        self.dims = dims
        self.coords = dims.coords(dist.get_rank())
        # Under cp the data-parallel group is dp x cp: cp ranks hold the same parameters and
        # their gradients are averaged like dp's (DeepSpeed then counts each sequence cp times in
        # its batch size: derived_config).
        self._dp = mesh["dp_cp"].get_group()
        self._tp = mesh["tp"].get_group()
        self._pp = mesh["pp"].get_group()
        # One group per replica (the ranks sharing a dp coordinate); every rank takes part in
        # creating every group, as new_group requires, and keeps its own.
        for d in range(dims.dp):
            for c in range(dims.cp):
                ranks = [dims.rank(pp, d, tp, c) for pp in range(dims.pp) for tp in range(dims.tp)]
                group = dist.new_group(ranks)
                if (d, c) == (self.coords["dp"], self.coords["cp"]):
                    self._model, self._model_rank = group, ranks.index(dist.get_rank())

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self):
        return self.coords["dp"] * self.dims.cp + self.coords["cp"]

    def get_data_parallel_world_size(self):
        return self.dims.dp_cp

    def get_model_parallel_group(self):
        return self._model

    def get_model_parallel_rank(self):
        return self._model_rank

    def get_model_parallel_world_size(self):
        return self.dims.pp * self.dims.tp

    def get_tensor_model_parallel_group(self):
        return self._tp

    def get_tensor_model_parallel_rank(self):
        return self.coords["tp"]

    def get_tensor_model_parallel_world_size(self):
        return self.dims.tp

    def get_tensor_model_parallel_src_rank(self):
        return self.dims.rank(self.coords["pp"], self.coords["dp"], 0, self.coords["cp"])

    def get_pipeline_model_parallel_group(self):
        return self._pp

    def get_pipeline_model_parallel_world_size(self):
        return self.dims.pp


def _quiet_deepspeed() -> None:
    """DeepSpeed logs at INFO on every rank's stdout; rank 0's stdout is the progress display."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


@contextmanager
def _expert_parallel(model: nn.Module, expert_mesh):
    """Within the block, DeepSpeed sees this rank's expert slices as its expert parameters over
    partrain's ep groups: the engine built inside keeps them so (its optimizer's MoE groups)."""
    if expert_mesh is None:
        yield
        return
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.utils import groups

    from partrain.parallel.expert import moe_modules

    name = f"ep_size_{expert_mesh['ep'].size()}"
    for registry, dim in ((groups._EXPERT_PARALLEL_GROUP, "ep"),
                          (groups._EXPERT_DATA_PARALLEL_GROUP, "edp_cp")):
        registry[name] = expert_mesh[dim].get_group()
    for ranks, dim in ((groups._EXPERT_PARALLEL_GROUP_RANKS, "ep"),
                       (groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, "edp_cp")):
        ranks[name] = dist.get_process_group_ranks(expert_mesh[dim].get_group())
    for param in model.parameters():
        if getattr(param, "ep_sharded", False):
            param.allreduce, param.group_name = False, name
    # The engine finds MoE layers by DeepSpeed's class only; partrain's modules pass as it while
    # the engine is built (their groups exist already: nothing to set up).
    swapped = [(moe, type(moe)) for moe in moe_modules(model)]
    for moe, cls in swapped:
        moe.__class__ = type(cls.__name__, (cls, DeepSpeedMoE), {
            "num_experts": property(lambda self: self.n_experts),
            "set_deepspeed_parallelism": lambda self, *args, **kwargs: None})
    try:
        yield
    finally:
        for moe, cls in swapped:
            moe.__class__ = cls


def apply_zero(model: nn.Module, mesh, dims, ds_config: dict, param_groups: list[dict],
               expert_mesh=None):
    """Wrap `model` in a DeepSpeed engine; returns (engine, optimizer). `param_groups` are the
    optimizer's groups (weight decay on matrices only); the dp group comes from the mesh, the
    expert groups (under ep) from `expert_mesh`."""
    if mesh.device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    _quiet_deepspeed()
    for param in model.parameters():
        # DeepSpeed's name for a tensor-parallel shard: its norm sums these over tp.
        if getattr(param, "tp_sharded", False):
            param.tensor_model_parallel = True
        # A tied embedding's copy on the last pipeline stage: counted once in the norm, on the
        # first stage (DeepSpeed's own name for a weight replicated across stages).
        if getattr(param, "tied_to", None):
            param.ds_pipe_replicated = True
    with _expert_parallel(model, expert_mesh):
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups, config=ds_config,
            mpu=MeshMPU(mesh, dims), dist_init_required=False)
    return engine, optimizer


def zero_memory(stage: int, psi: int, nd: int, dtype: str) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state for Ψ = `psi` parameters per
    model replica shard, Nd = `nd` dp ranks and compute dtype fp32, bf16 or fp16 (ZeRO paper,
    section 3):

    - stage 0 (partrain's DDP): fp32 weights and gradients, AdamW's two fp32 moments: 4+4+8 = 16Ψ
      (autocast computes in bf16 but keeps fp32 weights, so there is no master copy).
    - stages 1-3 (DeepSpeed): w bytes of weights and of gradients per parameter and K = 12 bytes
      of optimizer state (fp32 master weights + two moments): with bf16/fp16 w = 2, the paper's
      4Ψ + 12Ψ/Nd, 2Ψ + 14Ψ/Nd, 16Ψ/Nd; in fp32 (CPU) w = 4 and DeepSpeed still keeps its own
      fp32 master copy, so 8Ψ + 12Ψ/Nd, 4Ψ + 16Ψ/Nd, 20Ψ/Nd.
    """
    w, k = (4, 8) if stage == 0 else ((4 if dtype == "fp32" else 2), 12)
    shard = {"param": stage >= 3, "grad": stage >= 2, "optim": stage >= 1}
    per = {"param": w, "grad": w, "optim": k}
    out = {f"{kind}_bytes": per[kind] * psi / (nd if shard[kind] else 1) for kind in per}
    out["total"] = sum(out.values())
    whole = sum(per[kind] for kind in per if not shard[kind])
    parts = sum(per[kind] for kind in per if shard[kind])
    out["formula"] = " + ".join(x for x in (f"{whole}Ψ" if whole else "",
                                            f"{parts}Ψ/Nd" if parts else "") if x)
    return out

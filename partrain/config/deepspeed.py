"""The DeepSpeed config partrain derives from its own keys (parallel.zero_stage >= 1): pure, no
DeepSpeed or torch import, so validation, `partrain show` and `plan` use it before any process
starts, and partrain.parallel.zero hands the same dict to `deepspeed.initialize`.

`deepspeed_config(cfg)` derives the whole JSON in one place; `parallel.deepspeed` adds raw keys on
top, and one that contradicts a derived key (or is one partrain owns) is a config error.
Choices that keep layout parity: gradient accumulation is partrain's
(`managed_gradient_accumulation` off), the learning rate follows partrain's schedule
(optim.schedule), and weight decay skips norm gains (two parameter groups).
"""

from partrain.config.resolve import compute_dtype
from partrain.errors import ConfigError


def _offload(device: str, path, on_cuda: bool) -> dict:
    # Pinned host buffers on CUDA: the copies to and from the GPU go by DMA, overlapped.
    section = {"device": device, "pin_memory": on_cuda and device != "none"}
    if device == "nvme":
        section["nvme_path"] = str(path)
    return section


def _optimizer(o, offload: str, on_cuda: bool) -> dict:
    """The optimizer section: the torch optimizer partrain builds without ZeRO, optim.name's.

    adamw and adam are DeepSpeed's "AdamW" and "Adam" with adam_w_mode false (its "Adam" alone
    is AdamW): torch's AdamW or Adam unless the optimizer runs on the CPU (ZeRO-Offload's
    DeepSpeedCPUAdam, in the same mode), on CUDA their fused kernel, the one partrain uses
    without ZeRO (DeepSpeed's own FusedAdam would need nvcc for a JIT build). sgd is a type
    DeepSpeed takes from torch.optim by name (torch.optim.SGD, on the host too under offload),
    which ZeRO runs as an "untested optimizer" once allowed to: its state, the momentum buffer,
    is sharded and checkpointed like Adam's moments."""
    if o.name == "sgd":
        return {"optimizer": {"type": "SGD", "params": {
                    "lr": o.lr, "momentum": o.momentum, "nesterov": o.nesterov,
                    "weight_decay": o.weight_decay}},
                "zero_allow_untested_optimizer": True}
    torch_adam = offload == "none"
    return {"optimizer": {"type": "Adam" if o.name == "adam" else "AdamW", "params": {
        "lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay,
        **({"adam_w_mode": False} if o.name == "adam" else {}),
        "torch_adam": torch_adam, **({"fused": True} if on_cuda and torch_adam else {})}}}


# DeepSpeed's defaults (deepspeed.runtime.zero.config): reduce and all-gather buckets of 5e8
# elements, ZeRO-3's prefetch bucket of 5e7 and persistence threshold of 1e5, for a model whose
# hidden size partrain does not know.
USER_MODEL_BUCKETS = {"bucket": 500_000_000, "prefetch": 50_000_000, "persistence": 100_000}


def derived_config(cfg, on_cuda: bool = False) -> dict:
    """The DeepSpeed config that partrain's keys fix; cfg must be resolved (batch triple filled).

    Bucket sizes follow HF Accelerate's "auto" rule, hidden size squared (DeepSpeed's fixed 5e8
    elements is 2 GB in fp32, allocated whole, whatever the model's size); parameters under
    10 x hidden (norm gains) stay whole under ZeRO-3 rather than gathered at every use. A user's
    own model (model.target) has no model.dim (its shape keys are the built-in family's): it
    gets DeepSpeed's own defaults (USER_MODEL_BUCKETS)."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    user = bool(cfg.model.get("target"))
    bucket = USER_MODEL_BUCKETS["bucket"] if user else cfg.model.dim ** 2
    # Expert slices are reduced over their own group only on DeepSpeed's contiguous-gradient
    # path: without it ZeRO-1 all-reduces them over every dp rank, summing different experts.
    zero = {"stage": p.zero_stage, "contiguous_gradients": p.zero_stage >= 2 or p.ep > 1,
            "overlap_comm": on_cuda and p.zero_stage >= 2,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "offload_optimizer": _offload(p.offload_optimizer, p.offload_nvme_path, on_cuda),
            "offload_param": _offload(p.offload_params, p.offload_nvme_path, on_cuda)}
    if p.zero_stage == 3:
        zero.update({"stage3_param_persistence_threshold":
                     USER_MODEL_BUCKETS["persistence"] if user else 10 * cfg.model.dim,
                     "stage3_prefetch_bucket_size":
                     USER_MODEL_BUCKETS["prefetch"] if user else int(0.9 * bucket)})
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
        **_optimizer(o, p.offload_optimizer, on_cuda),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def flatten_keys(tree: dict, prefix: str = "") -> dict:
    """{dotted path: value} of a nested mapping's leaves."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_keys(value, path + "."))
        else:
            flat[path] = value
    return flat


def merge_keys(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s keys over it, section by section."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_keys(merged[key], value)
        else:
            merged[key] = value
    return merged


# Raw keys that would break what partrain does around the engine, with the reason.
FORBIDDEN = {
    "scheduler": "the learning rate follows optim.lr / schedule / warmup_steps / min_lr_ratio "
                 "(partrain's schedule, the same for every layout)",
    "managed_gradient_accumulation": "partrain accumulates gradients over train.micro_batches "
                                     "itself and steps the engine once per optimizer step",
    "prescale_gradients": "partrain averages the gradients over the data-parallel ranks the "
                          "same way on every layout (and DeepSpeed's ZeRO-2 refuses it in the "
                          "ranks)",
    "gradient_predivide_factor": "partrain averages the gradients over the data-parallel ranks "
                                 "the same way on every layout (and DeepSpeed's ZeRO-2 refuses "
                                 "it in the ranks)",
    "tensor_parallel": "partrain's tensor parallelism is parallel.tp (its own wrappers, with "
                       "sequence parallelism and a user's tensor_parallel_plan); DeepSpeed's "
                       "AutoTP does not compose with them",
    "torch_autocast": "the compute dtype is train.dtype (bf16, fp16 or fp32); DeepSpeed's "
                      "autocast beside it trained in bf16 with train.dtype=fp32, saying nothing",
}


def harmless(key: str, value) -> bool:
    """A FORBIDDEN key at the value that changes nothing, as many public configs give it
    (DeepSpeed-Chat's `"prescale_gradients": false`): DeepSpeed's own default, or switched off."""
    if key == "prescale_gradients":
        return value is False
    if key == "gradient_predivide_factor":
        return value == 1.0 and not isinstance(value, bool)
    if key == "torch_autocast":
        return isinstance(value, dict) and value.get("enabled", False) is False
    if key == "tensor_parallel":
        return isinstance(value, dict) and all(
            value.get(size, 1) in (0, 1) for size in ("autotp_size", "tp_size"))
    return False


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
    "optimizer.params.adam_w_mode": "optim.name",
    "optimizer.params.momentum": "optim.momentum",
    "optimizer.params.nesterov": "optim.nesterov",
    "zero_allow_untested_optimizer": "optim.name",
}


def deepspeed_config(cfg, on_cuda: bool = False) -> dict:
    """The derived config with `parallel.deepspeed`'s raw keys merged in. Raises ConfigError when a
    raw key contradicts one that partrain's config fixes (both named) or is one partrain owns."""
    from omegaconf import OmegaConf

    derived = derived_config(cfg, on_cuda)
    raw = cfg.parallel.get("deepspeed") or {}
    raw = OmegaConf.to_container(raw, resolve=True) if not isinstance(raw, dict) else raw
    for key, why in FORBIDDEN.items():
        if key in raw and not harmless(key, raw[key]):
            raise ConfigError(f"parallel.deepspeed.{key} is not allowed: {why}")
    fixed = {k: v for k, v in flatten_keys(derived).items() if k in SOURCES}
    for key, value in flatten_keys(raw).items():
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
    merged = merge_keys(derived, raw)
    if cfg.parallel.ep > 1 and not merged["zero_optimization"]["contiguous_gradients"]:
        raise ConfigError(
            "parallel.deepspeed.zero_optimization.contiguous_gradients=false cannot be used with "
            f"parallel.ep={cfg.parallel.ep}: DeepSpeed reduces expert slices over their own ranks "
            "only on the contiguous-gradient path; drop the raw key")
    return merged

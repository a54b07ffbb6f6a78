"""The optimizer and its learning rate: AdamW, Adam or SGD (optim.name) over two parameter groups
(weight decay on matrices and embeddings only), and the schedule (optim.schedule: a linear warmup,
then cosine, linear, constant or warmup-stable-decay), set on the groups every step (under ZeRO
too, whose optimizer DeepSpeed builds over the same groups, partrain.config.deepspeed).

The learning rate is a function of the step alone, so a resume at step k sets the rate the
uninterrupted run had there."""

import math

import torch


def param_groups(model: torch.nn.Module, optim_cfg) -> list[dict]:
    """Weight decay on matrices and embeddings only, never on norm gains. The names are
    DeepSpeed's (its expert groups are split from named groups)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim_cfg.weight_decay,
             "name": "decay"},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(model: torch.nn.Module, optim_cfg,
                    device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    """optim.name over param_groups: torch's AdamW or Adam (its fused kernel on CUDA), or SGD
    (its for-each kernel on CUDA). Under ZeRO, DeepSpeed builds the same from its config."""
    groups = param_groups(model, optim_cfg)
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=optim_cfg.lr, momentum=optim_cfg.momentum,
                               nesterov=optim_cfg.nesterov)
    adam = torch.optim.Adam if optim_cfg.name == "adam" else torch.optim.AdamW
    return adam(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                eps=optim_cfg.eps, fused=device.type == "cuda")


def lr_at(step: int, optim_cfg, max_steps: int) -> float:
    """The learning rate of optimizer step `step` (1-based): linear warmup to optim.lr over
    warmup_steps, then, by optim.schedule, down to lr * min_lr_ratio at max_steps (cosine or
    linear), constant at lr, or wsd: constant until the last decay_ratio * max_steps steps, then
    1-sqrt down to the floor (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
    Beyond Fixed Training Durations": 1-sqrt beats a linear cooldown). Past max_steps (a resume
    may not set it below its checkpoint's step) the rate stays where the decay ended."""
    peak, warmup = optim_cfg.lr, optim_cfg.warmup_steps
    schedule = optim_cfg.schedule
    if step <= warmup:
        return peak * step / warmup
    if schedule == "constant":
        return peak
    floor = peak * optim_cfg.min_lr_ratio
    if schedule == "wsd":
        # The decay starts at a real-valued step, so that no rounding rule is part of the contract.
        start = max(warmup, max_steps * (1 - optim_cfg.decay_ratio))
        if step <= start:
            return peak
        progress = min(1.0, (step - start) / (max_steps - start))
        return floor + (peak - floor) * (1 - math.sqrt(progress))
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if schedule == "linear":
        return floor + (peak - floor) * (1 - progress)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

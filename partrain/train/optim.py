"""The optimizer and its learning rate: AdamW over two parameter groups (weight decay on matrices
and embeddings only), and linear warmup then cosine decay, set on the groups every step (under
ZeRO too, whose AdamW DeepSpeed builds over the same groups)."""

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
    """AdamW over param_groups, torch's fused kernel on CUDA (under ZeRO, DeepSpeed builds the
    same from its config)."""
    return torch.optim.AdamW(param_groups(model, optim_cfg), lr=optim_cfg.lr,
                             betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
                             fused=device.type == "cuda")


def lr_at(step: int, optim_cfg, max_steps: int) -> float:
    """Linear warmup to optim.lr over warmup_steps, then cosine down to lr * min_lr_ratio."""
    peak, warmup = optim_cfg.lr, optim_cfg.warmup_steps
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    floor = peak * optim_cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

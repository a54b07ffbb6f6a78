"""Builders a test names as model.target (tests.unit.models.user_models:NAME)."""

import torch
from torch import nn


class Plain(nn.Module):
    """A model that declares nothing: no tp plan, no pipeline split, no blocks."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def plain(model_cfg) -> nn.Module:
    return Plain(model_cfg.vocab_size, model_cfg.args.get("dim", 16))


def broken(model_cfg) -> nn.Module:
    raise ValueError("dim must be even")


def not_a_module(model_cfg):
    return 42


def frozen(model_cfg) -> nn.Module:
    """A fine-tuning habit: the embedding frozen (requires_grad=False), the head trained."""
    model = plain(model_cfg)
    model.embed.weight.requires_grad_(False)
    return model


class Counted(Plain):
    """A persistent buffer the output reads: a count of training forwards that sharpens the
    logits, so a resume that restarted it from the builder's 0 would train another model."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(tokens) * (1 + 0.05 * self.calls)


def counted(model_cfg) -> nn.Module:
    return Counted(model_cfg.vocab_size, model_cfg.args.get("dim", 16))


class Dropped(Plain):
    """Dropout between the embedding and the head: its masks come from torch's generator."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.dropout = nn.Dropout(0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embed(tokens)))


def dropped(model_cfg) -> nn.Module:
    return Dropped(model_cfg.vocab_size, model_cfg.args.get("dim", 16))

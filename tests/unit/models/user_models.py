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

"""`plan`'s checkpoint size (plan/costs.py true_size) against the state a run saves
(checkpoint/state.py build_state) for each optimizer: it said AdamW's 12 bytes per parameter
whatever the optimizer (9.2 MiB for the tiny model under SGD, whose checkpoint holds 6.3)."""

import pytest
import torch

from partrain.checkpoint.state import build_state
from partrain.models.family import build_family_model
from partrain.plan.costs import true_size
from tests.unit.helpers import validated


@pytest.mark.parametrize("optim", ["adamw", "adam", "sgd"])
def test_the_plans_checkpoint_size_is_the_saved_states(optim):
    cfg, _, _ = validated("parallel.dp=1", f"optim.name={optim}")
    model = build_family_model(cfg.model, 0)
    optimizer = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
                 "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[optim](
        model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    optimizer.step()  # the state exists, as after a run's first step
    state = build_state(model, optimizer, None, zero=False)
    saved = sum(t.numel() * t.element_size() for key, t in state.items()
                if key.startswith(("model.", "optim.")))
    buffers = sum(b.numel() * b.element_size() for _, b in model.named_buffers()
                  if f"model.{_}" in state)
    assert true_size(cfg.model, optim_cfg=cfg.optim) == saved - buffers

"""Under tp the loss reads each rank's logits as its shard of the vocabulary (train/step.py): a
model whose logits are the whole vocabulary on every rank trained, exit 0, with a loss log(tp)
too high. The plan check (models/tp_plan.py) refuses a plan with no head split over it; this
is the check at the loss itself, for whatever still makes whole logits."""

from types import SimpleNamespace

import pytest
import torch

from partrain.train.step import loss_function


def test_whole_logits_under_tp_are_an_error_naming_the_fix():
    # A stand-in for a tp=2 mesh (two ranks do not fit one process): the width is checked
    # before the group is used.
    dims = SimpleNamespace(tp_enabled=True, tp=2)
    mesh = {"tp": SimpleNamespace(get_group=lambda: None)}
    loss = loss_function(dims, mesh, vocab_size=256)
    from partrain.models.forward import ForwardContract

    # ForwardContract: the launcher says it and exits 2 (it was a RuntimeError: exit 1).
    with pytest.raises(ForwardContract, match=r"the model: its logits are 256 wide on each of parallel.tp=2 ranks.*"
                                           r"128 each.*\"vocab_head\""):
        loss(torch.zeros(2, 8, 256), torch.zeros(2, 8, dtype=torch.long))

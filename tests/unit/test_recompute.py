"""Activation checkpointing (partrain/models/recompute.py) on one process: the same loss and
gradients bit for bit in every mode, the MoE router counting each token once although its block
runs twice, and the activation memory each mode keeps, measured by torch's MemTracker (tensor
accounting of what autograd holds at the end of the forward, not the noisy RSS). Across layouts the same is held
by the parity rows that carry train.activation_checkpointing (tests/integration)."""

import pytest
import torch
import torch.nn.functional as F

from partrain.memory import measure_step
from partrain.models.llama import build_model
from partrain.models.moe import MoE
from partrain.models.recompute import MODES, apply_activation_checkpointing, checkpointed_blocks
from tests.unit.helpers import compose


def _step(recipe: str, mode: str):
    cfg = compose("launcher.device=cpu", "model.n_layers=2", config=recipe)
    model = build_model(cfg.model, 0)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    measured = measure_step(model, lambda: F.cross_entropy(model(tokens).flatten(0, 1),
                                                           tokens.flatten()))
    loss, activations = measured["loss"], measured["activations"]
    grads = {n: p.grad for n, p in model.named_parameters()}
    routers = [(m.load.clone(), m.routed, m.aux_calls, m.aux_sum.clone())
               for m in model.modules() if isinstance(m, MoE)]
    return model, loss, grads, activations, routers


@pytest.fixture(scope="module", params=["quickstart", "moe-tiny"])
def runs(request):
    return {mode: _step(request.param, mode) for mode in MODES}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_same_loss_and_gradients(runs, mode):
    model, loss, grads, _, routers = runs[mode]
    _, ref_loss, ref_grads, _, ref_routers = runs["none"]
    assert checkpointed_blocks(model) == model.cfg.n_layers
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    # The router's accounting happens in the forward only, not again in the recomputation.
    assert len(routers) == len(ref_routers)
    for (load, routed, calls, aux), (rload, rrouted, rcalls, raux) in zip(routers, ref_routers):
        assert torch.equal(load, rload) and (routed, calls) == (rrouted, rcalls)
        assert load.sum() == routed == 2 * 64 * 2 and calls == 1
        assert torch.equal(aux, raux)


def test_checkpointing_keeps_less(runs):
    kept = {mode: runs[mode][3] for mode in MODES}
    # full keeps each block's input only (plus the embedding and head around the blocks);
    # selective keeps the matmul and attention outputs, dropping the element-wise ones.
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert kept["full"] < kept["none"] / 3, kept
    assert kept["selective"] < kept["none"] * 0.75, kept


def test_no_checkpointing_without_gradients():
    """Evaluation (no_grad) runs the blocks plainly: nothing to recompute."""
    cfg = compose("launcher.device=cpu")
    model = build_model(cfg.model, 0)
    apply_activation_checkpointing(model, "full")
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        plain = model(tokens)
    apply_activation_checkpointing(model, "none")
    assert checkpointed_blocks(model) == 0
    with torch.no_grad():
        assert torch.equal(plain, model(tokens))

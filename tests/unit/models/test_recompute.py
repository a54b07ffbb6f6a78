"""Activation checkpointing (partrain/models/recompute.py) on one process: the same loss and
gradients bit for bit in every mode, the MoE router counting each token once although its block
runs twice, and the activation memory each mode keeps, measured by torch's MemTracker (tensor
accounting of what autograd holds at the end of the forward, not the noisy RSS). Across layouts the same is held
by the parity rows that carry train.activation_checkpointing (tests/integration)."""

import pytest
import torch
import torch.nn.functional as F

from partrain.models.arith import RECOMPUTE_MODES as MODES
from partrain.models.llama import build_model
from partrain.models.moe import MoE
from partrain.observe.memory import measure_step
from partrain.parallel.parallelize import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    compile_blocks,
)
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


@pytest.mark.parametrize("recipe,mode", [("quickstart", "none"), ("quickstart", "selective"),
                                         ("quickstart", "full"), ("moe-tiny", "none"),
                                         ("moe-tiny", "full")])
def test_compiled_blocks_train_the_same_model(recipe, mode):
    """train.compile: the blocks through torch.compile (inductor, C++ on CPU) give the eager loss
    and gradients to float rounding (the fused kernels reorder sums), with the block's
    checkpointing compiled in."""
    cfg = compose("launcher.device=cpu", "model.n_layers=2", config=recipe)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    from torch._dynamo.utils import counters

    results = []
    for compiled in (False, True):
        model = build_model(cfg.model, 0)
        apply_activation_checkpointing(model, mode)
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            assert compile_blocks(model) == cfg.model.n_layers
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        routers = [(m.load.clone(), m.routed, m.aux_calls) for m in model.modules()
                   if isinstance(m, MoE)]
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, routers,
                        counters["stats"]["unique_graphs"]))
    (eager, eager_grads, eager_routers, eager_graphs), (comp, comp_grads, routers, graphs) = results
    # Really compiled: dynamo made graphs of the blocks (of their attention, for a MoE block
    # that checkpoints), none without compile.
    assert eager_graphs == 0 and graphs > 0
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=0)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The router counts each token once (top-2), compiled or not, recomputed or not.
    assert len(routers) == len(eager_routers) == (cfg.model.n_layers if recipe == "moe-tiny" else 0)
    for (load, routed, calls), (eager_load, eager_routed, _) in zip(routers, eager_routers):
        assert torch.equal(load, eager_load) and routed == eager_routed == 2 * 32 * 2 and calls == 1

"""The MoE layer (partrain/models/moe.py) against a dense loop over experts, forward and backward;
routing rules (stable ties, capacity, the DeepSeek bias); the parameter arithmetic of `plan`."""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from partrain.config.schema import ModelConfig
from partrain.models.arith import (
    count_params,
    count_params_per_rank,
    flops_per_token,
    moe_blocks,
)
from partrain.models.llama import build_model
from partrain.models.moe import MoE, update_expert_bias


def model_cfg(**moe):
    cfg = OmegaConf.structured(ModelConfig)
    cfg.moe.n_experts = 8
    cfg.moe.expert_ffn_dim = 32
    for key, value in moe.items():
        cfg.moe[key] = value
    return cfg


def moe_layer(seed=0, **moe):
    cfg = model_cfg(**moe)
    torch.manual_seed(seed)
    layer = MoE(cfg, 64)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def dense_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: softmax over the router logits, the top-k by a plain
    Python sort (ties to the lower id), weights renormalised, each chosen expert's SwiGLU."""
    e = layer.experts
    out = torch.zeros_like(x)
    flat, res = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for n, token in enumerate(flat):
        probs = (layer.router.weight.float() @ token.float()).softmax(-1)
        choice = probs + layer.expert_bias if layer.balance == "bias" else probs
        ranked = sorted(range(layer.n_experts), key=lambda i: (-choice[i].item(), i))[:layer.top_k]
        weights = probs[ranked]
        if layer.norm_topk and layer.top_k > 1:
            weights = weights / weights.sum()
        for w, i in zip(weights, ranked):
            hidden = F.silu(e.w1[i] @ token) * (e.w3[i] @ token)
            res[n] = res[n] + w * (e.w2[i] @ hidden)
        if layer.shared is not None:
            res[n] = res[n] + layer.shared(token)
    return out


@pytest.mark.parametrize("moe", [dict(top_k=2), dict(top_k=1, n_shared_experts=1),
                                 dict(top_k=3, norm_topk=False), dict(top_k=2, balance="bias")])
def test_moe_matches_a_dense_loop_forward_and_backward(moe):
    layer = moe_layer(**moe, **({} if "balance" in moe else {"balance": "none"}))
    if layer.balance == "bias":
        layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, layer.n_experts))
    x = torch.randn(2, 6, 128, requires_grad=True)
    grad_out = torch.randn(2, 6, 128)
    out = layer(x)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], grad_out)
    want = dense_reference(layer, x)
    want_grads = torch.autograd.grad(want, [x, *layer.parameters()], grad_out)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    for (name, _), got, ref in zip([("x", x), *layer.named_parameters()], grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                   msg=name)


def test_equal_scores_go_to_the_lowest_expert_ids():
    layer = moe_layer(top_k=2)
    layer.router.weight.data.zero_()
    _, chosen, weights = layer.route(torch.randn(5, 128))
    assert chosen.tolist() == [[0, 1]] * 5
    assert torch.allclose(weights, torch.full((5, 2), 0.5))


def test_capacity_keeps_the_earliest_tokens_of_each_sequence():
    layer = moe_layer(top_k=1, capacity_factor=1.0, balance="none")
    layer.router.weight.data.zero_()  # every token to expert 0
    seq = 16
    cap = math.ceil(1.0 * seq * 1 / 8)  # 2 tokens of each sequence
    x = torch.randn(2, seq, 128)
    out = layer(x)
    e = layer.experts
    expected = torch.zeros_like(x)
    for b in range(2):
        for t in range(cap):
            expected[b, t] = e.w2[0] @ (F.silu(e.w1[0] @ x[b, t]) * (e.w3[0] @ x[b, t])) / 8
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)  # top-1: weight 1/8
    assert layer.load.tolist() == [2 * cap] + [0] * 7


def test_aux_loss_value_and_its_gradient_reach_the_router():
    layer = moe_layer(top_k=2, balance="aux_loss", aux_loss_coef=0.1)
    layer.aux_scale = 0.5
    x = torch.randn(3, 10, 128)
    out = layer(x)
    # Switch's loss per sequence: coef * E * sum_e f_e P_e with f_e = count / (k * T).
    scores, chosen, _ = layer.route(x.reshape(-1, 128))
    counts = F.one_hot(chosen, 8).sum(1).view(3, 10, 8).sum(1).float()
    probs = scores.view(3, 10, 8).mean(1)
    aux = 0.1 * (counts * 8 / (2 * 10) * probs).sum(-1).mean()
    assert layer.aux_calls == 1
    torch.testing.assert_close(layer.aux_sum, aux.detach())
    (router_grad,) = torch.autograd.grad(out.sum(), [layer.router.weight])
    # The same model without the loss, plus 0.5 * aux added by hand: the same router gradient.
    scores, _, _ = layer.route(x.reshape(-1, 128))
    aux_again = 0.1 * (counts * 8 / (2 * 10) * scores.view(3, 10, 8).mean(1)).sum(-1).mean()
    layer.balance = "none"
    out_none = layer(x)
    (want,) = torch.autograd.grad(out_none.sum() + 0.5 * aux_again, [layer.router.weight])
    torch.testing.assert_close(router_grad, want)
    (without,) = torch.autograd.grad(layer(x).sum(), [layer.router.weight])
    assert not torch.allclose(want, without)  # the loss does reach the router


def test_the_aux_loss_gradient_follows_the_loss_scale():
    """fp16 under DeepSpeed multiplies the loss by its scale S and divides every gradient by S at
    the step: the auxiliary loss's gradient must be multiplied by S too, or it arrives divided by
    S (2^16 at the start) and balancing is off in all but name. With loss_scale S and the loss
    times S, every router gradient is S times the unscaled one."""
    layer = moe_layer(top_k=2, balance="aux_loss", aux_loss_coef=0.1)
    layer.aux_scale = 0.5
    x = torch.randn(3, 10, 128)
    (unscaled,) = torch.autograd.grad(layer(x).sum(), [layer.router.weight])
    layer.loss_scale = 1024.0
    (scaled,) = torch.autograd.grad(layer(x).sum() * 1024.0, [layer.router.weight])
    torch.testing.assert_close(scaled / 1024.0, unscaled)


def test_the_zero_backend_gives_each_moe_the_loss_scale_before_backward():
    """ZeroBackend.backward sets DeepSpeed's current loss scale on every MoE layer under fp16.
    A stand-in engine and optimizer: DeepSpeed trains fp16 on CUDA only, not on this CPU."""
    from types import SimpleNamespace

    from partrain.parallel.zero import ZeroBackend

    module = torch.nn.Sequential(moe_layer(balance="aux_loss"), moe_layer(balance="aux_loss"))
    scales = []
    engine = SimpleNamespace(module=module, fp16_enabled=lambda: True,
                             backward=lambda loss, scale_wrt_gas: scales.append(
                                 [m.loss_scale for m in module]))
    optimizer = SimpleNamespace(optimizer=SimpleNamespace(step=lambda: None), loss_scale=2.0 ** 16)
    ZeroBackend(engine, optimizer).backward(torch.zeros(()))
    assert scales == [[2.0 ** 16, 2.0 ** 16]]


def test_bias_moves_towards_the_mean_load_and_steers_only_the_choice():
    layer = moe_layer(top_k=2, balance="bias", bias_update_rate=0.01)
    update_expert_bias(layer, torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.01] + [0.01] * 6 + [-0.01])
    layer.router.weight.data.zero_()
    layer.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0.1, 0.2]))
    scores, chosen, weights = layer.route(torch.randn(4, 128))
    assert chosen.tolist() == [[7, 6]] * 4  # the bias picks the experts...
    assert torch.allclose(weights, torch.full((4, 2), 0.5))  # ...the scores weight them


def test_eval_forward_counts_no_load():
    layer = moe_layer().eval()
    layer(torch.randn(1, 4, 128))
    assert layer.load.sum() == 0 and layer.aux_calls == 0


@pytest.mark.parametrize("moe", [dict(), dict(first_dense=1, every=2),
                                 dict(n_shared_experts=2, expert_ffn_dim=None)])
def test_parameter_arithmetic_matches_the_built_model(moe):
    cfg = model_cfg(**moe)
    model = build_model(cfg, 0)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    blocks = moe_blocks(cfg)
    assert blocks == [i for i in range(cfg.n_layers) if isinstance(model.layers[str(i)].feed_forward, MoE)]
    # Active: each MoE block uses top_k of its routed experts.
    per_expert = 3 * cfg.dim * (cfg.moe.expert_ffn_dim or 352)
    idle = (cfg.moe.n_experts - cfg.moe.top_k) * per_expert * len(blocks)
    assert count_params(cfg, active=True) == count_params(cfg) - idle
    assert flops_per_token(cfg, 128) < 6 * count_params(cfg) + 6 * cfg.n_layers * 128 * cfg.dim
    # Under ep=4 a rank holds a quarter of the routed experts.
    assert count_params_per_rank(cfg, ep=4) == count_params(cfg) - (
        cfg.moe.n_experts * 3 // 4) * per_expert * len(blocks)

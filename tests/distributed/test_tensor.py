"""Tensor-parallel layers against their dense references on real gloo process groups: outputs and
input/weight gradients in fp32 within 1e-5, for tp in {2, 4}, with and without sequence
parallelism; then the whole tiny model, its collectives counted against the arithmetic, and the
tp-aware gradient norm."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.distributed.helpers import run_distributed

ATOL = 1e-5


def _close(got, want, what):
    err = (got - want).abs().max().item()
    assert torch.allclose(got, want, atol=ATOL, rtol=ATOL), f"{what}: max abs error {err:.2e}"


def _shard(t, dim, rank, tp):
    return t.chunk(tp, dim=dim)[rank]


def _column(rank, tp, sp, group):
    from partrain.parallel.tensor import ColumnParallelLinear

    x, w = torch.randn(2, 8, 16), torch.randn(12 * tp, 16)
    gy = torch.randn(2, 8, 12 * tp)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    yd = F.linear(xd, wd)
    (yd * gy).sum().backward()

    for gather in ((False,) if sp else (False, True)):
        layer = ColumnParallelLinear(w, group, gather_output=gather, sequence_parallel=sp)
        assert layer.weight.shape == (12, 16) and layer.weight.tp_sharded
        xl = (_shard(x, 1, rank, tp) if sp else x).clone().requires_grad_()
        y = layer(xl)
        want_y, g = (yd, gy) if gather else (_shard(yd, -1, rank, tp), _shard(gy, -1, rank, tp))
        _close(y, want_y.detach(), f"column sp={sp} gather={gather} output")
        (y * g).sum().backward()
        want_gx = _shard(xd.grad, 1, rank, tp) if sp else xd.grad
        _close(xl.grad, want_gx, f"column sp={sp} gather={gather} input grad")
        _close(layer.weight.grad, _shard(wd.grad, 0, rank, tp), f"column sp={sp} weight grad")


def _row(rank, tp, sp, group):
    from partrain.parallel.tensor import RowParallelLinear

    x, w = torch.randn(2, 8, 6 * tp), torch.randn(16, 6 * tp)
    gy = torch.randn(2, 8, 16)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    yd = F.linear(xd, wd)
    (yd * gy).sum().backward()

    for parallel_input in ((True,) if sp else (True, False)):
        layer = RowParallelLinear(w, group, input_is_parallel=parallel_input, sequence_parallel=sp)
        xl = (_shard(x, -1, rank, tp) if parallel_input else x).clone().requires_grad_()
        y = layer(xl)
        want_y, g = (_shard(yd, 1, rank, tp), _shard(gy, 1, rank, tp)) if sp else (yd, gy)
        _close(y, want_y.detach(), f"row sp={sp} output")
        (y * g).sum().backward()
        want_gx = _shard(xd.grad, -1, rank, tp) if parallel_input else xd.grad
        _close(xl.grad, want_gx, f"row sp={sp} parallel_input={parallel_input} input grad")
        _close(layer.weight.grad, _shard(wd.grad, 1, rank, tp), f"row sp={sp} weight grad")


def _embedding(rank, tp, sp, group):
    from partrain.parallel.tensor import VocabParallelEmbedding

    vocab = 10 * tp
    tokens, w = torch.randint(0, vocab, (2, 8)), torch.randn(vocab, 16)
    gy = torch.randn(2, 8, 16)
    wd = w.clone().requires_grad_()
    yd = F.embedding(tokens, wd)
    (yd * gy).sum().backward()

    layer = VocabParallelEmbedding(w, group, sequence_parallel=sp)
    y = layer(tokens)
    want_y, g = (_shard(yd, 1, rank, tp), _shard(gy, 1, rank, tp)) if sp else (yd, gy)
    _close(y, want_y.detach(), f"embedding sp={sp} output")
    (y * g).sum().backward()
    _close(layer.weight.grad, _shard(wd.grad, 0, rank, tp), f"embedding sp={sp} weight grad")


def _cross_entropy(rank, tp, group):
    from partrain.parallel.tensor import vocab_parallel_cross_entropy

    logits, target = torch.randn(2, 8, 10 * tp) * 3, torch.randint(0, 10 * tp, (2, 8))
    dense = logits.clone().requires_grad_()
    want = F.cross_entropy(dense.flatten(0, 1), target.flatten())
    want.backward()
    local = _shard(logits, -1, rank, tp).clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, target, group)
    _close(got, want.detach(), "vocab-parallel cross-entropy")
    got.backward()
    _close(local.grad, _shard(dense.grad, -1, rank, tp), "vocab-parallel cross-entropy grad")


def _layers_body(rank, tp, sp):
    torch.manual_seed(0)  # the same full tensors on every rank; each layer keeps its slice
    group = dist.group.WORLD
    _column(rank, tp, sp, group)
    _row(rank, tp, sp, group)
    _embedding(rank, tp, sp, group)
    if not sp:
        _cross_entropy(rank, tp, group)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sequence-parallel"])
def test_layers_match_dense(tp, sp):
    run_distributed(_layers_body, tp, sp)


MODEL = dict(name="t", n_layers=2, n_heads=4, n_kv_heads=4, dim=32, ffn_dim=64, multiple_of=32,
             vocab_size=64, max_seq_len=16, rope_theta=10000.0, norm_eps=1e-5, init_std=0.05)


def _built(cfg):
    """The model of the seed, its q/k/v biases and q/k norm gains (if any) drawn away from their
    zeros and ones, so that a wrong slice or a missing gradient sum shows."""
    from partrain.models.llama import build_model

    model = build_model(cfg, seed=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    return model


def _model_body(rank, tp, sp, kv_heads, tied=False, keys=None):
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.parallel.grads import clip_grad_norm
    from partrain.parallel.tensor import (
        apply_tensor_parallel,
        sync_sequence_parallel_grads,
        vocab_parallel_cross_entropy,
    )
    from partrain.parallel.tp_collectives import count_collectives
    from partrain.plan.costs import tp_collectives, tp_step_collectives

    cfg = OmegaConf.create({**MODEL, "n_kv_heads": kv_heads, "tie_embeddings": tied,
                            **(keys or {})})
    dense = _built(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    target = tokens.roll(-1, dims=1)
    want = F.cross_entropy(dense(tokens).flatten(0, 1), target.flatten())
    want.backward()
    want_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf"))

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    model = apply_tensor_parallel(_built(cfg), mesh,
                                  OmegaConf.create({"sequence_parallel": sp}))
    with count_collectives() as counted:
        loss = vocab_parallel_cross_entropy(model(tokens), target, group)
        loss.backward()
        if sp:
            sync_sequence_parallel_grads(model, group)
        norm = clip_grad_norm(model.parameters(), float("inf"), group)
    # Tied: one vocabulary shard shared by the embedding and the head, both gradients in it.
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    _close(loss.detach(), want.detach(), "model loss")
    _close(norm, want_norm, "gradient norm (each parameter counted once)")

    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        full = dense_params[name].grad
        if getattr(param, "tp_sharded", False):
            dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
            full = _shard(full, dim, rank, tp)
        _close(param.grad, full, f"model grad {name}")

    # Every collective that ran is one the arithmetic predicts, with the same payload.
    expected = {}
    for row in tp_collectives(cfg, tokens.numel(), tp, sp) + tp_step_collectives(cfg, tp, sp):
        entry = expected.setdefault(row["op"], {"calls": 0, "bytes": 0})
        entry["calls"] += row["calls"]
        entry["bytes"] += row["bytes"]
    assert {op: dict(v) for op, v in counted.items()} == expected
    # ... and the arithmetic is Megatron's: per layer 2 forward + 2 backward region crossings.
    L, T, d = cfg.n_layers, tokens.numel(), cfg.dim
    if keys:  # the q/k norm gains' gradient sums come on top (counted above)
        return
    if sp:
        assert expected["all_gather"] == {"calls": 4 * L + 2, "bytes": (4 * L + 2) * T * d * 4}
        assert expected["reduce_scatter"] == expected["all_gather"]
    else:
        assert expected["all_reduce"]["calls"] == 4 * L + 2 + 3 + 1
        assert expected["all_reduce"]["bytes"] == ((4 * L + 2) * T * d + 3 * T + 1) * 4


# Qwen3-like: heads of their own width (4 x 12 = 48, not dim 32), as real Qwen3 sizes have.
QWEN = {"qkv_bias": True, "qk_norm": True, "head_dim": 12}


@pytest.mark.parametrize("tp,sp,kv_heads,tied,keys", [
    (2, False, 2, False, None), pytest.param(4, False, 4, False, None, marks=pytest.mark.slow),
    (2, True, 2, False, None), (2, False, 2, True, None), (2, True, 2, False, QWEN)],
    ids=["tp2-gqa", "tp4", "tp2-sequence-parallel", "tp2-tied",
         "tp2-sp-qkv-bias-qk-norm-head-dim"])
def test_model_matches_dense(tp, sp, kv_heads, tied, keys):
    """keys=QWEN: the q/k/v biases split with their rows, the per-head q/k norm gains replicated
    with their gradients summed over tp (each rank norms only its own heads), and heads of
    model.head_dim split whole (wo's input is heads x head_dim, not dim)."""
    run_distributed(_model_body, tp, sp, kv_heads, tied, keys)

"""Document masking (train.document_masking) against running each document alone, on real gloo
process groups: a packed sequence of several documents through the tensor-parallel model (with
sequence parallelism) and through a 1F1B pipeline (with full recomputation, whose backward
recomputes a micro-batch's forward after the next one's ran) gives the loss and every gradient
that the one-process model gives when it runs each document as a sequence of its own."""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.distributed.helpers import run_distributed

MODEL = dict(name="t", n_layers=4, n_heads=4, n_kv_heads=2, dim=32, ffn_dim=64, multiple_of=32,
             vocab_size=64, max_seq_len=16, rope_theta=10000.0, norm_eps=1e-5, init_std=0.05,
             tie_embeddings=False)
SEQ = 16
# Two micro-batches of two rows; each row's documents as lengths (the last one cut by the row).
LENGTHS = [[[5, 7, 4], [16]], [[1, 15], [3, 3, 3, 7]]]
RTOL = 1e-5


def _close(got, want, what):
    err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def _micro():
    """[(tokens, targets, document ids)] for LENGTHS, tokens from a fixed generator."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for rows in LENGTHS:
        tokens = torch.randint(0, MODEL["vocab_size"], (len(rows), SEQ + 1), generator=gen)
        docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                            for r in rows]).int()
        out.append((tokens[:, :-1], tokens[:, 1:], docs))
    return out


def _alone_loss(model, micro):
    """The mean loss with each document run alone (its own sequence, from position 0), per
    micro-batch as the trainer scales it (1 / micro-batches)."""
    total = 0.0
    for x, y, docs in micro:
        logits = []
        for row in range(x.shape[0]):
            for d in docs[row].unique():
                cols = (docs[row] == d).nonzero().flatten()
                logits.append(model(x[row:row + 1, cols]).flatten(0, 1))
        total = total + F.cross_entropy(torch.cat(logits), y.flatten()) / len(micro)
    return total


def _build(seed=1):
    from partrain.models.llama import build_model

    return build_model(OmegaConf.create(MODEL), seed=seed)


def _tp_body(rank, tp, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.parallel.tensor import (
        apply_tensor_parallel,
        sync_sequence_parallel_grads,
        vocab_parallel_cross_entropy,
    )

    micro = _micro()
    dense = _build()
    want = _alone_loss(dense, micro)
    want.backward()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    model = apply_tensor_parallel(_build(), mesh, OmegaConf.create({"sequence_parallel": sp}))
    loss = sum(vocab_parallel_cross_entropy(model(x, documents=d), y, group) / len(micro)
               for x, y, d in micro)
    loss.backward()
    if sp:
        sync_sequence_parallel_grads(model, group)
    _close(loss.detach(), want.detach(), "loss")
    with torch.no_grad():  # the mask matters here: unmasked, the loss is another
        unmasked = sum(vocab_parallel_cross_entropy(model(x), y, group) for x, y, _ in micro)
    assert abs(unmasked.item() / len(micro) - want.item()) > 1e-3
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        full = dense_params[name].grad
        if getattr(param, "tp_sharded", False):
            dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
            full = full.chunk(tp, dim=dim)[rank]
        _close(param.grad, full, f"grad {name}")


def _pp_body(rank, pp):
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.parallel.pipeline import apply_pipeline_parallel

    micro = _micro()
    dense = _build()
    want = _alone_loss(dense, micro)
    want.backward()
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    model = _build()
    for block in model.layers.values():
        block.recompute = "full"
    pipeline = apply_pipeline_parallel(model, mesh, OmegaConf.create(
        {"pp_schedule": "1f1b", "pp_virtual_stages": 1}), (2, SEQ, MODEL["dim"]))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    loss = pipeline.run(micro, loss_fn, nullcontext())
    dist.all_reduce(loss, group=mesh.get_group())
    _close(loss, want.detach(), "loss")
    dense_params = dict(dense.named_parameters())
    for chunk in pipeline.chunks:
        for name, param in chunk.named_parameters():
            _close(param.grad, dense_params[name].grad, f"grad {name}")


@pytest.mark.parametrize("tp,sp", [(2, True)], ids=["tp2-sequence-parallel"])
def test_tensor_parallel_masking_is_each_document_alone(tp, sp):
    run_distributed(_tp_body, tp, sp)


def test_pipeline_masking_is_each_document_alone():
    run_distributed(_pp_body, 2)

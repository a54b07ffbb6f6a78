"""Tied embeddings across pipeline stages on real gloo process groups: the first stage's embedding
and the last stage's head are copies of one weight whose gradients are summed over the embedding
group. Against the one-process tied model over a few AdamW steps with clipping: the same loss,
the same gradient norm (the weight counted once), the same weights, and the two copies equal."""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.distributed.helpers import run_distributed

MODEL = dict(name="t", n_layers=6, n_heads=4, n_kv_heads=2, dim=32, ffn_dim=64, multiple_of=32,
             vocab_size=64, max_seq_len=16, rope_theta=10000.0, norm_eps=1e-5, init_std=0.05,
             tie_embeddings=True)
RTOL = 1e-5
STEPS, MICRO, BATCH, SEQ = 3, 6, 2, 8


def _close(got, want, what):
    err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def _micro(step):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _tied_pipeline_body(rank, pp, schedule, v):
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.checkpoint.state import named_parameters
    from partrain.models.llama import build_model
    from partrain.parallel.grads import clip_grad_norm
    from partrain.parallel.pipeline import apply_pipeline_parallel

    cfg = OmegaConf.create(MODEL)
    dense = build_model(cfg, seed=1)
    dense_opt = _optimizer(dense.parameters())
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    parallel = OmegaConf.create({"pp_schedule": schedule, "pp_virtual_stages": v})
    model = apply_pipeline_parallel(build_model(cfg, seed=1), mesh, parallel,
                                    (BATCH, SEQ, cfg.dim))
    opt = _optimizer(model.parameters())
    first, last = rank == 0, rank == pp - 1
    assert (model.tied is not None) == (first or last)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    for step in range(STEPS):
        micro = _micro(step)
        want = sum(loss_fn(dense(x), y) / MICRO for x, y in micro)
        want.backward()
        want_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
        dense_opt.step()
        dense_opt.zero_grad()

        loss = model.run(micro, loss_fn, nullcontext())
        model.all_reduce_tied_grads()
        norm = clip_grad_norm(model.parameters(), 0.5, None, mesh.get_group())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss, group=mesh.get_group())
        _close(loss, want.detach(), f"step {step} loss")
        _close(norm, want_norm, f"step {step} gradient norm (tied weight counted once)")

    wanted = dict(dense.named_parameters())
    params = named_parameters(model)
    assert "output.weight" not in params and "output.weight" not in wanted
    for name, param in params.items():
        _close(param.detach(), wanted[name].detach(), f"{name} after {STEPS} steps")
    copies = [None] * pp
    dist.all_gather_object(copies, model.tied.detach() if model.tied is not None else None)
    assert torch.equal(copies[0], copies[-1]), "the two copies of the tied embedding differ"


@pytest.mark.parametrize("pp,schedule,v", [(2, "1f1b", 1),
                                           pytest.param(3, "interleaved_1f1b", 2,
                                                        marks=pytest.mark.slow)],
                         ids=["pp2-1f1b", "pp3-interleaved"])
def test_tied_embedding_across_stages(pp, schedule, v):
    run_distributed(_tied_pipeline_body, pp, schedule, v)

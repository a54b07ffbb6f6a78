"""FSDP2 (partrain.parallel.fsdp) on real gloo process groups: how often it gathers weights and
reduces gradients, counted at torch.distributed's collectives, and the gradients it leaves against
one process's.

- Without pp, stage 3 gathers a block for its forward and again for its backward (2 per block and
  micro-batch), stage 2 once; every micro-batch reduce-scatters (gradients stay sharded).
- Under pp (partrain's executor runs a backward per micro-batch), a stage's weights are gathered
  once a step and its gradients reduce-scattered once a step, whatever the micro-batch count.
In each case the accumulated gradient shards are those of the mean loss over the global batch."""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed.helpers import run_distributed

SEQ, MICRO, PER_MICRO = 16, 4, 2  # micro-batches per step, sequences per rank's micro-batch


@contextmanager
def counted():
    """Count FSDP's all-gathers and reduce-scatters (it calls them through torch.distributed)."""
    calls = {"all_gather": 0, "reduce_scatter": 0}
    saved = dist.all_gather_single, dist.reduce_scatter_single

    def gather(*args, **kwargs):
        calls["all_gather"] += 1
        return saved[0](*args, **kwargs)

    def scatter(*args, **kwargs):
        calls["reduce_scatter"] += 1
        return saved[1](*args, **kwargs)
    dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    try:
        yield calls
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = saved


def _setup(world: int, dp: int, pp: int):
    from partrain.config.compose import compose_config
    from partrain.models.llama import build_model

    cfg = compose_config(None, ["model.n_layers=4", "model.dim=64", f"parallel.pp={pp}",
                                f"parallel.dp={dp}", f"train.seq_len={SEQ}"])
    tokens = torch.randint(0, 256, (dp * MICRO * PER_MICRO, SEQ + 1),
                           generator=torch.Generator().manual_seed(7))
    return cfg, build_model(cfg.model, 0), tokens


def _reference_grads(cfg, tokens) -> dict[str, torch.Tensor]:
    """One process: the gradient of the mean loss over every sequence."""
    from partrain.models.llama import build_model

    model = build_model(cfg.model, 0)
    x, y = tokens[:, :-1], tokens[:, 1:]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _check_grads(model, reference: dict, prefix_chunks: bool) -> None:
    from partrain.checkpoint.state import canonical_name

    seen = 0
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        want = reference[canonical_name(name) if prefix_chunks else name]
        got = param.grad.full_tensor()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        seen += 1
    assert seen, "no gradient was checked"


def _without_pp(rank: int, world: int, stage: int) -> None:
    from partrain.parallel.fsdp import apply_fsdp
    from partrain.parallel.mesh import ParallelDims

    cfg, model, tokens = _setup(world, world, 1)
    mesh = ParallelDims(pp=1, dp=world, tp=1, zero_stage=stage, zero_backend="fsdp").build_mesh("cpu")
    apply_fsdp(model, mesh["dp_cp"], None, stage, None, offload=False)
    mine = tokens[rank * MICRO * PER_MICRO:(rank + 1) * MICRO * PER_MICRO]
    with counted() as calls:
        for micro in mine.split(PER_MICRO):
            x, y = micro[:, :-1], micro[:, 1:]
            (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / MICRO).backward()
    blocks, units = cfg.model.n_layers, cfg.model.n_layers + 1  # + the root
    # The root keeps its weights from forward to backward; blocks gather again at stage 3.
    assert calls["all_gather"] == MICRO * (units + (blocks if stage == 3 else 0)), calls
    assert calls["reduce_scatter"] == MICRO * units, calls
    _check_grads(model, _reference_grads(cfg, tokens), prefix_chunks=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp_gathers_per_micro_batch_by_stage(stage):
    run_distributed(_without_pp, 2, stage)


def _with_pp(rank: int, world: int) -> None:
    from partrain.observe.trace import Tracer
    from partrain.parallel.fsdp import apply_fsdp
    from partrain.parallel.mesh import ParallelDims
    from partrain.parallel.pipeline import apply_pipeline_parallel

    dp, pp = 2, 2
    cfg, model, tokens = _setup(world, dp, pp)
    dims = ParallelDims(pp=pp, dp=dp, tp=1, zero_stage=3, zero_backend="fsdp")
    mesh = dims.build_mesh("cpu")
    coords = dims.coords(rank)
    pipeline = apply_pipeline_parallel(model, mesh["pp"], cfg.parallel, (PER_MICRO, SEQ, 64),
                                       Tracer(False))
    apply_fsdp(pipeline, mesh["dp_cp"], None, 3, None, offload=False)
    mine = tokens[coords["dp"] * MICRO * PER_MICRO:(coords["dp"] + 1) * MICRO * PER_MICRO]
    micro = [(m[:, :-1], m[:, 1:]) for m in mine.split(PER_MICRO)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    with counted() as calls:
        pipeline.run(micro, loss_fn, torch.autocast("cpu", enabled=False))
    units = len(list(pipeline.chunks[0].layers)) + 1  # this stage's blocks and its root
    assert calls == {"all_gather": units, "reduce_scatter": units}, calls
    _check_grads(pipeline, _reference_grads(cfg, tokens), prefix_chunks=True)


@pytest.mark.slow  # 4 processes; the quick pass keeps the two stage rows above
def test_fsdp_under_pp_gathers_and_reduces_once_a_step():
    run_distributed(_with_pp, 4)

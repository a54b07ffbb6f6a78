"""Checkpoints (partrain/checkpoint/state.py) on real gloo process groups, real DCP and real
DeepSpeed, with a tiny model:

- every layout names its state as the single-process model does, and records a tensor-parallel
  shard as a DTensor slice of the full tensor;
- a checkpoint written by one layout after two optimizer steps loads into another with every
  weight, AdamW moment and step equal, bit for bit, to what the writer held (resharding only
  moves bytes);
- DCP really holds both tp shards of a weight (plain tensors under one name would be
  de-duplicated as replicas and the checkpoint would silently hold half of it).

Each layout's model and optimizer are built in the order partrain.train builds them, and trained
with its own train_step. A one-process layout without ZeRO runs in the test process itself.
"""

import gc
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from partrain.checkpoint.state import build_state, load_optimizer, load_weights, named_parameters
from partrain.config import World, compose_config, resolve_and_validate
from partrain.data import rank_micro_batches
from partrain.mesh import ParallelDims
from partrain.models import build_model
from partrain.parallel.data import apply_data_parallel
from partrain.parallel.pipeline import apply_pipeline_parallel
from partrain.parallel.tensor import apply_tensor_parallel
from partrain.parallel.zero import apply_zero, deepspeed_config
from partrain.trace import Tracer
from partrain.train import build_optimizer, loss_function, param_groups, train_step
from tests.distributed.helpers import run_distributed
from tests.integration.conftest import deepspeed_ops  # noqa: F401  (a fixture: DeepSpeed's CPU ops)

MODEL = ["model.n_layers=4", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=64", "model.max_seq_len=16", "model.init_std=0.05"]
# Four sequences of 16 tokens per step, one per micro-batch: micro_batches = 4 / dp, enough to
# fill a pipeline of 2 (and whole groups of pp for the interleaved schedule).
BATCH = ["train.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=1",
         "train.micro_batches=null", "optim.warmup_steps=0"]
STEPS = 2
MOMENTS = ("exp_avg", "exp_avg_sq")

LAYOUTS = {
    "single": {},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "pp2-interleaved": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
    "dp2": {"dp": 2},
    "tp2-pp2": {"tp": 2, "pp": 2},
    "zero1": {"dp": 2, "zero_stage": 1},
    "zero2": {"dp": 2, "zero_stage": 2},
    "zero3": {"dp": 2, "zero_stage": 3},
}


def _uses_deepspeed(layout: str) -> bool:
    return LAYOUTS[layout].get("zero_stage", 0) > 0


@cache
def config(layout: str):
    """The validated config of a layout (composed once, here, and handed to the ranks)."""
    p = {"dp": 1, "tp": 1, "pp": 1, **LAYOUTS[layout]}
    cfg = compose_config(None, [*MODEL, *BATCH, "launcher.device=cpu",
                                *(f"parallel.{key}={value}" for key, value in p.items())])
    resolve_and_validate(cfg, World(nnodes=1, nproc_per_node=p["pp"] * p["dp"] * p["tp"]))
    return cfg


def world_size(cfg) -> int:
    return cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.tp


def run_layout(cfg, body, *args) -> None:
    """body(rank, world_size, cfg, *args) on the layout's ranks: in this process when it is one
    process without DeepSpeed (no process group at all), else on spawned gloo processes."""
    if world_size(cfg) == 1 and not cfg.parallel.zero_stage:
        body(0, 1, cfg, *args)
    else:
        run_distributed(body, world_size(cfg), cfg, *args)


# ---------------------------------------------------------------------------------------------
# One rank's model and optimizer, trained and read back, as partrain.train does it.

@dataclass
class Rank:
    dims: ParallelDims
    mesh: object
    tp_mesh: object
    model: torch.nn.Module
    optimizer: object


def setup(cfg, load: Path | None = None) -> Rank:
    """build_model -> TP -> PP -> load_weights -> ZeRO, or DDP and AdamW -> load_optimizer."""
    p, t = cfg.parallel, cfg.train
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, zero_stage=p.zero_stage)
    mesh = dims.build_mesh("cpu") if dist.is_initialized() else None
    model = build_model(cfg.model, t.seed)
    if dims.tp_enabled:
        model = apply_tensor_parallel(model, mesh["tp"], p)
    if dims.pp_enabled:
        model = apply_pipeline_parallel(model, mesh["pp"], p,
                                        (t.micro_batch_size, t.seq_len, cfg.model.dim))
    tp_mesh = mesh["tp"] if dims.tp_enabled else None
    if load:
        load_weights(model, load, tp_mesh)
    if dims.zero_enabled:
        rank = str(dist.get_rank())
        os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(dims.world_size))
        model, optimizer = apply_zero(model, mesh, dims, deepspeed_config(cfg),
                                      param_groups(model, cfg.optim))
    else:
        if dims.dp_enabled and not dims.pp_enabled:
            model = apply_data_parallel(model, mesh["dp"])
        optimizer = build_optimizer(model, cfg.optim)
    if load:
        load_optimizer(model, optimizer, load, tp_mesh, dims.zero_enabled)
    return Rank(dims, mesh, tp_mesh, model, optimizer)


def train(r: Rank, cfg, steps: int) -> None:
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (4096,),
                           generator=torch.Generator().manual_seed(7)).numpy()
    dp_rank = r.dims.coords(dist.get_rank())["dp"] if dist.is_initialized() else 0
    loss_fn = loss_function(r.dims, r.mesh)
    for step in range(1, steps + 1):
        micro = rank_micro_batches(tokens, step, global_batch_size=t.global_batch_size,
                                   micro_batch_size=t.micro_batch_size, dp=r.dims.dp,
                                   dp_rank=dp_rank, seq_len=t.seq_len, seed=t.seed)
        train_step(r.model, r.optimizer, micro, loss_fn, r.dims, r.mesh, torch.device("cpu"),
                   torch.autocast("cpu", enabled=False), cfg.optim.grad_clip, False, Tracer(False))


def _gather_tp(local: torch.Tensor, dim: int, r: Rank) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(r.dims.tp)]
    dist.all_gather(parts, local.contiguous(), group=r.tp_mesh.get_group())
    return torch.cat(parts, dim=dim)


def full_state(r: Rank) -> dict[str, torch.Tensor]:
    """{"<name>.weight|exp_avg|exp_avg_sq|step": full tensor} of every parameter, read from the
    live model and optimizer (not through build_state), merged over ranks; ranks that hold the
    same tensor must agree on it exactly. Collective."""
    zero = r.dims.zero_enabled
    if zero:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        inner = r.optimizer.optimizer.state
        steps = {float(s["step"]) for s in inner.values() if "step" in s}
        assert len(steps) == 1, f"DeepSpeed's flat partitions disagree on the step: {steps}"
        zero_step = steps.pop()
    mine = {}
    for name, param in named_parameters(r.model).items():
        if zero:
            shape = getattr(param, "ds_shape", None) or param.shape
            tensors = {"weight": safe_get_full_fp32_param(param)}
            for key in MOMENTS:
                tensors[key] = safe_get_full_optimizer_state(param, key)
                assert tensors[key] is not None, f"{name}: DeepSpeed holds no {key}"
            tensors = {key: value.reshape(shape) for key, value in tensors.items()}
            step = zero_step
        else:
            opt = r.optimizer.state.get(param)
            assert opt, f"{name}: the optimizer holds no state"
            tensors = {"weight": param.detach(), **{key: opt[key] for key in MOMENTS}}
            step = float(opt["step"])
        dim = getattr(param, "tp_shard_dim", None)
        if dim is not None and r.dims.tp_enabled:
            tensors = {key: _gather_tp(value, dim, r) for key, value in tensors.items()}
        mine.update({f"{name}.{key}": value.detach().clone() for key, value in tensors.items()})
        mine[f"{name}.step"] = torch.tensor(step, dtype=torch.float64)
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {}
    for rank, held in enumerate(every):
        for key, value in held.items():
            if key in merged:
                assert torch.equal(merged[key], value), f"{key}: rank {rank} holds another value"
            merged[key] = value
    return merged


# ---------------------------------------------------------------------------------------------
# 1. Canonical names and DTensor shards, for every layout.

def _names_body(rank, world_size, cfg):
    r = setup(cfg)
    state = build_state(r.model, r.optimizer, r.tp_mesh, r.dims.zero_enabled)
    reference = dict(build_model(cfg.model, cfg.train.seed).named_parameters())
    params = named_parameters(r.model)
    assert set(state) == {key for name in params for key in (
        f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq",
        f"optim.{name}.step")}
    for name, param in params.items():
        full = reference[name]
        dim = getattr(param, "tp_shard_dim", None) if r.dims.tp_enabled else None
        for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
            value = state[key]
            assert value.shape == full.shape, f"{key}: {tuple(value.shape)} != {tuple(full.shape)}"
            if dim is None:
                assert not isinstance(value, DTensor), f"{key}: a replicated tensor as a DTensor"
            else:
                assert isinstance(value, DTensor), f"{key}: a tp shard saved as a plain tensor"
                assert value.placements == (Shard(dim),) and value.device_mesh == r.tp_mesh, key
        step = state[f"optim.{name}.step"]
        assert step.shape == () and step.dtype == torch.float64, name
        weight = state[f"model.{name}"]
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        # The weights are still those of the seed: each shard sits at its own offset.
        assert torch.equal(weight, full.detach()), f"model.{name} differs from the full model's"

    every = [None] * world_size
    dist.all_gather_object(every, (r.dims.coords(rank), sorted(params)))
    assert set().union(*(names for _, names in every)) == set(reference)
    # Pipeline stages hold disjoint names (a name on two stages would be de-duplicated by DCP).
    for coords, names in every:
        for other, other_names in every:
            if other["pp"] != coords["pp"]:
                assert not set(names) & set(other_names), (coords, other)


@pytest.mark.parametrize("layout", [
    "tp2", "pp2", "pp2-interleaved", "dp2",
    pytest.param("tp2-pp2", marks=pytest.mark.slow),
    pytest.param("zero1", marks=pytest.mark.slow),
    pytest.param("zero2", marks=pytest.mark.slow),
    pytest.param("zero3", marks=pytest.mark.slow)])
def test_state_has_the_single_process_names(layout, request):
    if _uses_deepspeed(layout):
        request.getfixturevalue("deepspeed_ops")
    run_distributed(_names_body, world_size(config(layout)), config(layout))


# ---------------------------------------------------------------------------------------------
# 2. Save in one layout, load into another.

def _save_body(rank, world_size, cfg, out):
    r = setup(cfg)
    train(r, cfg, STEPS)
    dcp.save(build_state(r.model, r.optimizer, r.tp_mesh, r.dims.zero_enabled),
             checkpoint_id=out / "ckpt")
    held = full_state(r)
    if rank == 0:
        # The state really moved: two steps taken, moments and weights away from their start.
        initial = dict(build_model(cfg.model, cfg.train.seed).named_parameters())
        for name, weight in initial.items():
            assert held[f"{name}.step"].item() == STEPS, name
            assert not torch.equal(held[f"{name}.weight"], weight.detach()), name
            assert held[f"{name}.exp_avg_sq"].abs().sum() > 0, name
        torch.save(held, out / "held.pt")


def _load_body(rank, world_size, cfg, source):
    r = setup(cfg, load=source / "ckpt")
    got, want = full_state(r), torch.load(source / "held.pt")
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for key, value in want.items():
        # Loading only moves bytes, whatever the layouts: exactly equal.
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), (
            f"{key}: max abs difference {(got[key] - value).abs().max().item():.3g}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(layout): the directory of a checkpoint that layout wrote after STEPS steps (ckpt/)
    and of the full state it held then (held.pt); each layout trains and saves once."""
    done = {}

    def save(layout: str) -> Path:
        if layout not in done:
            out = tmp_path_factory.mktemp(layout)
            run_layout(config(layout), _save_body, out)
            done[layout] = out
        return done[layout]

    yield save
    gc.collect()


@pytest.mark.parametrize("source, target", [
    ("tp2", "single"),
    ("single", "tp2"),
    ("tp2", "tp2"),
    ("pp2-interleaved", "pp2"),
    pytest.param("tp2-pp2", "dp2", marks=pytest.mark.slow),
    pytest.param("zero2", "single", marks=pytest.mark.slow),
    pytest.param("single", "zero3", marks=pytest.mark.slow),
    pytest.param("zero1", "zero3", marks=pytest.mark.slow),
    pytest.param("zero3", "pp2", marks=pytest.mark.slow)])
def test_round_trip_reshards(source, target, saved, request):
    if _uses_deepspeed(source) or _uses_deepspeed(target):
        request.getfixturevalue("deepspeed_ops")
    run_layout(config(target), _load_body, saved(source))


# ---------------------------------------------------------------------------------------------
# 3. The de-duplication trap: both tp shards are in the checkpoint, each at its offset.

def test_checkpoint_holds_every_tp_shard(saved):
    metadata = dcp.FileSystemReader(saved("tp2") / "ckpt").read_metadata().state_dict_metadata

    def chunks(key):
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata[key].chunks)

    # A column-parallel weight (32 x 32, output rows split), a row-parallel one (input columns
    # split), the vocabulary-parallel embedding (64 x 32) and its moments: two halves each.
    assert chunks("model.layers.0.attention.wq.weight") == [((0, 0), (16, 32)), ((16, 0), (16, 32))]
    assert chunks("model.layers.0.attention.wo.weight") == [((0, 0), (32, 16)), ((0, 16), (32, 16))]
    assert chunks("optim.tok_embeddings.weight.exp_avg") == [((0, 0), (32, 32)), ((32, 0), (32, 32))]
    # A norm gain is the same on both tp ranks: written once.
    assert chunks("model.norm.weight") == [((0,), (32,))]
    # Every tensor is covered whole, by chunks that do not overlap.
    for key, meta in metadata.items():
        covered = torch.zeros(tuple(meta.size), dtype=torch.int32)
        for chunk in meta.chunks:
            covered[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] += 1
        assert bool((covered == 1).all()), f"{key}: chunks {chunks(key)} of {tuple(meta.size)}"

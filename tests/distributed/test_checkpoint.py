"""Checkpoints (partrain/checkpoint/state.py) on real gloo process groups, real DCP and real
DeepSpeed, with a tiny model:

- every layout names its state as the single-process model does, and saves a tensor-parallel
  shard as a DTensor slice of the full tensor;
- a checkpoint one layout wrote after two optimizer steps loads into another with every weight,
  AdamW moment and step equal, bit for bit, to what the writer held (resharding only moves
  bytes), and one more step from there lands where the writer's own next step did;
- DCP really holds both tp shards of a weight (plain tensors under one name would be
  de-duplicated as replicas, and the checkpoint would silently hold half of each).

Starting ranks costs far more than anything they do here, so the ranks of one group (a process
count, with or without DeepSpeed) build, train, save and load every layout of that group in one
run and write what they found under a directory; the tests judge those files, in this process.
The one-process layout without ZeRO runs here too, without a process group. Each layout is built
by partrain's own parallelize and trained with its own train_step.
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
from torch.distributed.tensor import DTensor

from partrain.checkpoint.state import (
    build_state,
    load_optimizer,
    load_weights,
    named_parameters,
)
from partrain.config.compose import compose_config
from partrain.config.resolve import World
from partrain.config.validate import resolve_and_validate
from partrain.data.batches import rank_micro_batches
from partrain.models.llama import build_model
from partrain.observe.trace import Tracer
from partrain.parallel.mesh import ParallelDims
from partrain.parallel.parallelize import parallelize
from partrain.train.optim import build_optimizer, param_groups
from partrain.train.step import loss_function, train_step
from tests.distributed.helpers import run_distributed

# A one-process layout saves and loads without a process group, as DCP allows (and says).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MODEL = ["model.n_layers=4", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
         "model.vocab_size=64", "model.max_seq_len=16", "model.init_std=0.05"]
# Four sequences of 16 tokens per step, one per micro-batch: micro_batches = 4 / dp, enough to
# fill a pipeline of 2 (in whole groups of pp for the interleaved schedule).
BATCH = ["train.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=1",
         "train.micro_batches=null", "optim.warmup_steps=0"]
STEPS = 2
# One step after loading against the writer's own next step, across layouts (float32 sums in
# another order: the gradients agree to ~1e-7 relative).
NEXT_RTOL, NEXT_ATOL = 1e-5, 1e-6
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

# What each group's ranks do, in order: build every layout (its fresh state recorded for the
# names test) and train and save those in `saves`; then load (source, target) pairs. A pair
# whose target is "single" loads here, after its source's group has run.
GROUPS = {
    "two": {"world": 2, "layouts": ["tp2", "pp2", "pp2-interleaved", "dp2"],
            "saves": ["tp2", "pp2-interleaved"],
            "loads": [("single", "tp2"), ("tp2", "tp2"), ("pp2-interleaved", "pp2"),
                      ("pp2-interleaved", "dp2")]},
    "four": {"world": 4, "layouts": ["tp2-pp2"], "saves": ["tp2-pp2"],
             "loads": [("single", "tp2-pp2")]},
    "zero": {"world": 2, "layouts": ["zero1", "zero2", "zero3"],
             "saves": ["zero1", "zero2", "zero3"],
             "loads": [("single", "zero3"), ("zero1", "zero3"), ("zero3", "zero1"),
                       ("zero2", "zero2"), ("zero3", "pp2")]},
}
SLOW_GROUPS = {"four", "zero"}
GROUP_OF_LAYOUT = {layout: g for g, spec in GROUPS.items() for layout in spec["layouts"]}


def _group_of_pair(source: str, target: str) -> str:
    if target == "single":
        return GROUP_OF_LAYOUT[source]
    return next(g for g, spec in GROUPS.items() if (source, target) in spec["loads"])


def _param(group: str, *values):
    marks = [pytest.mark.slow] if group in SLOW_GROUPS else []
    return pytest.param(*values, marks=marks, id="-to-".join(values))


@cache
def config(layout: str):
    """The validated config of a layout (composed once, here, and handed to the ranks)."""
    p = {"dp": 1, "tp": 1, "pp": 1, **LAYOUTS[layout]}
    cfg = compose_config(None, [*MODEL, *BATCH, "launcher.device=cpu",
                                *(f"parallel.{key}={value}" for key, value in p.items())])
    resolve_and_validate(cfg, World(nnodes=1, nproc_per_node=p["pp"] * p["dp"] * p["tp"]))
    return cfg


# ---------------------------------------------------------------------------------------------
# One rank's model and optimizer, built, trained and read back as a worker does it.

@dataclass
class Rank:
    dims: ParallelDims
    mesh: object
    tp_mesh: object
    backend: object  # the data-parallel backend: the wrapped model and its optimizer

    @property
    def model(self):
        return self.backend.model

    @property
    def optimizer(self):
        return self.backend.optimizer


def setup(cfg, load: Path | None = None) -> Rank:
    """partrain.parallel.parallelize, with the weights of `load` (then its optimizer state)."""
    p, t = cfg.parallel, cfg.train
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, zero_stage=p.zero_stage)
    mesh = dims.build_mesh("cpu") if dist.is_initialized() else None
    tp_mesh = mesh["tp"] if dims.tp_enabled else None
    if dims.zero_enabled:
        # What torch's elastic agent sets for a worker, and DeepSpeed asks for.
        rank = str(dist.get_rank())
        os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(dims.world_size))
    built = parallelize(build_model(cfg.model, t.seed), cfg, dims, mesh, None, Tracer(False),
                        load_weights=lambda model: load and load_weights(model, load, tp_mesh),
                        param_groups=lambda model: param_groups(model, cfg.optim),
                        build_optimizer=lambda model: build_optimizer(model, cfg.optim))
    r = Rank(dims, mesh, tp_mesh, built.backend)
    if load:
        load_optimizer(r.model, r.optimizer, load, tp_mesh, dims.zero_enabled)
    return r


def train(r: Rank, cfg, steps) -> None:
    """Optimizer steps `steps` (each its own batches), with train_step as the loop runs it."""
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (4096,),
                           generator=torch.Generator().manual_seed(7)).numpy()
    dp_rank = r.dims.coords(dist.get_rank())["dp"] if dist.is_initialized() else 0
    loss_fn = loss_function(r.dims, r.mesh)
    for step in steps:
        micro = rank_micro_batches(tokens, step, global_batch_size=t.global_batch_size,
                                   micro_batch_size=t.micro_batch_size, dp=r.dims.dp,
                                   dp_rank=dp_rank, seq_len=t.seq_len, seed=t.seed)
        train_step(r.backend, micro, loss_fn, r.dims, r.mesh, torch.device("cpu"),
                   torch.autocast("cpu", enabled=False), Tracer(False))


def _gather_tp(local: torch.Tensor, dim: int, r: Rank) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(r.dims.tp)]
    dist.all_gather(parts, local.contiguous(), group=r.tp_mesh.get_group())
    return torch.cat(parts, dim=dim)


def _zero_tensors(r: Rank, name: str, param) -> dict[str, torch.Tensor]:
    """A parameter's fp32 master weight and moments from DeepSpeed (collective over dp); the
    weight the engine computes with must be that master copy."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    shape = getattr(param, "ds_shape", None) or param.shape
    tensors = {"weight": safe_get_full_fp32_param(param)}
    for key in MOMENTS:
        tensors[key] = safe_get_full_optimizer_state(param, key)
        assert tensors[key] is not None, f"{name}: DeepSpeed holds no {key}"
    tensors = {key: value.reshape(shape) for key, value in tensors.items()}
    with deepspeed.zero.GatheredParameters([param], enabled=r.dims.zero_stage == 3):
        working = param.detach().clone()
    assert torch.equal(working, tensors["weight"]), f"{name}: working weight != fp32 master"
    return tensors


def full_state(r: Rank) -> dict[str, torch.Tensor]:
    """Every parameter's weight, moments and step as full tensors, under the checkpoint's keys
    (model.<name>, optim.<name>.exp_avg, ...) but read from the live model and optimizer (not
    through build_state) and merged over ranks; ranks holding the same tensor must agree on it
    exactly. Collective."""
    if r.dims.zero_enabled:
        steps = {float(s["step"]) for s in r.optimizer.optimizer.state.values() if "step" in s}
        assert len(steps) == 1, f"DeepSpeed's flat partitions disagree on the step: {steps}"
        zero_step = steps.pop()
    mine = {}
    for name, param in named_parameters(r.model).items():
        if r.dims.zero_enabled:
            tensors, step = _zero_tensors(r, name, param), zero_step
        else:
            opt = r.optimizer.state.get(param)
            assert opt, f"{name}: the optimizer holds no state"
            tensors = {"weight": param.detach(), **{key: opt[key] for key in MOMENTS}}
            step = float(opt["step"])
        dim = getattr(param, "tp_shard_dim", None)
        if dim is not None and r.dims.tp_enabled:
            tensors = {key: _gather_tp(value, dim, r) for key, value in tensors.items()}
        mine[f"model.{name}"] = tensors.pop("weight").detach().clone()
        mine.update({f"optim.{name}.{key}": value.detach().clone()
                     for key, value in tensors.items()})
        mine[f"optim.{name}.step"] = torch.tensor(step, dtype=torch.float64)
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


def describe(state: dict) -> dict:
    """What build_state made, as plain data: each entry's kind, shapes and placements, and the
    full value of the weights (gathered over tp: collective)."""
    facts = {}
    for key, value in state.items():
        fact = {"dtensor": isinstance(value, DTensor), "shape": tuple(value.shape),
                "dtype": str(value.dtype)}
        if isinstance(value, DTensor):
            fact.update(local_shape=tuple(value.to_local().shape),
                        mesh=tuple(value.device_mesh.mesh_dim_names),
                        placements=tuple((type(p).__name__, getattr(p, "dim", None))
                                         for p in value.placements))
        if key.startswith("model."):
            fact["value"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
        facts[key] = fact
    return facts


# ---------------------------------------------------------------------------------------------
# What the ranks of a group (and this process, for "single") do, writing under `root`:
#   names/<layout>/rank<N>.pt    describe(build_state) of the fresh model, with mesh coordinates
#   saved/<layout>/ckpt/         the DCP checkpoint after STEPS steps
#   saved/<layout>/held.pt       full_state then, and next.pt after one more step
#   loaded/<source>-to-<target>.pt   full_state of target after loading source's checkpoint,
#                                    and .next.pt after one more step

def _build_and_save(cfg, layout: str, root: Path, save: bool) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    r = setup(cfg)
    facts = describe(build_state(r.model, r.optimizer, r.tp_mesh, r.dims.zero_enabled))
    (root / "names" / layout).mkdir(parents=True, exist_ok=True)
    torch.save({"coords": r.dims.coords(rank), "facts": facts},
               root / "names" / layout / f"rank{rank}.pt")
    if save:
        train(r, cfg, range(1, STEPS + 1))
        out = root / "saved" / layout
        dcp.save(build_state(r.model, r.optimizer, r.tp_mesh, r.dims.zero_enabled),
                 checkpoint_id=out / "ckpt")
        held = full_state(r)
        train(r, cfg, [STEPS + 1])
        after = full_state(r)
        if rank == 0:
            torch.save(held, out / "held.pt")
            torch.save(after, out / "next.pt")


def _load(cfg, source: str, target: str, root: Path) -> None:
    r = setup(cfg, load=root / "saved" / source / "ckpt")
    held = full_state(r)
    train(r, cfg, [STEPS + 1])
    after = full_state(r)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (root / "loaded").mkdir(exist_ok=True)
        torch.save(held, root / "loaded" / f"{source}-to-{target}.pt")
        torch.save(after, root / "loaded" / f"{source}-to-{target}.next.pt")


def _group_body(rank, world_size, spec, configs, root):
    try:
        for layout in spec["layouts"]:
            _build_and_save(configs[layout], layout, root, save=layout in spec["saves"])
            gc.collect()
        for source, target in spec["loads"]:
            _load(configs[target], source, target, root)
            gc.collect()
    except dcp.CheckpointException as e:
        # A BaseException, which torch's spawn wrapper would not hand back to the test.
        raise RuntimeError(str(e)) from None


class Runs:
    """The groups' files under one directory. Each group runs once, when a test first needs it,
    with the one-process layout saved before it and the pairs that load into that layout loaded
    after it, here. Ranks that fail leave what they wrote before: a test whose files are there
    judges them; one whose files are missing fails with the error that stopped them."""

    def __init__(self, root: Path):
        self.root, self.done, self.errors = root, set(), {}

    def _once(self, key: str, work) -> None:
        if key not in self.done:
            self.done.add(key)
            try:
                work()
            except (Exception, dcp.CheckpointException) as e:  # for the tests that miss its files
                self.errors[key] = f"{type(e).__name__}: {e}"

    def _run_group(self, group: str) -> None:
        spec = GROUPS[group]
        configs = {layout: config(layout) for layout in LAYOUTS}
        run_distributed(_group_body, spec["world"], spec, configs, self.root)

    def path(self, group: str, relative: str) -> Path:
        """root / relative, once `group` has run."""
        single = config("single")
        self._once("single", lambda: _build_and_save(single, "single", self.root, save=True))
        self._once(group, lambda: self._run_group(group))
        pairs = [f"{s}-to-single" for s, t in ROUND_TRIPS if t == "single"
                 and GROUP_OF_LAYOUT[s] == group]
        for pair in pairs:
            source = pair.removesuffix("-to-single")
            self._once(pair, lambda: _load(single, source, "single", self.root))
        path = self.root / relative
        if not path.exists():
            errors = [f"{key}: {self.errors[key]}" for key in ("single", group, *pairs)
                      if key in self.errors]
            pytest.fail(f"{relative} was not written. " + ("\n\n".join(errors) or
                        "No error was raised."), pytrace=False)
        return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    yield Runs(tmp_path_factory.mktemp("checkpoints"))
    gc.collect()


# ---------------------------------------------------------------------------------------------
# 1. Canonical names and DTensor shards, for every layout.

def _expected_shard_dim(name: str, full: torch.Tensor) -> int | None:
    """Under tp every matrix of this model is split (row-parallel wo/w2 along their input, the
    rest along their output); the norm gains are replicated."""
    if full.dim() < 2:
        return None
    return 1 if name.endswith(("wo.weight", "w2.weight")) else 0


def _split_key(key: str) -> tuple[str, str]:
    """'model.<name>' -> (name, 'weight'); 'optim.<name>.<what>' -> (name, what)."""
    kind, rest = key.split(".", 1)
    if kind == "model":
        return rest, "weight"
    assert kind == "optim", key
    name, what = rest.rsplit(".", 1)
    return name, what


@pytest.mark.parametrize("layout", [_param(g, layout) for layout, g in GROUP_OF_LAYOUT.items()])
def test_state_has_the_single_process_names(layout, runs):
    cfg = config(layout)
    world = cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.tp
    ranks = [torch.load(runs.path(GROUP_OF_LAYOUT[layout], f"names/{layout}/rank{rank}.pt"))
             for rank in range(world)]
    reference = dict(build_model(cfg.model, cfg.train.seed).named_parameters())

    # Each rank's own generator states (dropout), under its rank: restored on the same layout.
    for rank, r in enumerate(ranks):
        rng = {key for key in r["facts"] if key.startswith("rng.")}
        assert rng == {f"rng.rank{rank}.cpu"}, (rank, sorted(rng))
        for key in rng:
            del r["facts"][key]
    held = [set(r["facts"]) for r in ranks]
    union = set().union(*held)
    assert {k for k in union if k.startswith("model.")} == {f"model.{n}" for n in reference}
    assert union == {key for name in reference for key in (
        f"model.{name}", *(f"optim.{name}.{m}" for m in MOMENTS), f"optim.{name}.step")}

    tp = cfg.parallel.tp
    for r in ranks:
        for key, fact in r["facts"].items():
            name, what = _split_key(key)
            where = f"{key} on rank {r['coords']}"
            if what == "step":
                assert fact["shape"] == () and fact["dtype"] == "torch.float64", where
                assert not fact["dtensor"], where
                continue
            full = reference[name]
            assert fact["shape"] == tuple(full.shape), f"{where}: shape {fact['shape']}"
            assert fact["dtype"] == "torch.float32", where
            dim = _expected_shard_dim(name, full) if tp > 1 else None
            if dim is None:
                assert not fact["dtensor"], f"{where}: a replicated tensor saved as a DTensor"
            else:
                assert fact["dtensor"], f"{where}: a tp shard saved as a plain tensor"
                assert fact["mesh"] == ("tp",) and fact["placements"] == (("Shard", dim),), where
                local = list(full.shape)
                local[dim] //= tp
                assert fact["local_shape"] == tuple(local), where
            if what == "weight":
                # The fresh weights are the seed's: every shard was recorded at its own offset.
                assert torch.equal(fact["value"], full.detach()), f"{where}: not the full weight"

    # Pipeline stages hold disjoint names: a name on two stages would be de-duplicated by DCP.
    for a, keys_a in zip(ranks, held):
        for b, keys_b in zip(ranks, held):
            if a["coords"]["pp"] != b["coords"]["pp"]:
                assert not keys_a & keys_b, (a["coords"], b["coords"], sorted(keys_a & keys_b)[:3])


# ---------------------------------------------------------------------------------------------
# 2. Save in one layout, load into another.

ROUND_TRIPS = [
    ("tp2", "single"), ("single", "tp2"), ("tp2", "tp2"), ("pp2-interleaved", "pp2"),
    ("pp2-interleaved", "dp2"),
    ("tp2-pp2", "single"), ("single", "tp2-pp2"),
    ("zero2", "single"), ("single", "zero3"), ("zero1", "zero3"), ("zero3", "zero1"),
    ("zero2", "zero2"), ("zero3", "pp2"),
]


@pytest.mark.parametrize("source, target", [
    _param(_group_of_pair(source, target), source, target) for source, target in ROUND_TRIPS])
def test_round_trip_reshards(source, target, runs):
    group = _group_of_pair(source, target)

    def read(relative):
        return torch.load(runs.path(group, relative))

    want, got = read(f"saved/{source}/held.pt"), read(f"loaded/{source}-to-{target}.pt")
    # The writer's state really moved: two steps, moments filled, weights away from the seed's.
    initial = dict(build_model(config(source).model, config(source).train.seed).named_parameters())
    for name, weight in initial.items():
        assert want[f"optim.{name}.step"].item() == STEPS, name
        assert not torch.equal(want[f"model.{name}"], weight.detach()), name
        assert want[f"optim.{name}.exp_avg_sq"].abs().sum() > 0, name
    # Loading moves bytes, in whatever layout: exactly equal.
    _assert_same(got, want, "loaded")
    # And the optimizer really steps from what it loaded: one more step lands where the writer's
    # did (within rounding across layouts, which sum in other orders).
    got = read(f"loaded/{source}-to-{target}.next.pt")
    want = read(f"saved/{source}/next.pt")
    _assert_same(got, want, "one step after loading", exact=source == target)


def _assert_same(got: dict, want: dict, what: str, exact: bool = True) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    for key, value in want.items():
        assert got[key].shape == value.shape, f"{what}: {key}"
        error = (got[key] - value).abs().max().item()
        same = torch.equal(got[key], value) if exact else torch.allclose(
            got[key], value, rtol=NEXT_RTOL, atol=NEXT_ATOL)
        assert same, f"{what}: {key}: max abs difference {error:.3g}"


# ---------------------------------------------------------------------------------------------
# 3. The de-duplication trap: both tp shards are in the checkpoint, each at its offset.

def test_checkpoint_holds_every_tp_shard(runs):
    path = runs.path("two", "saved/tp2/ckpt/.metadata").parent
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata

    def chunks(key):
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata[key].chunks)

    # A column-parallel weight (32 x 32, output rows split), a row-parallel one (input columns
    # split) and a moment of the vocabulary-parallel embedding (64 x 32): two halves each.
    assert chunks("model.layers.0.attention.wq.weight") == [((0, 0), (16, 32)), ((16, 0), (16, 32))]
    assert chunks("model.layers.0.attention.wo.weight") == [((0, 0), (32, 16)), ((0, 16), (32, 16))]
    assert chunks("optim.tok_embeddings.weight.exp_avg") == [((0, 0), (32, 32)),
                                                              ((32, 0), (32, 32))]
    # A norm gain is the same on both tp ranks: written once.
    assert chunks("model.norm.weight") == [((0,), (32,))]
    # Every tensor is covered whole, by chunks that do not overlap.
    for key, meta in metadata.items():
        covered = torch.zeros(tuple(meta.size), dtype=torch.int32)
        for chunk in meta.chunks:
            covered[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] += 1
        assert bool((covered == 1).all()), f"{key}: chunks {chunks(key)} of {tuple(meta.size)}"

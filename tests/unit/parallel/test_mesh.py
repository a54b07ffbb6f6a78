"""ParallelDims: the (pp, dp, cp, tp) layout as arithmetic, checked against docs/design.md's formula
global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, and against
`partrain plan --json`."""

import itertools
import json

import pytest

from partrain.parallel.mesh import DIM_NAMES, ParallelDims

# (pp, dp, cp, tp)
SHAPES = [*itertools.product((1, 2), repeat=4), (2, 4, 1, 2), (4, 2, 1, 4), (1, 8, 1, 1),
          (2, 2, 1, 8), (1, 2, 4, 2), (2, 1, 4, 1)]


def design_rank(pp_rank, dp_rank, cp_rank, tp_rank, dims):
    return ((pp_rank * dims.dp + dp_rank) * dims.cp + cp_rank) * dims.tp + tp_rank


def all_coords(dims):
    return itertools.product(range(dims.pp), range(dims.dp), range(dims.cp), range(dims.tp))


@pytest.fixture(params=SHAPES, ids=lambda s: "pp{}-dp{}-cp{}-tp{}".format(*s))
def dims(request):
    pp, dp, cp, tp = request.param
    return ParallelDims(pp=pp, dp=dp, tp=tp, cp=cp)


def test_shape_and_flags(dims):
    assert dims.shape == (dims.pp, dims.dp, dims.cp, dims.tp)
    assert dims.world_size == dims.pp * dims.dp * dims.cp * dims.tp
    assert (dims.pp_enabled, dims.dp_enabled, dims.cp_enabled, dims.tp_enabled) == (
        dims.pp > 1, dims.dp > 1, dims.cp > 1, dims.tp > 1)
    assert dims.dp_cp == dims.dp * dims.cp


def test_rank_matches_design_formula(dims):
    seen = set()
    for pp_rank, dp_rank, cp_rank, tp_rank in all_coords(dims):
        rank = dims.rank(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)
        assert rank == design_rank(pp_rank, dp_rank, cp_rank, tp_rank, dims)
        seen.add(rank)
    assert seen == set(range(dims.world_size))  # a bijection onto 0..world-1


def test_coords_and_rank_are_inverses(dims):
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert set(coords) == set(DIM_NAMES)
        assert all(0 <= coords[d] < n for d, n in zip(DIM_NAMES, dims.shape))
        assert dims.rank(**coords) == rank
    for pp_rank, dp_rank, cp_rank, tp_rank in all_coords(dims):
        rank = dims.rank(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)
        assert dims.coords(rank) == {"pp": pp_rank, "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}


@pytest.mark.parametrize("dim", DIM_NAMES)
def test_groups_partition_the_ranks(dims, dim):
    groups = dims.groups(dim)
    size = dict(zip(DIM_NAMES, dims.shape))[dim]
    assert len(groups) == dims.world_size // size
    assert all(len(g) == size for g in groups)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(dims.world_size))  # every rank exactly once


@pytest.mark.parametrize("dim", DIM_NAMES)
def test_group_members_differ_only_in_their_coordinate(dims, dim):
    others = [d for d in DIM_NAMES if d != dim]
    for group in dims.groups(dim):
        coords = [dims.coords(r) for r in group]
        for other in others:
            assert len({c[other] for c in coords}) == 1, (dim, group)
        # Ordered by the group's own coordinate: position i is that dim's rank i.
        assert [c[dim] for c in coords] == list(range(len(group)))


def test_tp_groups_are_consecutive_ranks(dims):
    for group in dims.groups("tp"):
        assert group == list(range(group[0], group[0] + dims.tp))
        assert group[0] % dims.tp == 0


def test_cp_groups_stride_by_tp_and_pp_groups_by_the_rest(dims):
    for group in dims.groups("cp"):
        assert all(b - a == dims.tp for a, b in zip(group, group[1:]))
    for group in dims.groups("pp"):
        assert all(b - a == dims.dp * dims.cp * dims.tp for a, b in zip(group, group[1:]))


@pytest.mark.parametrize("rank", [-1, 8])
def test_coords_outside_world_is_an_error(rank):
    with pytest.raises(ValueError, match="outside world size 8"):
        ParallelDims(pp=2, dp=2, tp=2).coords(rank)


def test_known_layouts():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    dims = ParallelDims(pp=1, dp=2, tp=2, cp=2)
    assert dims.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}


# `partrain plan --json --world-size N` prints the same layout.
PLAN_CASES = [
    # (overrides, world size, expected (pp, dp, cp, tp))
    (["parallel.dp=auto"], 2, (1, 2, 1, 1)),
    (["parallel.dp=auto", "parallel.tp=2", "parallel.pp=2", "launcher.nproc_per_node=4"], 8,
     (2, 2, 1, 2)),
    (["parallel.dp=auto", "parallel.tp=2", "parallel.pp=2", "model.n_layers=8",
      "train.micro_batch_size=2"], 16, (2, 4, 1, 2)),
    (["parallel.dp=auto", "parallel.tp=4", "parallel.pp=4", "model.n_kv_heads=4",
      "launcher.nproc_per_node=8", "train.micro_batch_size=1"], 32, (4, 2, 1, 4)),
    (["parallel.dp=auto", "launcher.nproc_per_node=4", "train.micro_batch_size=1"], 8,
     (1, 8, 1, 1)),
    (["parallel.dp=auto", "parallel.cp=2", "parallel.tp=2", "train.micro_batch_size=1"], 8,
     (1, 2, 2, 2)),
]


@pytest.mark.parametrize("overrides, world_size, shape", PLAN_CASES,
                         ids=[f"ws{w}-pp{s[0]}-dp{s[1]}-cp{s[2]}-tp{s[3]}" for _, w, s in PLAN_CASES])
def test_plan_json_agrees_with_parallel_dims(run_main, overrides, world_size, shape):
    result = run_main("plan", *overrides, "--json", "--world-size", str(world_size))
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    pp, dp, cp, tp = shape
    dims = ParallelDims(pp=pp, dp=dp, tp=tp, cp=cp)
    per_node = plan["nproc_per_node"]
    assert plan["world_size"] == world_size == dims.world_size
    assert plan["nnodes"] * per_node == world_size
    assert tuple(plan["degrees"][d] for d in DIM_NAMES) == shape
    assert [r["rank"] for r in plan["ranks"]] == list(range(world_size))
    for r in plan["ranks"]:
        assert {k: r[k] for k in DIM_NAMES} == dims.coords(r["rank"])
        assert r["node"] == r["rank"] // per_node
        assert r["local_rank"] == r["rank"] % per_node
    assert plan["groups"] == {dim: dims.groups(dim) for dim in DIM_NAMES}
    batch = plan["batch"]
    assert batch["dp"] == shape[1]
    assert batch["global_batch_size"] == (batch["micro_batch_size"] * batch["micro_batches"]
                                          * batch["dp"])
    assert batch["tokens_per_step"] == batch["global_batch_size"] * batch["seq_len"]


def test_plan_places_tp_groups_inside_a_node(run_main):
    result = run_main("plan", "llama-7b-tp4-pp2", "--json")
    plan = json.loads(result.stdout)
    node_of = {r["rank"]: r["node"] for r in plan["ranks"]}
    for group in plan["groups"]["tp"]:
        assert len({node_of[r] for r in group}) == 1
    # A pp stage is dp * tp = 16 ranks: two whole nodes, pp outermost.
    stage_nodes = [{node_of[r["rank"]] for r in plan["ranks"] if r["pp"] == s} for s in (0, 1)]
    assert stage_nodes == [{0, 1}, {2, 3}]

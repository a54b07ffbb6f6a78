"""The DeviceMesh that partrain builds has the groups ParallelDims computes (real gloo groups),
and DeepSpeed's mpu over it reduces over dp x cp."""

import warnings

import pytest
import torch
import torch.distributed as dist

from partrain.parallel.mesh import DIM_NAMES, ParallelDims, flattened
from tests.distributed.helpers import run_distributed


def _dims(shape, **more) -> ParallelDims:
    pp, dp, cp, tp = shape
    return ParallelDims(pp=pp, dp=dp, tp=tp, cp=cp, **more)


def _dp_cp_group(dims: ParallelDims, rank: int) -> list[int]:
    """The ranks that reduce gradients with `rank`: its pp and tp, every dp and cp."""
    c = dims.coords(rank)
    return sorted(dims.rank(c["pp"], d, c["tp"], k) for d in range(dims.dp) for k in range(dims.cp))


def _check_mesh(rank: int, world_size: int, shape: tuple[int, int, int, int]) -> None:
    dims = _dims(shape)
    with warnings.catch_warnings(record=True) as seen:
        # torch >= 2.10 warns on slicing a flattened dim ("dp_cp") from the root mesh and means
        # to stop allowing it: partrain keeps the flattened mesh as _flatten returned it
        warnings.simplefilter("always")
        mesh = dims.build_mesh("cpu")
        dp_cp = flattened(mesh, "dp_cp")
    assert not [w for w in seen if "flattened dim" in str(w.message)], seen
    assert mesh.mesh_dim_names == DIM_NAMES == ("pp", "dp", "cp", "tp")
    coords = dims.coords(rank)
    for dim in (*DIM_NAMES, "dp_cp"):
        group = (dp_cp if dim == "dp_cp" else mesh[dim]).get_group()
        expected = (_dp_cp_group(dims, rank) if dim == "dp_cp" else
                    next(g for g in dims.groups(dim) if rank in g))
        assert dist.get_process_group_ranks(group) == expected, (dim, rank)
        if dim != "dp_cp":
            assert mesh[dim].get_local_rank() == coords[dim]
        # A collective over the group sees exactly its members.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(expected), (dim, rank)


# (pp, dp, cp, tp). The quick pass keeps the 3-D mesh; the others run in the full suite.
@pytest.mark.parametrize("shape", [(2, 2, 1, 2), *(pytest.param(s, marks=pytest.mark.slow) for s in
                                                   ((1, 2, 2, 2), (2, 1, 2, 1)))])
def test_mesh_groups_match_parallel_dims(shape):
    run_distributed(_check_mesh, _dims(shape).world_size, shape)


def _check_zero_mpu(rank: int, world_size: int, shape: tuple[int, int, int, int]) -> None:
    from partrain.parallel.zero import MeshMPU

    dims = _dims(shape, zero_stage=1)
    mpu = MeshMPU(dims.build_mesh("cpu"), dims)
    coords = dims.coords(rank)
    # ZeRO shards over dp x cp; the gradient norm sums over one replica: every (pp, tp) at this
    # dp and cp.
    dp_cp = _dp_cp_group(dims, rank)
    assert dist.get_process_group_ranks(mpu.get_data_parallel_group()) == dp_cp
    assert mpu.get_data_parallel_rank() == dp_cp.index(rank)
    assert mpu.get_data_parallel_world_size() == dims.dp * dims.cp
    replica = [dims.rank(pp, coords["dp"], tp, coords["cp"]) for pp in range(dims.pp)
               for tp in range(dims.tp)]
    assert dist.get_process_group_ranks(mpu.get_model_parallel_group()) == replica
    assert mpu.get_model_parallel_rank() == replica.index(rank)
    assert mpu.get_model_parallel_world_size() == dims.pp * dims.tp
    assert mpu.get_tensor_model_parallel_rank() == coords["tp"]
    assert mpu.get_tensor_model_parallel_src_rank() == dims.rank(coords["pp"], coords["dp"], 0,
                                                                 coords["cp"])


@pytest.mark.slow  # imports DeepSpeed in every rank
@pytest.mark.parametrize("shape", [(2, 2, 1, 2), (1, 2, 2, 2)])
def test_zero_mpu_groups(shape):
    run_distributed(_check_zero_mpu, _dims(shape).world_size, shape)

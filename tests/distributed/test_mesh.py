"""The DeviceMesh that partrain builds has the groups ParallelDims computes (real gloo groups)."""

import pytest
import torch
import torch.distributed as dist

from partrain.mesh import ParallelDims
from tests.distributed.helpers import run_distributed


def _check_mesh(rank: int, world_size: int, shape: tuple[int, int, int]) -> None:
    dims = ParallelDims(*shape)
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    coords = dims.coords(rank)
    for dim in ("pp", "dp", "tp"):
        group = mesh[dim].get_group()
        expected = next(g for g in dims.groups(dim) if rank in g)
        assert dist.get_process_group_ranks(group) == expected, (dim, rank)
        assert mesh[dim].get_local_rank() == coords[dim]
        # A collective over the group sees exactly its members.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(expected), (dim, rank)


# The quick pass keeps the 3-D mesh; the others run in the full suite.
@pytest.mark.parametrize("shape", [(2, 2, 2), *(pytest.param(s, marks=pytest.mark.slow)
                                                for s in ((1, 2, 2), (2, 1, 2), (1, 4, 1)))])
def test_mesh_groups_match_parallel_dims(shape):
    run_distributed(_check_mesh, ParallelDims(*shape).world_size, shape)


def _check_zero_mpu(rank: int, world_size: int, shape: tuple[int, int, int]) -> None:
    from partrain.parallel.zero import MeshMPU

    dims = ParallelDims(*shape, zero_stage=1)
    mpu = MeshMPU(dims.build_mesh("cpu"), dims)
    coords = dims.coords(rank)
    # ZeRO shards over dp; the gradient norm sums over one replica: every (pp, tp) at this dp.
    assert dist.get_process_group_ranks(mpu.get_data_parallel_group()) == next(
        g for g in dims.groups("dp") if rank in g)
    replica = [dims.rank(pp, coords["dp"], tp) for pp in range(dims.pp) for tp in range(dims.tp)]
    assert dist.get_process_group_ranks(mpu.get_model_parallel_group()) == replica
    assert mpu.get_model_parallel_rank() == replica.index(rank)
    assert mpu.get_model_parallel_world_size() == dims.pp * dims.tp
    assert mpu.get_tensor_model_parallel_rank() == coords["tp"]
    assert mpu.get_data_parallel_rank() == coords["dp"]
    assert mpu.get_tensor_model_parallel_src_rank() == dims.rank(coords["pp"], coords["dp"], 0)


@pytest.mark.slow  # imports DeepSpeed in every rank
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 2)])
def test_zero_mpu_groups(shape):
    run_distributed(_check_zero_mpu, ParallelDims(*shape).world_size, shape)

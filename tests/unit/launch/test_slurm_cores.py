"""The cores a node's launcher shares out among its ranks on CPU (OpenMP threads per worker):
those its task may run on, not the machine's. Under SLURM that is the CPU affinity srun's binding
leaves, and no more than SLURM_CPUS_PER_TASK where the site binds nothing (task/none); read from
the environment and the affinity, no cluster needed."""

import os

import pytest

from partrain.launch.cluster import NodePlace, usable_cores
from partrain.launch.preflight import Ready, ThisNode
from partrain.launch.start import cpu_threads, launch_spec
from tests.unit.helpers import resolved

IN_A_JOB = {"SLURM_JOB_ID": "77", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0"}


@pytest.fixture
def affinity(monkeypatch):
    """The cores this process may run on, as the test says."""
    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: 64)
    return set_cores


@pytest.mark.parametrize("cores, env, usable", [
    (64, {}, 64),  # a plain machine
    (8, {}, 8),  # a cpuset or srun's binding: fewer than os.cpu_count()
    (64, {**IN_A_JOB, "SLURM_CPUS_PER_TASK": "16"}, 16),  # task/none: the affinity says all
    (4, {**IN_A_JOB, "SLURM_CPUS_PER_TASK": "16"}, 4),  # bound tighter than the share
    (64, {**IN_A_JOB, "SLURM_CPUS_PER_TASK": "x"}, 64),  # not a number: the affinity
    (64, {**IN_A_JOB, "SLURM_CPUS_PER_TASK": "0"}, 64),
    (64, {"SLURM_CPUS_PER_TASK": "16"}, 64),  # left over in a shell outside any job
    (64, {**IN_A_JOB, "SLURM_CPUS_ON_NODE": "8"}, 8),  # no -c: the step's CPUs on this node
    (64, {**IN_A_JOB, "SLURM_CPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "4"}, 4),
    (1, {}, 1),
])
def test_usable_cores(affinity, cores, env, usable):
    affinity(cores)
    assert usable_cores(env) == usable


def _ready(nproc: int) -> Ready:
    cfg, world, _ = resolved("launcher.device=cpu", "parallel.dp=auto", nproc=nproc)
    node = ThisNode(place=NodePlace(source="SLURM job 77", job_id="77"), rank=0,
                    rdzv_endpoint=None, network=None)
    return Ready(cfg=cfg, world=world, warnings=[], node=node)


@pytest.mark.parametrize("cores, share, nproc, threads", [
    (64, "16", 4, 4),  # the step's 16 cores over 4 ranks, not the machine's 64
    (64, "2", 4, 1),  # fewer cores than ranks: one thread each
    (6, "16", 2, 3),  # srun's binding is tighter
])
def test_each_worker_gets_its_share_of_the_steps_cores(affinity, monkeypatch, cores, share,
                                                        nproc, threads):
    affinity(cores)
    for name, value in {**IN_A_JOB, "SLURM_CPUS_PER_TASK": share}.items():
        monkeypatch.setenv(name, value)
    assert cpu_threads(_ready(nproc)) == threads


def test_on_cuda_the_threads_are_not_set(monkeypatch):
    cfg, world, _ = resolved("launcher.device=cuda", "parallel.dp=auto", nproc=2)
    node = ThisNode(place=NodePlace(source="this machine"), rank=0, rdzv_endpoint=None,
                    network=None)
    assert cpu_threads(Ready(cfg=cfg, world=world, warnings=[], node=node)) is None


@pytest.mark.parametrize("device, asked, platform, method", [
    ("cpu", "auto", "linux", "forkserver"),
    ("cuda", "auto", "linux", "spawn"),  # not yet measured on GPUs
    ("cpu", "auto", "darwin", "spawn"),  # the forked rank's lifeline reads /proc
    ("cuda", "forkserver", "linux", "forkserver"),  # asked for: given
    ("cpu", "spawn", "linux", "spawn"),
])
def test_how_the_ranks_start(monkeypatch, device, asked, platform, method):
    """launcher.start_method, auto resolved (torchrun's --start-method)."""
    monkeypatch.setattr("sys.platform", platform)
    cfg, world, _ = resolved(f"launcher.device={device}", f"launcher.start_method={asked}",
                             "parallel.dp=auto", nproc=2)
    node = ThisNode(place=NodePlace(source="this machine"), rank=0, rdzv_endpoint=None,
                    network=None)
    assert launch_spec(Ready(cfg=cfg, world=world, warnings=[], node=node)).start_method == method

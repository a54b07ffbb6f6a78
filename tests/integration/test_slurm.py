"""`partrain slurm` against a real SLURM: munged, slurmctld and two slurmd daemons on this machine
emulate a two-node cluster (tests/integration/slurm_cluster.py). The quickstart goes through
sbatch -> srun (one task per node) -> `partrain launch` on each node -> 2 ranks per node, and must
match the single-process run. Only GPUs and NCCL are missing: the ranks use gloo on CPU.

Needs root and apt-get on a machine without SLURM (the fixture installs the Debian packages);
skipped, with the reason, where that cannot work.
"""

import re
import time

import pytest

from tests.integration.conftest import PARITY_COMMON, assert_parity, read_metrics
from tests.integration.slurm_cluster import SlurmCluster, Unavailable, install

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        install()
    except Unavailable as e:
        pytest.skip(f"no SLURM cluster for the tests: {e}")
    cluster = SlurmCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_quickstart_on_two_slurm_nodes(cli, tmp_path, slurm_cluster, single_process_reference):
    canary = tmp_path / "pwned"
    # A hostile run dir: it lands in the #SBATCH --output line, which sbatch parses itself, and in
    # the script's body. (A hostile `name` no longer gets this far: names are plain.)
    run_dir = tmp_path / f"run x'; touch {canary}; '"
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    res = cli.run("slurm", *PARITY_COMMON, "parallel.dp=auto", "train.micro_batch_size=4",
                  "name=slurm-test", "launcher.rdzv_timeout_s=60",
                  "launcher.collective_timeout_s=60",
                  "--nodes", "2", "--nproc-per-node", "2", "--run-dir", str(run_dir), env=env)
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    assert f"slurm-{job_id}.out" in res.stdout

    info = slurm_cluster.wait_job(job_id, timeout=180)
    job_log = run_dir / "logs" / f"slurm-{job_id}.out"
    output = job_log.read_text() if job_log.exists() else "(no job log)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    print(f"slurm job {job_id}: submitted to finished in {time.monotonic() - started:.0f} s")

    # Two launchers (one per node) ran two ranks each, in one job of 4 ranks.
    assert output.count("done: metrics in") == 2, output
    assert "node 0 of 2, SLURM job" in output and "node 1 of 2, SLURM job" in output
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == \
        [f"rank-{r}.log" for r in range(4)]
    steps, _ = read_metrics(run_dir)
    assert_parity(steps, single_process_reference, "slurm 2 nodes x 2 ranks, dp=4")

    assert re.search(r"JobName=(.*) UserId=", slurm_cluster.scontrol("show", "job", "-o", job_id)
                     ).group(1) == "slurm-test"
    assert job_log.exists()  # SLURM wrote the job's output under the hostile path, literally
    assert not canary.exists()

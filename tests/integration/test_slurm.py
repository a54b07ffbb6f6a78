"""`partrain slurm` against a real SLURM: munged, slurmctld and two slurmd daemons on this machine
emulate a two-node cluster (tests/integration/slurm_cluster.py). The quickstart goes through
sbatch -> srun (one task per node) -> `partrain launch` on each node -> 2 ranks per node, and must
match the single-process run. A job preempted mid-run (SIGUSR2 to its steps, as a site sends it)
saves, requeues itself, resumes and must match an uninterrupted run to the bit. A job with
--cpus-per-task, --mem, --exclusive and setup lines gets what it asked for, runs the lines on
every node before partrain, and restarts in the job after a rank fails (--max-restarts); a
failing setup line fails the job without starting partrain (the one quick test here). Only GPUs
and NCCL are missing: the ranks use gloo on CPU.

Needs root and apt-get on a machine without SLURM (the fixture installs the Debian packages);
skipped, with the reason, where that cannot work.
"""

import json
import re
import time

import pytest

from partrain.checkpoint import store
from tests.integration.conftest import PARITY_COMMON, PARITY_STEPS, assert_parity, read_metrics
from tests.integration.debian import Unavailable
from tests.integration.slurm_cluster import SlurmCluster, install


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


@pytest.mark.slow
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

    # Trained on: `partrain slurm --resume` on one node of 2 ranks (dp follows: 2), the config
    # and the script rewritten. While that job is in the queue (held there), a second resume
    # is refused, its files untouched.
    res = cli.run("slurm", "--resume", str(run_dir), "train.max_steps=12", "--nodes", "1",
                  "--nproc-per-node", "2", "--sbatch-arg=--hold", env=env)
    assert res.returncode == 0, res.stderr
    resumed_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    assert f"it resumes from step {PARITY_STEPS} " in " ".join(res.stdout.split())
    script = (run_dir / "job.sbatch").read_text()
    again = cli.run("slurm", "--resume", str(run_dir), "--nodes", "2", "--nproc-per-node", "2",
                    env=env)
    said = " ".join(again.stderr.split())
    assert again.returncode == 2, said
    assert (f"job {resumed_id} (PENDING) runs its script {run_dir / 'job.sbatch'}; two jobs "
            "would train in one run dir at once") in said, said
    assert (run_dir / "job.sbatch").read_text() == script
    slurm_cluster.scontrol("release", resumed_id)
    info = slurm_cluster.wait_job(resumed_id, timeout=180)
    resumed_log = run_dir / "logs" / f"slurm-{resumed_id}.out"
    output = resumed_log.read_text() if resumed_log.exists() else "(no job log)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert f"resuming from step {PARITY_STEPS} " in " ".join(output.split()), output
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 13))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in records if "resumed_from" in r] == [2]
    assert store.newest(run_dir / store.CHECKPOINTS).meta["world_size"] == 2


# Still training when signalled after 3 steps (a step takes 0.1-1 s here); only the save on
# the signal and the last one (checkpoint.every=0).
PREEMPT_STEPS = 20
PREEMPT_RUN = ("launcher.device=cpu", f"train.max_steps={PREEMPT_STEPS}", "train.eval_every=0",
               "train.global_batch_size=16", "train.micro_batch_size=4", "train.seq_len=64",
               "train.log_every=1", "checkpoint.every=0", "launcher.rdzv_timeout_s=60",
               "launcher.collective_timeout_s=60")


def _steps_in(run_dir) -> int:
    try:
        return len(read_metrics(run_dir)[0])
    except (OSError, ValueError):  # not there yet, or a line half-written
        return 0


@pytest.mark.slow
def test_preempted_slurm_job_saves_requeues_and_resumes(cli, tmp_path, slurm_cluster):
    """A site's preemption (`scancel --signal=USR2`, to the job's steps) mid-run: the ranks save
    at one step, both launchers exit 3, the script requeues the job, the same script resumes it
    from the checkpoint, and it ends COMPLETED with the metrics of an uninterrupted run."""
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    # The uninterrupted reference: the same layout (dp=4 over 4 processes of gloo on CPU, one
    # thread each) on this machine; which node holds which rank changes no arithmetic.
    reference_dir = tmp_path / "reference"
    res = cli.run("launch", *PREEMPT_RUN, "parallel.dp=auto", "--nproc-per-node", "4",
                  "--run-dir", str(reference_dir), env=env)
    assert res.returncode == 0, res.stderr
    reference, _ = read_metrics(reference_dir)
    assert len(reference) == PREEMPT_STEPS and reference[-1]["loss"] < reference[0]["loss"]
    reference_s = time.monotonic() - started

    run_dir = tmp_path / "run"
    res = cli.run("slurm", *PREEMPT_RUN, "parallel.dp=auto", "name=slurm-preempt", "--nodes", "2",
                  "--nproc-per-node", "2", "--run-dir", str(run_dir), env=env)
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    job_log = run_dir / "logs" / f"slurm-{job_id}.out"

    def output() -> str:
        return job_log.read_text() if job_log.exists() else "(no job log)"

    deadline = time.monotonic() + 120
    while _steps_in(run_dir) < 3:
        assert time.monotonic() < deadline, f"job {job_id} never trained 3 steps:\n{output()}"
        assert slurm_cluster.job(job_id).get("JobState") in ("PENDING", "RUNNING"), output()
        time.sleep(0.2)
    signalled_at = time.time()
    slurm_cluster.signal(job_id, "USR2")

    info = slurm_cluster.wait_job(job_id, timeout=240)
    log = output()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert info["Restarts"] == "1", info  # requeued once, by the script
    print(f"slurm job {job_id}: submitted to finished in "
          f"{time.monotonic() - started - reference_s:.0f} s (the reference took {reference_s:.0f} s)")

    # The first run: one save on the signal, at one step, before the end; both launchers exit 3.
    saved = [c for c in store.committed(run_dir / store.CHECKPOINTS) if c.reason == "preemption"]
    assert len(saved) == 1, store.committed(run_dir / store.CHECKPOINTS)
    step, meta = saved[0].step, saved[0].meta
    assert 3 <= step < PREEMPT_STEPS and meta["world_size"] == 4
    # Time from the signal to the commit: measured by the ranks from their signal, so no more
    # than the test saw from just before scancel to the commit.
    assert 0 < meta["seconds"] <= meta["saved_at"] - signalled_at + 0.05, meta
    flat = " ".join(log.split())  # the rank-0 display wraps long lines
    launcher_says = (f"saved at step {step} on a preemption signal ({saved[0].path}, "
                     f"{meta['seconds']:.2f} s from signal to commit); relaunch to resume")
    assert flat.count(launcher_says) == 2, log
    assert f"preemption signal: saved step {step} in " in flat, log
    assert flat.count("Exited with exit code 3") == 2, log  # srun's word on each node's launcher
    # The signal reached every process of the steps, multiprocessing's resource tracker too: it
    # must not die of it (the tracker started in its place printed a traceback per segment).
    assert "Traceback" not in log and "resource_tracker" not in log, log

    # The requeued run: the same script resumed from that checkpoint and trained to the end.
    assert flat.count(f"resuming from step {step} ") == 2, log  # each launcher
    assert flat.count(f"loaded step {step}'s checkpoint ") == 1, log  # rank 0, once it is in
    assert flat.count("done: metrics in") == 2, log
    last = store.newest(run_dir / store.CHECKPOINTS)
    assert (last.step, last.reason) == (PREEMPT_STEPS, "last")

    # One line per step, and every step as the uninterrupted run had it, to the bit.
    steps, _ = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, PREEMPT_STEPS + 1))
    for n, (got, ref) in enumerate(zip(steps, reference), start=1):
        assert (got["loss"], got["grad_norm"]) == (ref["loss"], ref["grad_norm"]), (
            f"step {n}: loss {got['loss']!r}, grad_norm {got['grad_norm']!r} after resuming from "
            f"step {step}; uninterrupted: loss {ref['loss']!r}, grad_norm {ref['grad_norm']!r}")


def _submitted(res, slurm_cluster, run_dir, timeout: float) -> tuple[dict[str, str], str]:
    """The finished job's `scontrol show job` fields and its log."""
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    info = slurm_cluster.wait_job(job_id, timeout=timeout)
    job_log = run_dir / "logs" / f"slurm-{job_id}.out"
    return info, job_log.read_text() if job_log.exists() else "(no job log)"


RESTART_STEPS = 8
RESTART_RUN = ("launcher.device=cpu", "parallel.dp=2", f"train.max_steps={RESTART_STEPS}",
               "checkpoint.every=2", "train.seq_len=64", "train.eval_every=0",
               "train.log_every=1", "launcher.rdzv_timeout_s=60",
               "launcher.collective_timeout_s=60")


@pytest.mark.slow
def test_a_cluster_ready_job_gets_what_it_asks_and_restarts_in_the_job(cli, tmp_path,
                                                                       slurm_cluster):
    """One job for both: --cpus-per-task 1 --mem 500M --exclusive as `scontrol show job` reports
    them; a launcher.setup line and a --setup line ran on both nodes, in that order, in the task
    that then became partrain (the step's CPUs are srun's --cpus-per-task); and with
    --max-restarts 1, rank 1 failing at step 3 in the first attempt (PARTRAIN_TEST_FAULT in the
    submitting shell, which sbatch exports to the job) restarts both nodes' workers from step 2's
    checkpoint, and the job ends COMPLETED with every step once."""
    marks = tmp_path / "marks"
    marks.mkdir()
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "defaults:\n  - config\n  - _self_\nlauncher:\n  setup:\n"
        "    - 'echo \"setup-config on node $SLURM_NODEID\"; "
        f"touch {marks}/config-$SLURM_NODEID'\n")
    run_dir = tmp_path / "run"
    started = time.monotonic()
    res = cli.run("slurm", str(config), *RESTART_RUN, "name=slurm-ready", "--nodes", "2",
                  "--nproc-per-node", "1", "--cpus-per-task", "1", "--mem", "500M", "--exclusive",
                  "--setup", 'echo "setup-flag on node $SLURM_NODEID: $SLURM_CPUS_ON_NODE CPU(s)"; '
                  f"touch {marks}/flag-$SLURM_NODEID",
                  "--max-restarts", "1", "--run-dir", str(run_dir),
                  env={**slurm_cluster.env, "PARTRAIN_TEST_FAULT": "1:3"})
    info, log = _submitted(res, slurm_cluster, run_dir, timeout=240)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    print(f"slurm job {info['JobId']}: submitted to finished in {time.monotonic() - started:.0f} s")

    # What the job asked for: a CPU per node's task, 500 MB per node, whole nodes (each of the
    # two claims 2 CPUs: 4 in all, not the 2 the tasks take).
    assert (info["NumCPUs"], info["CPUs/Task"], info["MinMemoryNode"], info["OverSubscribe"]) \
        == ("4", "1", "500M", "NO"), info

    # The setup lines: on both nodes, the config's then the flag's, each before its node's
    # launcher said where it runs; in a step of one CPU per node (srun asked for it again).
    assert sorted(p.name for p in marks.iterdir()) == ["config-0", "config-1", "flag-0", "flag-1"]
    for node in (0, 1):
        config_at = log.index(f"setup-config on node {node}\n")
        flag_at = log.index(f"setup-flag on node {node}: 1 CPU(s)\n")
        assert config_at < flag_at < log.index(f"(node {node} of 2, SLURM job"), log

    # The fault reached the workers through sbatch's environment, and the job restarted in place.
    said = " ".join(log.split())
    assert ("rank 1 failed: RuntimeError: injected fault (PARTRAIN_TEST_FAULT=1:3) on rank 1 at "
            "step 3 (after step 2); restart 1 of 1 (launcher.max_restarts), from step-00000002 "
            "(step 2)") in said, log
    assert "restarts exhausted" not in said and said.count("done: metrics in") == 2, log
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, RESTART_STEPS + 1)), steps
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_a_failing_setup_line_fails_the_job_before_partrain(cli, tmp_path, slurm_cluster):
    """`--setup false`: the job fails with the line's code, its log names the line and the node,
    and partrain never started there (no launcher log, no metrics). Quick: no rank starts."""
    run_dir = tmp_path / "run"
    res = cli.run("slurm", "launcher.device=cpu", "parallel.dp=1", "name=slurm-setup-fails",
                  "--nodes", "1", "--nproc-per-node", "1", "--setup", "echo setup-1-ran",
                  "--setup", "false", "--setup", "echo setup-3-ran", "--run-dir", str(run_dir),
                  env=slurm_cluster.env)
    info, log = _submitted(res, slurm_cluster, run_dir, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), log
    assert "setup-1-ran" in log and "setup-3-ran" not in log, log
    assert ("partrain: setup line 2 of 3 failed on node n1 (exit 1); partrain not started "
            "there: false") in log, log
    assert "partrain: run dir" not in log, log
    assert not (run_dir / "metrics.jsonl").exists()
    assert not list((run_dir / "logs").glob("launcher*.log"))

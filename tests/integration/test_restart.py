"""In-job restarts (launcher.max_restarts, --max-restarts) through the real CLI: a rank fails,
the elastic agent restarts every worker, they resume from the newest committed checkpoint, and
the run ends bit-identical to an uninterrupted one; the launcher says who failed, at which step,
and where the restart resumes from. The fault hook (PARTRAIN_TEST_FAULT) fires in the first
attempt only, so the restarted run goes on; ":always" fires in every attempt."""

import json

import pytest

from tests.integration.conftest import (
    assert_no_abort,
    processes_mentioning,
    read_metrics,
    survivors,
)

COMMON = ("launcher.device=cpu", "train.seq_len=64", "train.eval_every=0", "train.max_steps=8",
          "checkpoint.every=2")
FAULT = "PARTRAIN_TEST_FAULT"


def _said(res) -> str:
    return " ".join((res.stdout + res.stderr).split())


@pytest.mark.parametrize("layout", [
    pytest.param(("parallel.dp=2",), id="dp2"),
    pytest.param(("parallel.dp=1", "parallel.pp=2", "train.micro_batch_size=4"), id="pp2",
                 marks=pytest.mark.slow),
    pytest.param(("parallel.dp=2", "parallel.zero_stage=1"), id="zero1", marks=pytest.mark.slow),
])
def test_a_restarted_run_ends_as_the_uninterrupted_one(cli, tmp_path, layout):
    env = {"DS_ACCELERATOR": "cpu"}
    plain = cli.run("launch", *layout, *COMMON, "--run-dir", str(tmp_path / "plain"), env=env)
    assert plain.returncode == 0, plain.stderr[-2000:]
    run_dir = tmp_path / "run"
    res = cli.run("launch", *layout, *COMMON, "--max-restarts", "2", "--run-dir", str(run_dir),
                  env={**env, FAULT: "1:5"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    said = _said(res)
    assert ("rank 1 failed: RuntimeError: injected fault (PARTRAIN_TEST_FAULT=1:5) on rank 1 at "
            "step 5 (after step 4); restart 1 of 2 (launcher.max_restarts), from step-00000004 "
            "(step 4)") in said, said
    assert "loaded step 4's checkpoint" in said and "training goes on at step 5" in said, said
    steps, _ = read_metrics(run_dir)
    reference, _ = read_metrics(tmp_path / "plain")
    assert [s["step"] for s in steps] == list(range(1, 9))  # one line per step
    for got, want in zip(steps, reference):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
    assert_no_abort(run_dir, res.stdout, res.stderr)


@pytest.mark.slow
def test_a_failure_before_the_first_checkpoint_restarts_from_the_start(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *COMMON, "checkpoint.every=4", "--max-restarts", "1",
                  "--run-dir", str(run_dir), env={FAULT: "0:2"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    said = _said(res)
    assert ("rank 0 failed: RuntimeError: injected fault (PARTRAIN_TEST_FAULT=0:2) on rank 0 at "
            "step 2 (after step 1); restart 1 of 1 (launcher.max_restarts), from the start: no "
            "checkpoint was committed yet") in said, said
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 9))


@pytest.mark.slow
def test_exhausted_restarts_end_with_exit_1(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *COMMON, "launcher.max_restarts=1",
                  "--run-dir", str(run_dir), env={FAULT: "1:3:always"})
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    said = _said(res)
    assert "restart 1 of 1 (launcher.max_restarts), from step-00000002 (step 2)" in said, said
    assert ("rank 1 failed: RuntimeError: injected fault (PARTRAIN_TEST_FAULT=1:3:always) on rank "
            "1 at step 3 (restarts exhausted: launcher.max_restarts=1)") in said, said
    assert "Traceback" not in said
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)


def _pending(pid: int, signum: int) -> bool:
    """Whether signal `signum` waits to be handled by the process (it is stopped)."""
    from pathlib import Path

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) >> (signum - 1) & 1:
            return True
    return False


def test_a_preemption_signal_reaches_the_restarted_workers(cli, tmp_path):
    """SIGUSR2 reached both ranks, then one died before the step where they would have saved on
    it: the restarted workers never heard of it, trained to the end and exited 0, so a SLURM job
    (its signal comes once, before the time limit) trained on to its SIGTERM and was not
    requeued (a reviewer's run). Now the launcher passes it to the restarted workers, which save
    at their first step and exit 3."""
    import os
    import signal
    import time

    from tests.integration.conftest import ranks_of

    run_dir = tmp_path / "run"
    proc = cli.start("launch", "parallel.dp=2", *COMMON[:-2], "train.max_steps=500",
                     "checkpoint.every=2", "train.log_every=1", "--max-restarts", "2",
                     "--run-dir", str(run_dir))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    victim = ranks_of(run_dir)[0]
    os.kill(victim, signal.SIGSTOP)  # it cannot reach the step's end, where they would save
    proc.send_signal(signal.SIGUSR2)
    while not _pending(victim, signal.SIGUSR2):
        assert time.monotonic() < deadline, "the launcher never passed SIGUSR2 to the rank"
        time.sleep(0.1)
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    said = " ".join((stdout + stderr).split())
    assert proc.returncode == 3, said[-3000:]
    assert ("was killed by SIGKILL" in said and "restart 1 of 2 (launcher.max_restarts)"
            in said and "the preemption signal (SIGUSR2) this launcher got goes to the restarted "
            "workers: they save at their first step and exit 3") in said, said[-3000:]
    newest = max((run_dir / "checkpoints").glob("step-*"))
    meta = json.loads((newest / "meta.json").read_text())
    assert meta["reason"] == "preemption", meta
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)

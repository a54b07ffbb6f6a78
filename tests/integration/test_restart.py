"""In-job restarts (launcher.max_restarts, --max-restarts) through the real CLI: a rank fails,
the elastic agent restarts every worker, they resume from the newest committed checkpoint, and
the run ends bit-identical to an uninterrupted one; the launcher says who failed, at which step,
and where the restart resumes from. The fault hook (PARTRAIN_TEST_FAULT) fires in the first
attempt only, so the restarted run goes on; ":always" fires in every attempt."""

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

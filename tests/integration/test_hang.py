"""Hang detection (launcher.hang_timeout_s) through the real CLI: a step that makes no progress
ends with one summary of who waits in which collective on which group, every rank's stack in its
log, exit 1 (or a restart under launcher.max_restarts). The test hook PARTRAIN_TEST_HANG=
RANK:STEP:HOW makes a rank hang in the first attempt: `sleep` inside the step, `skip` into a
collective the others have not reached, `hold` in C code that holds the GIL (its own watch cannot
run, so the launcher's signal fetches its stack)."""

import os
import signal
import time

import pytest

from tests.integration.conftest import processes_mentioning, read_metrics, survivors

HANG = "PARTRAIN_TEST_HANG"
# The collective timeout well above the hang timeout: the hang must be named before gloo gives up.
COMMON = ("launcher.device=cpu", "train.seq_len=64", "train.eval_every=0", "train.max_steps=6",
          "launcher.hang_timeout_s=5", "launcher.collective_timeout_s=60")


# For a wait in a save or an evaluation, timed until 15 s before the collective timeout: 30 s.
QUIET = (*COMMON[:-1], "launcher.collective_timeout_s=30")


def _said(res) -> str:
    return " ".join((res.stdout + res.stderr).split())


def _ended_clean(res, run_dir) -> str:
    said = _said(res)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in said and "gloo" not in said.lower(), said
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)
    return said


def test_a_sleeping_rank_is_named_and_the_others_wait_for_it(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *COMMON, "--run-dir", str(run_dir),
                  env={HANG: "1:3:sleep"})
    said = _ended_clean(res, run_dir)
    assert ("hang: no rank made progress for 5 s (launcher.hang_timeout_s=5) in step 3; who "
            "waits on whom:") in said, said
    # Rank 0 waits for rank 1's gradients in DDP's all-reduce (C++, inside backward).
    assert "rank 0 waits in backward (gradient hooks: DDP's bucketed all-reduce" in said, said
    assert "rank 1 is in no collective: at partrain/train/loop.py:" in said, said
    assert "in _hang: time.sleep(3600)" in said
    assert "the ranks in no collective are the ones the others wait for" in said
    assert f"every rank's Python stack: {run_dir / 'logs'}/rank-N.log" in said
    assert "no checkpoint was committed, so nothing was kept" in said
    # Every rank's stack, all threads, in its log (faulthandler).
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "no progress for 5 s in step 3 (hang)" in log
        assert "most recent call first" in log and "partrain/train/loop.py" in log
    assert "in _hang" in (run_dir / "logs" / "rank-1.log").read_text()
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == [1, 2]


@pytest.mark.slow
def test_a_rank_that_skips_a_collective_is_found_in_another_group(cli, tmp_path):
    """dp2 x tp2: rank 1 goes past its tp all-reduce into a world all-reduce. Rank 0 waits for it
    on their tp group; ranks 2 and 3 got through their own tp group and wait for rank 0 in the
    gradient all-reduce."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", "parallel.tp=2", *COMMON, "--run-dir", str(run_dir),
                  env={HANG: "1:3:skip"})
    said = _ended_clean(res, run_dir)
    assert ("rank 0 waits in all_reduce on the tp group (ranks 0, 1), called at "
            "partrain/parallel/tp_collectives.py:") in said, said
    assert ("rank 1 waits in all_reduce on the default group (ranks 0, 1, 2, 3), called at "
            "partrain/train/loop.py:") in said, said
    assert "ranks 2, 3 wait in backward (gradient hooks" in said, said


@pytest.mark.slow
def test_a_rank_holding_the_gil_is_dumped_on_the_launchers_signal(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *COMMON, "--run-dir", str(run_dir),
                  env={HANG: "1:3:hold"})
    said = _ended_clean(res, run_dir)
    assert "rank 0 waits in backward" in said, said
    assert ("rank 1 did not report (its main thread holds the GIL, or its node is gone): its "
            "stack, dumped on its launcher's signal, is at partrain/train/loop.py:") in said, said
    assert "in _hang (in re/__init__.py:" in said
    assert not (run_dir / "logs" / "hang" / "rank-1.json").exists()


@pytest.mark.slow
def test_a_hang_restarts_under_max_restarts(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *COMMON, "checkpoint.every=2", "--max-restarts",
                  "1", "--run-dir", str(run_dir), env={HANG: "0:3:sleep"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    said = _said(res)
    assert "rank 0 is in no collective: at partrain/train/loop.py:" in said, said
    assert ("the hang ended every worker (after step 2); restart 1 of 1 "
            "(launcher.max_restarts), from step-00000002 (step 2)") in said, said
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert not (run_dir / "logs" / "hang" / "rank-0.json").exists()  # cleared for the restart


@pytest.mark.slow
def test_a_pipeline_stage_names_the_transfer_it_waits_for(cli, tmp_path):
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=1", "parallel.pp=2", "train.micro_batch_size=4", *COMMON,
                  "--run-dir", str(run_dir), env={HANG: "1:3:sleep"})
    said = _ended_clean(res, run_dir)
    assert ("rank 0 waits in wait() for the recv_b of micro-batch 0 (chunk 0) from rank 1, "
            "called at partrain/parallel/pipeline.py:") in said, said
    assert "rank 1 is in no collective" in said


def test_a_rank_stuck_in_a_checkpoint_save_is_named_not_the_rank_that_waits_for_it(cli,
                                                                                  tmp_path):
    """Rank 0 stops while writing its part of step 2's checkpoint (a stuck file system; the test
    hook). Saves are not timed as a whole, so rank 1, done with its part and waiting in DCP's
    gather, failed at the collective timeout with gloo's `Timed out waiting ... for send`, named
    as the failed rank. Now its wait in one collective is timed (twice the limit) and rank 0,
    quiet, reports where it is."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *QUIET, "checkpoint.every=2", "--run-dir",
                  str(run_dir), env={"PARTRAIN_TEST_SAVE_PAUSE": "0:2:during"})
    said = _ended_clean(res, run_dir)
    # 15 s before the collective timeout of 30 s
    assert ("hang: no rank made progress for 15 s (one wait in one collective, near "
            "launcher.collective_timeout_s: a save or an evaluation is not timed as a whole) in "
            "the checkpoint save after step 2; who waits on whom:") in said, said
    assert "rank 0 is in no collective: at partrain/checkpoint/checkpointer.py:" in said, said
    assert "rank 1 waits in gather_object on the default group (ranks 0, 1)" in said, said
    assert "the ranks in no collective are the ones the others wait for" in said, said
    assert "no checkpoint was committed, so nothing was kept" in said, said
    assert "another rank reported a hang while this one was in the checkpoint save after step " \
        "2" in (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
def test_a_rank_stuck_in_an_evaluation_is_named(cli, tmp_path):
    """Rank 1 sleeps in the evaluation after step 2 (the test hook); rank 0 waits for it in the
    evaluation's collective. An evaluation is not timed as a whole, so this ended at the
    collective timeout with gloo's error on rank 0; now rank 0's wait in one collective is the
    hang and rank 1, quiet, says where it is."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *QUIET[:2], "train.eval_every=2",
                  "train.eval_batches=1", *QUIET[3:], "--run-dir", str(run_dir),
                  env={HANG: "1:2:eval"})
    said = _ended_clean(res, run_dir)
    assert "in the evaluation after step 2; who waits on whom:" in said, said
    assert "rank 1 is in no collective: at partrain/train/loop.py:" in said, said
    assert "time.sleep(3600)" in said, said
    assert "rank 0 waits in all_reduce" in said, said


@pytest.mark.slow
def test_a_slow_deletion_of_a_pruned_checkpoint_is_not_a_hang(cli, tmp_path):
    """checkpoint.keep=1: the commit of step 4 prunes step 2's checkpoint, and deleting it takes
    20 s, longer than the hang limit (a large checkpoint on a network file system; the test hook
    pauses rank 0's deletion). Rank 0 deletes in the background, so rank 1 does not wait for it
    in step 5 and the hang watch has nothing to say; at the end rank 0 waits for the deletion
    while rank 1 waits in the trace's gather, longer than twice the limit and well within the
    collective timeout: no hang either. The run ends with only its newest checkpoint and no
    leftover."""
    run_dir = tmp_path / "run"
    # train.trace: at the end rank 1 waits in the trace's gather while rank 0 waits for the
    # deletion (a reviewer's find: called a hang at twice the limit; the run had finished).
    res = cli.run("launch", "parallel.dp=2", *COMMON, "train.max_steps=8", "checkpoint.every=2",
                  "checkpoint.keep=1", "train.trace=true", "--run-dir", str(run_dir),
                  env={"PARTRAIN_TEST_SAVE_PAUSE": "0:4:prune:20"})
    said = _said(res)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "hang" not in said, said
    # No rank saw one either (a rank that reports a hang waits 5 s for the others' reports
    # before it ends, and this run could end first).
    assert not (run_dir / "logs" / "hang").exists()
    for rank in (0, 1):
        assert "no progress for" not in (run_dir / "logs" / f"rank-{rank}.log").read_text()
    assert "rank 0 pauses prune writing step 4" in (run_dir / "logs" / "rank-0.log").read_text()
    assert (run_dir / "trace.json").is_file()
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest",
                                                                          "step-00000008"]


def test_a_collective_mismatch_gloo_aborts_on_is_quoted_from_the_ranks_log(cli, tmp_path):
    """dp2 alone: rank 1's skip meets rank 0's gradient all-reduce with another size, and gloo
    aborts it (SIGABRT) before any hang: the launcher said only `killed by SIGABRT (no Python
    error recorded)`; gloo's reason was in the rank's log alone."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", "parallel.dp=2", *COMMON, "--run-dir", str(run_dir),
                  env={HANG: "1:3:skip"})
    said = _said(res)
    assert res.returncode == 1, said[-3000:]
    assert "rank 1 failed: killed by SIGABRT (no Python error recorded)" in said, said[-3000:]
    assert "its log ends: what(): [enforce fail at" in said, said[-3000:]
    assert "Is there a distributed collective mismatch in your code?" in said
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)


def test_a_preemption_signal_during_a_hang_is_said(cli, tmp_path):
    """SIGUSR2 (SLURM's warning) while the ranks are hung cannot be saved on: the launcher exits
    1 with the hang's summary, and said nothing of the signal (a SLURM job requeues on 3 only)."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = cli.start("launch", "parallel.dp=2", *COMMON, "--run-dir", str(run_dir),
                     env={HANG: "1:3:sleep"})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "step 2 never came"
        time.sleep(0.2)
    time.sleep(1)  # into step 3, where rank 1 sleeps
    os.kill(proc.pid, signal.SIGUSR2)
    stdout, stderr = proc.communicate(timeout=120)
    said = " ".join((stdout + stderr).split())
    assert proc.returncode == 1, said[-3000:]
    assert "hang: no rank made progress" in said, said[-3000:]
    assert "a preemption signal (SIGUSR2) came while the ranks were hung" in said, said[-3000:]

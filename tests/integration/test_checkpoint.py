"""Runs that survive (the CLI end to end): exact resume on the same layout, resume on another
layout within layout parity, a SIGKILL of the whole job mid-save, a preemption signal (SIGUSR2 ->
save at one step, exit 3, relaunch), asynchronous saving and model.init_from.

A run of 10 steps saving every 5 is the uninterrupted run; its step-10 checkpoint is removed,
which leaves the run dir as a job killed after step 5's save would, and the resumed steps 6-10 are
compared with the uninterrupted ones (bit-identical on the same layout). The resumes on another
layout (and more on the same one) use the parity runs as sources: test_parity.py.
"""

import json
import os
import shutil
import signal
import time

import pytest

from partrain.checkpoint import store
from tests.integration.conftest import (
    PARITY_COMMON,
    PARITY_STEPS,
    assert_no_abort,
    assert_parity,
    processes_mentioning,
    read_metrics,
)

EVERY5 = ("checkpoint.every=5",)
LAYOUTS = {
    "1 process": ("parallel.dp=1", "--nproc-per-node", "1", "train.micro_batch_size=16"),
    "dp2": ("parallel.dp=2", "train.micro_batch_size=4"),
    "dp2 x tp2 x pp2": ("parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                        "train.micro_batch_size=4"),
    "tp2 +sp": ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                "train.micro_batch_size=4"),
    "tp2": ("parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=4"),
    "pp2 interleaved": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                        "parallel.pp_virtual_stages=2", "train.micro_batch_size=4"),
    "pp4 1f1b": ("parallel.dp=1", "parallel.pp=4", "parallel.pp_schedule=1f1b",
                 "parallel.pp_virtual_stages=1", "train.micro_batch_size=4"),
    "zero1 dp2 x pp2": ("parallel.dp=2", "parallel.pp=2", "parallel.zero_stage=1",
                        "train.micro_batch_size=4"),
    "zero2 dp2": ("parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch_size=4"),
    "zero3 dp2": ("parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"),
}
def _launch(cli, *args, env=None, timeout=300):
    res = cli.run("launch", *args, env=env, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _trained(cli, tmp_path, layout, env=None):
    """The uninterrupted run of `layout` (10 steps, saving at 5 and 10) and its steps."""
    run_dir = tmp_path / "run"
    _launch(cli, *PARITY_COMMON, *LAYOUTS[layout], *EVERY5, "--run-dir", str(run_dir), env=env)
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, PARITY_STEPS + 1))
    return run_dir, steps


def _interrupted_after_5(run_dir, copy_to=None):
    """The run dir as a job killed after step 5's save leaves it (optionally a copy of it)."""
    if copy_to is not None:
        shutil.copytree(run_dir, copy_to)
        run_dir = copy_to
    shutil.rmtree(run_dir / "checkpoints" / "step-00000010")
    return run_dir


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_identical(resumed, uninterrupted, first=6):
    got = {s["step"]: (s["loss"], s["grad_norm"]) for s in resumed}
    want = {s["step"]: (s["loss"], s["grad_norm"]) for s in uninterrupted}
    assert sorted(got) == sorted(want)
    for step in range(first, PARITY_STEPS + 1):
        assert got[step] == want[step], f"step {step}: resumed {got[step]} != {want[step]}"


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """The uninterrupted dp2 run, shared by the tests that interrupt dp2 runs in other ways."""
    from tests.integration.conftest import CLI

    cli = CLI()
    try:
        yield _trained(cli, tmp_path_factory.mktemp("dp2"), "dp2")
    finally:
        cli.kill_all()


def test_relaunch_resumes_bit_identical(cli, tmp_path, dp2_run):
    """The same command again on a run dir with a checkpoint continues from it, exactly. The
    killed job was writing a metrics line when it died (a full disk, a node without power): the
    line is cut short and padded with NUL bytes; the resume drops it and says so."""
    source, uninterrupted = dp2_run
    run_dir = _interrupted_after_5(source, copy_to=tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "ab") as metrics:
        metrics.write(b'{"step": 11, "loss": 4.7' + b"\0" * 64)
    res = _launch(cli, *PARITY_COMMON, *LAYOUTS["dp2"], *EVERY5, "--run-dir", str(run_dir))
    assert "resuming from step 5" in res.stdout
    assert ("dropped 1 line(s) that are not a metrics record" in
            (run_dir / "logs" / "rank-0.log").read_text())
    assert "dropped 1 line(s) that are not a metrics record" in " ".join(res.stdout.split())
    steps, _ = read_metrics(run_dir)
    _assert_identical(steps, uninterrupted)
    # One line per step: what the interrupted run trained after the checkpoint was dropped.
    assert [s["step"] for s in steps] == list(range(1, PARITY_STEPS + 1))
    resumed = [r for r in _lines(run_dir) if "resumed_from" in r]
    assert resumed == [{"step": 5, "resumed_from": "checkpoints/step-00000005", "world_size": 2}]
    saves = [r for r in _lines(run_dir) if "checkpoint" in r]
    assert [(r["step"], r["reason"]) for r in saves] == [(5, "every"), (10, "every")]
    assert all(r["bytes"] > 0 and r["seconds"] >= 0 for r in saves)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest", "step-00000005", "step-00000010"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000010\n"
    # Launched again once finished: nothing to train, nothing started.
    res = _launch(cli, *PARITY_COMMON, *LAYOUTS["dp2"], *EVERY5, "--run-dir", str(run_dir))
    assert "nothing to do" in res.stdout
    assert_no_abort(run_dir, res.stderr)


def test_a_bit_flipped_in_a_checkpoint_is_refused_before_it_is_read(cli, tmp_path, dp2_run):
    """Every file a run's ranks write has its crc32 in meta.json. One bit flipped in rank 1's
    file since (the size unchanged: the launcher's checks see nothing) loaded silently; now the
    ranks, each reading its share, refuse it before any tensor is read: exit 2, the file named,
    what to do, no restart."""
    from partrain.checkpoint.verify import crc32_of

    source, _ = dp2_run
    run_dir = _interrupted_after_5(source, copy_to=tmp_path / "run")
    step5 = run_dir / "checkpoints" / "step-00000005"
    sums = json.loads((step5 / "meta.json").read_text())["files"]
    shards = sorted(p.name for p in step5.glob("*.distcp"))
    assert sorted(sums) == [".metadata", *shards] and {n[:4] for n in shards} == {"__0_", "__1_"}
    assert all(sums[name] == crc32_of(step5 / name) for name in sums)
    assert not list(step5.glob("*.crc32.json"))
    victim = step5 / [n for n in shards if n.startswith("__1_")][0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 4
    victim.write_bytes(bytes(data))
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    res = cli.run("launch", "--resume", str(run_dir), "launcher.max_restarts=1", timeout=300)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr[-3000:]
    assert (f"error: the checkpoint {step5} (step 5) is damaged: {victim.name} does not hold "
            "the bytes written into it (crc32 ") in said, said
    assert (f"{sums[victim.name]} when saved), written by rank 1. Move it out of "
            f"{run_dir / 'checkpoints'}: no checkpoint is before it, so the run starts again from "
            f"step 1 with partrain launch {run_dir / 'config.yaml'} --run-dir {run_dir}") in said, said
    assert "Traceback" not in said and "; restart 1" not in said, said
    # Nothing trained from it: no line kept or dropped, no save.
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in step5.parent.glob("step-*")) == [step5.name]
    assert_no_abort(run_dir, res.stderr)


def test_a_job_script_goes_on_on_another_split_of_the_same_ranks(cli, tmp_path, dp2_run):
    """A job script's command (`launch RUN_DIR/config.yaml --run-dir RUN_DIR --nnodes 2
    --nproc-per-node 1`) on a run dir whose config.yaml says 1 x 2 (a `launch --resume` on one
    node had rewritten it): the start resumes and freezes 2 x 1. It was let through the checks
    and then refused at every node as it wrote config.yaml (`holds another config
    (launcher.nnodes: 1 there, 2 here; ...)`). Two launchers on this host stand for the nodes."""
    import socket

    source, uninterrupted = dp2_run
    run_dir = _interrupted_after_5(source, copy_to=tmp_path / "run")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [cli.start("launch", str(run_dir / "config.yaml"), "--run-dir", str(run_dir),
                       "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                       "--rdzv-endpoint", f"127.0.0.1:{port}") for rank in (0, 1)]
    for rank, node in enumerate(nodes):
        stdout, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, f"node {rank}: {stderr[-3000:]}"
    assert "resuming from step 5" in stdout
    steps, _ = read_metrics(run_dir)
    _assert_identical(steps, uninterrupted)  # dp2 either way: the same ranks' roles
    frozen = (run_dir / "config.yaml").read_text()
    assert "nnodes: 2" in frozen and "nproc_per_node: 1" in frozen


def _wait_for(predicate, proc, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the launcher ended first: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("where", [
    "0:4:after",  # every rank's part written, not yet committed
    "1:4:before",  # rank 0 waits inside DCP for rank 1's part
])
def test_sigkill_mid_save_keeps_the_last_commit(cli, tmp_path, dp2_run, where):
    """A SIGKILL of the whole job during a save leaves the newest committed checkpoint; the next
    start removes what the save left and resumes from that checkpoint, exactly."""
    common = (*PARITY_COMMON, *LAYOUTS["dp2"], "checkpoint.every=2")
    run_dir = tmp_path / "run"
    proc = cli.start("launch", *common, "--run-dir", str(run_dir),
                     env={"PARTRAIN_TEST_SAVE_PAUSE": where})
    paused = [run_dir / "logs" / f"rank-{where[0]}.log"]
    # Paused, and the save begun: the other rank inside DCP has made the directory (with rank 1
    # paused before its part, rank 0 may log nothing yet when rank 1 pauses: wait for both).
    tmp = run_dir / "checkpoints" / ".tmp-step-00000004"
    _wait_for(lambda: paused[0].exists() and "pauses" in paused[0].read_text() and tmp.is_dir(),
              proc, "the save pause")
    if where == "0:4:after":
        # Meanwhile the run dir, which holds step 2's checkpoint, takes no other launch: neither
        # the same command again nor a resume (a second shell, a job submitted twice).
        for again in (("launch", *common, "--run-dir", str(run_dir)),
                      ("launch", "--resume", str(run_dir), "optim.lr=0.001")):
            refused = cli.run(*again)
            assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
            assert f"{run_dir} is in use: a launch runs in it (pid {proc.pid}" in " ".join(
                refused.stderr.split()), refused.stderr
            assert "Traceback" not in refused.stderr
        assert tmp.is_dir() and proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its group; the workers die with it
    proc.wait()
    deadline = time.monotonic() + 10
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == []
    ckpts = run_dir / "checkpoints"
    assert (ckpts / ".tmp-step-00000004").is_dir()
    assert not (ckpts / "step-00000004").exists()
    assert (ckpts / "latest").read_text() == "step-00000002\n"

    res = _launch(cli, *common, "--run-dir", str(run_dir))
    assert "resuming from step 2" in res.stdout
    assert not (ckpts / ".tmp-step-00000004").exists()
    assert "left by an interrupted save" in (run_dir / "logs" / "rank-0.log").read_text()
    _assert_identical(read_metrics(run_dir)[0], dp2_run[1], first=3)


def test_preemption_signal_saves_exits_3_and_resumes(cli, tmp_path, dp2_run):
    """SIGUSR2 to the launcher (as a user or a site's tooling sends it): every rank saves at the
    same step, exit 3 naming the step; the same command again finishes the run, exactly as the
    run that nothing interrupted (saving on another schedule, the same training)."""
    common = (*PARITY_COMMON, *LAYOUTS["dp2"], "checkpoint.every=0", "train.log_every=1")
    run_dir = tmp_path / "run"
    proc = cli.start("launch", *common, "--run-dir", str(run_dir))
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, proc,
              "three steps")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGUSR2)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr
    saved = [r for r in _lines(run_dir) if "checkpoint" in r]
    assert len(saved) == 1 and saved[0]["reason"] == "preemption", saved
    step = saved[0]["step"]
    assert 3 <= step < PARITY_STEPS
    assert f"saved at step {step} on a preemption signal" in stderr
    assert f"relaunch to resume: partrain launch --resume {run_dir}" in " ".join(stderr.split())
    assert "s from signal to commit" in stderr
    # rank 0's checkpoint line times it from the signal too, and says so (it read as the save's
    # own duration: 3.03 s for a 0.05 s save)
    assert f"step {step} checkpoint checkpoints/step-{step:08d}:" in " ".join(stdout.split())
    assert " s from the signal (preemption)" in stdout, stdout[-2000:]
    assert 0 <= saved[0]["seconds"] < time.monotonic() - signalled
    meta = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())
    assert meta["reason"] == "preemption" and meta["step"] == step
    assert processes_mentioning(str(run_dir)) == []
    assert_no_abort(run_dir, stderr)

    res = _launch(cli, *common, "--run-dir", str(run_dir))
    assert f"resuming from step {step}" in res.stdout
    got = read_metrics(run_dir)[0]
    assert [s["step"] for s in got] == list(range(1, PARITY_STEPS + 1))
    _assert_identical(got, dp2_run[1], first=1)


@pytest.mark.slow
def test_a_preemption_whose_save_is_refused_exits_3_not_done(cli, tmp_path):
    """The state holds a NaN when the signal comes (the test hook puts one in what rank 1
    saves): nothing is saved, and the launcher says so and exits 3, so that a requeued job goes
    on from the newest good checkpoint. It used to print `saved step N`, exit 0 and record the
    run as done, short of train.max_steps."""
    run_dir = tmp_path / "run"
    proc = cli.start("launch", "launcher.device=cpu", "train.seq_len=64", "train.eval_every=0",
                     "train.global_batch_size=16", *LAYOUTS["dp2"], "checkpoint.every=0",
                     "train.log_every=1", "train.max_steps=200", "--run-dir", str(run_dir),
                     env={"PARTRAIN_TEST_NONFINITE_STATE": "1"})
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, proc,
              "three steps")
    proc.send_signal(signal.SIGUSR2)
    stdout, stderr = proc.communicate(timeout=120)
    said = " ".join((stdout + stderr).split())
    assert proc.returncode == 3, stdout[-2000:] + stderr[-2000:]
    step = [r for r in _lines(run_dir) if "checkpoint_refused" in r][0]["step"]
    assert (f"error: preemption signal at step {step}: its checkpoint was not saved "
            "(test.nonfinite on rank 1 is not finite); no checkpoint was committed before it: "
            "relaunch to start again from step 1") in said, said
    assert "saved step" not in said and "done:" not in said and "Traceback" not in said
    assert store.newest(run_dir / "checkpoints") is None
    assert json.loads((run_dir / "logs" / "state.json").read_text())["state"] == "preempted"
    assert processes_mentioning(str(run_dir)) == []
    assert_no_abort(run_dir, stderr)


def test_a_run_whose_final_save_is_refused_exits_4_not_done(cli, tmp_path):
    """The state at train.max_steps holds a NaN (the test hook; a hostile tester got there with a
    damaged optimizer state, whose update made the weights NaN from a finite loss and gradient):
    its final checkpoint is refused, and the run must not end `done`, exit 0, with `next:` lines
    to train on. It stops as diverged (exit 4), saying so and what to do."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", "launcher.device=cpu", "parallel.dp=1", "train.max_steps=3",
                  "train.eval_every=0", "checkpoint.every=0", "--run-dir", str(run_dir),
                  env={"PARTRAIN_TEST_NONFINITE_STATE": "0"})
    said = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 4, said[-3000:]
    assert ("the state at step 3, the last (train.max_steps), is not finite (test.nonfinite on "
            "rank 0 is not finite): its checkpoint was not saved and the run did not finish. No "
            "checkpoint was committed before it: start the run again with a lower learning "
            "rate") in said, said[-3000:]
    assert "done:" not in said and "next:" not in said and "Traceback" not in said
    assert store.newest(run_dir / "checkpoints") is None
    assert json.loads((run_dir / "logs" / "state.json").read_text())["state"] != "done"
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow
def test_async_save_matches_sync(cli, tmp_path, dp2_run):
    """Background saving changes nothing in training and commits every checkpoint."""
    sync_steps = dp2_run[1]
    async_dir = tmp_path / "async"
    _launch(cli, *PARITY_COMMON, *LAYOUTS["dp2"], *EVERY5, "checkpoint.async_save=true",
            "--run-dir", str(async_dir))
    _assert_identical(read_metrics(async_dir)[0], sync_steps, first=1)
    saves = [r for r in _lines(async_dir) if "checkpoint" in r]
    assert [r["step"] for r in saves] == [5, 10]
    assert all(r["blocked_s"] <= r["seconds"] for r in saves)
    # The asynchronously written checkpoint resumes exactly like the synchronous one.
    _interrupted_after_5(async_dir)
    _launch(cli, "--resume", str(async_dir))
    _assert_identical(read_metrics(async_dir)[0], sync_steps)


@pytest.mark.slow
def test_init_from_starts_a_new_run_at_any_layout(cli, tmp_path, dp2_run):
    """model.init_from: the checkpoint's weights, a fresh optimizer from step 1, any layout."""
    source = dp2_run[0]
    runs = {}
    for name in ("1 process", "tp2"):
        run_dir = tmp_path / name.replace(" ", "-")
        res = _launch(cli, *PARITY_COMMON, *LAYOUTS[name], f"model.init_from={source}",
                      "--run-dir", str(run_dir))
        assert "fresh optimizer" in res.stdout
        runs[name] = read_metrics(run_dir)[0]
    fresh = read_metrics(source)[0]
    assert_parity(runs["tp2"], runs["1 process"], "init_from at tp2 vs 1 process")
    # Trained weights: the first loss is that of the source's end, far below a fresh start's.
    assert runs["1 process"][0]["loss"] < fresh[0]["loss"] - 0.3
    assert runs["1 process"][0]["step"] == 1


@pytest.mark.slow
def test_preemption_signal_before_the_workers_are_ready(cli, tmp_path):
    """A signal that arrives while the workers still import torch neither kills them nor is lost:
    the launcher keeps it until their handler is set, and they save at their first step."""
    run_dir = tmp_path / "run"
    proc = cli.start("launch", *PARITY_COMMON, *LAYOUTS["dp2"], "--run-dir", str(run_dir))
    _wait_for(lambda: (run_dir / "logs").is_dir(), proc, "the run dir")
    proc.send_signal(signal.SIGUSR2)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr
    assert "saved at step 1 on a preemption signal" in stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000001\n"
    assert processes_mentioning(str(run_dir)) == []

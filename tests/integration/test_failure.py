"""A rank that fails ends the whole job (exit 1, the rank named, its error printed), and Ctrl-C /
SIGTERM stop every worker (exit 130); no process outlives the launcher either way, not even when
the launcher is killed with SIGKILL."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import processes_mentioning, ranks_of, read_metrics, survivors

LONG = ("train.max_steps=100000", "train.eval_every=0")


def _wait_for_steps(run_dir, proc, timeout=120):
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("training never started")


# Both ways ranks start (launcher.start_method): forked from the rank server (the default on CPU)
# and spawned (the default on GPUs).
START_METHODS = pytest.mark.parametrize("start_method", ["forkserver", "spawn"])


@START_METHODS
def test_failing_rank_stops_the_job(cli, tmp_path, start_method):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    res = cli.run("launch", *LONG, f"launcher.start_method={start_method}", "--run-dir",
                  str(run_dir),
                  env={"PARTRAIN_TEST_FAULT": "1:3"}, timeout=120)
    elapsed = time.monotonic() - started
    assert res.returncode == 1, res.stderr
    assert "rank 1 failed" in res.stderr
    assert "injected fault" in res.stderr and "at step 3" in res.stderr
    assert "rank-1.log" in res.stderr
    # The healthy rank 0 was stopped, not left waiting in a collective for its timeout (120 s).
    assert elapsed < 60, elapsed
    assert "injected fault" in (run_dir / "logs" / "rank-1.log").read_text()
    assert processes_mentioning(str(run_dir)) == []
    # Either way a rank has its share of the cores (OMP_NUM_THREADS, set before torch loads).
    from partrain.launch.cluster import usable_cores

    share = max(1, usable_cores() // 2)
    assert f"on cpu, {share} CPU thread(s)" in (run_dir / "logs" / "rank-0.log").read_text()


def test_a_run_that_failed_before_its_first_checkpoint_starts_again_with_the_same_command(
        cli, tmp_path):
    """What a requeued job does: the same command in the same run dir. Nothing was committed,
    so the run starts again from step 1 (it used to be refused: the run dir was not empty), and
    metrics.jsonl holds each step once."""
    run_dir = tmp_path / "run"
    command = ("launch", "train.max_steps=6", "train.eval_every=0", "--run-dir", str(run_dir))
    failed = cli.run(*command, env={"PARTRAIN_TEST_FAULT": "1:3"})
    said = " ".join((failed.stdout + failed.stderr).split())
    assert failed.returncode == 1 and "injected fault" in said, said[-3000:]
    assert "no checkpoint was committed" in said and "the same command" in said, said[-3000:]
    assert [s["step"] for s in read_metrics(run_dir)[0]] == [1, 2]
    again = cli.run(*command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert ("it trained before without committing a checkpoint, so the run starts again from "
            "step 1") in " ".join(again.stdout.split())
    assert [s["step"] for s in read_metrics(run_dir)[0]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("start_method, restarts", [("forkserver", 0), ("forkserver", 1),
                                                     ("spawn", 0)])
def test_a_rank_killed_by_a_signal_is_named_not_the_peer_it_broke(cli, tmp_path, start_method,
                                                                    restarts):
    """SIGKILL to rank 1 (the OOM killer's way): it records no error, and rank 0 fails at once on
    the lost peer. The launcher names rank 1 and how it ended, not rank 0's symptom, and without
    restarts, not a failure on another node with them (one node here)."""
    run_dir = tmp_path / "run"
    proc = cli.start("launch", "train.max_steps=20" if restarts else LONG[0], LONG[1],
                     "checkpoint.every=2", f"launcher.max_restarts={restarts}",
                     f"launcher.start_method={start_method}", "--run-dir", str(run_dir))
    _wait_for_steps(run_dir, proc)
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    said = " ".join((stdout + stderr).split())
    assert "rank 0 failed" not in said and "another node" not in said, said[-3000:]
    if restarts:
        assert proc.returncode == 0, said[-3000:]
        assert "rank 1 was killed by SIGKILL (after step" in said, said[-3000:]
        assert "restart 1 of 1 (launcher.max_restarts), from " in said
        assert (run_dir / "checkpoints" / "step-00000020").is_dir()
    else:
        assert proc.returncode == 1, said[-3000:]
        assert ("rank 1 failed: killed by SIGKILL (no Python error recorded) its log: "
                f"{run_dir / 'logs' / 'rank-1.log'}") in said, said[-3000:]
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.parametrize("start_method, nproc, restarts", [
    ("forkserver", 1, 0), ("spawn", 1, 0), ("forkserver", 2, 0), ("spawn", 2, 0),
    ("forkserver", 2, 1)])
def test_a_rank_that_exits_with_code_0_in_the_middle_is_a_failure(cli, tmp_path, start_method,
                                                                   nproc, restarts):
    """os._exit(0) in a rank's code: torch's agent takes exit code 0 for a finished rank. Spawned,
    one rank said `done` after 2 of 100000 steps; forked, the launcher waited forever; with two
    ranks the peer that lost it was blamed. Now the rank is named (exit 1), or with a restart
    left, restarted (launch/ended.py)."""
    run_dir = tmp_path / "run"
    rank = nproc - 1
    steps = "train.max_steps=12" if restarts else LONG[0]
    started = time.monotonic()
    res = cli.run("launch", steps, LONG[1], "checkpoint.every=2", f"parallel.dp={nproc}",
                  f"launcher.max_restarts={restarts}", f"launcher.start_method={start_method}",
                  "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
                  env={"PARTRAIN_TEST_FAULT": f"{rank}:3:exit0"}, timeout=120)
    said = " ".join((res.stdout + res.stderr).split())
    assert time.monotonic() - started < 90
    assert "rank 0 failed" not in said and "another node" not in said, said[-3000:]
    if restarts:
        assert res.returncode == 0, said[-3000:]
        assert (f"rank {rank} exited with code 0 before the end of the run and recorded no "
                "error (after step 2); restart 1 of 1 (launcher.max_restarts), from "
                "step-00000002") in said, said[-3000:]
        assert (run_dir / "checkpoints" / "step-00000012").is_dir()
    else:
        assert res.returncode == 1, said[-3000:]
        assert (f"rank {rank} exited with code 0 after step 2, before the end of the run, and "
                f"recorded no error") in said, said[-3000:]
        assert f"its log: {run_dir / 'logs' / f'rank-{rank}.log'}" in said
        assert ("every other rank was stopped" in said) == (nproc > 1)
        listed = cli.run("runs", "--root", str(run_dir))
        assert listed.stdout.splitlines()[-1].split()[:2] == ["failed", "2/100000"], listed.stdout
    assert processes_mentioning(str(run_dir)) == []


def test_sys_exit_in_a_rank_is_an_error_it_records(cli, tmp_path):
    """sys.exit(0) inside the training: torch's @record returns from main as if the rank had
    finished; the rank records it as its error instead."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", *LONG, "--run-dir", str(run_dir),
                  env={"PARTRAIN_TEST_FAULT": "1:3:sysexit"}, timeout=120)
    said = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 1, said[-3000:]
    assert ("rank 1 failed: RuntimeError: sys.exit(0) was called on rank 1 in step 3, before the "
            "end of the run (train.max_steps=100000)") in said, said[-3000:]
    assert processes_mentioning(str(run_dir)) == []


def _pid_of_rank(run_dir, rank: int) -> int:
    """The process that has the rank's log open."""
    log = str(run_dir / "logs" / f"rank-{rank}.log")
    for pid in ranks_of(run_dir):
        try:
            if any(os.readlink(fd) == log for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no running rank has {log} open")


@pytest.mark.parametrize("how", ["sigterm-launcher",
                                 pytest.param("ctrl-c-group", marks=pytest.mark.slow),
                                 pytest.param("hangup-group", marks=pytest.mark.slow)])
def test_interrupt_stops_all_workers(cli, tmp_path, how):
    """SIGTERM to the launcher, a Ctrl-C, or a closed terminal (SIGHUP to every process of its
    session): exit 130, the newest checkpoint and the command, no traceback (a hangup ended
    multiprocessing's resource tracker, and the one started in its place printed one for each
    shared-memory segment it never saw)."""
    run_dir = tmp_path / "run"
    proc = cli.start("launch", *LONG, "checkpoint.every=1", "--run-dir", str(run_dir))
    _wait_for_steps(run_dir, proc)
    while not (run_dir / "checkpoints" / "latest").exists():  # a first save to name
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    assert len(ranks_of(run_dir)) == 2, processes_mentioning(str(run_dir))
    if how == "sigterm-launcher":
        proc.send_signal(signal.SIGTERM)
    else:  # a terminal's Ctrl-C, or its hangup, reaches the whole process group
        os.killpg(proc.pid, signal.SIGINT if how == "ctrl-c-group" else signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stdout + stderr, stderr
    # What to do next: the newest checkpoint and the command.
    import re

    from partrain.checkpoint import store

    said = " ".join(stderr.split())
    assert "interrupted: all workers stopped" in said, stderr
    named = re.search(r"the newest checkpoint is (\S+) \(step (\d+)\)", said)
    assert named, stderr
    committed = {str(c.path): c.step for c in store.committed(run_dir / store.CHECKPOINTS)}
    assert committed.get(named.group(1)) == int(named.group(2)), (named.group(0), committed)
    assert f"partrain launch --resume {run_dir}" in said, stderr
    assert processes_mentioning(str(run_dir)) == []


# Starts the command after it with SIGINT blocked, as a parent's mask passes on across exec.
BLOCKED_SIGINT = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
                  "{signal.SIGINT}); os.execv(sys.argv[1], sys.argv[1:])")


@pytest.mark.slow
@pytest.mark.parametrize("parent", ["plain", "sigint-blocked"])
def test_a_ctrl_c_while_the_rank_server_imports_says_no_traceback(cli, tmp_path, parent):
    """A Ctrl-C in the first seconds, while the node's rank server imports torch: it printed a
    KeyboardInterrupt traceback from the server, and sometimes nothing else. Now: exit 130,
    no traceback, and nothing left running. Also from a parent that left SIGINT blocked (the
    full suite's run once did): the launcher took no Ctrl-C and trained on."""
    run_dir = tmp_path / "run"
    prefix = (sys.executable, "-c", BLOCKED_SIGINT) if parent == "sigint-blocked" else ()
    proc = cli.start("launch", *LONG, "--run-dir", str(run_dir), prefix=prefix)
    deadline = time.monotonic() + 60

    def server():  # multiprocessing's forkserver, the run dir in its environment
        return [pid for pid in processes_mentioning(str(run_dir)) if b"forkserver" in
                Path(f"/proc/{pid}/cmdline").read_bytes()]

    while not server():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    assert not list((run_dir / "logs").glob("rank-*.log")), "the ranks began already"
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr, \
        stderr
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)


@START_METHODS
def test_sigkilled_launcher_takes_its_workers_along(cli, tmp_path, start_method):
    """SIGKILL leaves the launcher no chance to stop anyone; each worker's lifeline ends it (a
    forked rank's parent, the rank server, outlives the launcher: the rank watches for that)."""
    run_dir = tmp_path / "run"
    proc = cli.start("launch", *LONG, f"launcher.start_method={start_method}", "--run-dir",
                     str(run_dir))
    _wait_for_steps(run_dir, proc)
    workers = set(ranks_of(run_dir))
    assert len(workers) == 2, processes_mentioning(str(run_dir))
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, not its process group
    proc.wait()
    left = survivors(lambda: workers | set(processes_mentioning(str(run_dir))), within_s=10)
    assert not left, f"workers {sorted(left)} still ran 10 s after their launcher was killed"
    print(f"workers gone {time.monotonic() - killed:.1f} s after the launcher was killed")


@pytest.fixture
def small_disk(tmp_path):
    """A 14 MiB file system of its own (tmpfs): room for one checkpoint of the tiny model, not
    two. Needs root (`mount`); skipped, with the reason, where not permitted."""
    import subprocess

    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({mounted.stderr.strip()}); needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("how", [pytest.param((), id="sync"),
                                 pytest.param(("checkpoint.async_save=true",), id="async",
                                              marks=pytest.mark.slow)])
def test_a_full_disk_fails_loudly_and_loses_nothing(cli, small_disk, tmp_path, how):
    """The disk fills up during the second save: the run stops (exit 1) saying the file system is
    full, how much room a checkpoint needs and how much there is at the run dir; it commits nothing
    and takes the half-written save along, and the newest committed checkpoint stays the first,
    whole; once there is room, a relaunch resumes from it. The old code said "no Python error
    recorded" (DCP's CheckpointException escapes torch's error recorder) or, when the half-written
    save had left no room for the ranks' error files, that they could not be read."""
    import re
    import subprocess

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from partrain.checkpoint import store
    from partrain.checkpoint.verify import problems

    run_dir = small_disk / "run"
    common = ("launcher.device=cpu", "parallel.dp=2", "train.seq_len=64", "train.eval_every=0",
              "checkpoint.every=2", "train.max_steps=4")
    res = cli.run("launch", *common, *how, "--run-dir", str(run_dir))
    text = res.stdout + res.stderr
    said = " ".join(text.split())
    assert res.returncode == 1, text
    assert "Traceback" not in text and "no Python error recorded" not in text, text
    # A rank's own error, not the launcher's guess from an empty error file.
    background = " (in the background)" if how else ""
    assert (f"failed: RuntimeError: saving the checkpoint of step 4{background} failed: the run "
            "dir's file system is full") in said, said
    room = re.search(rf"needs about ([\d,]+) bytes, ([\d,]+) free at {re.escape(str(run_dir))} ",
                     said)
    assert room, said
    need, free = (int(n.replace(",", "")) for n in room.groups())
    root = run_dir / store.CHECKPOINTS
    [kept] = store.committed(root)
    assert kept.step == 2
    assert free < need
    assert f"Nothing of it was kept; the newest checkpoint is still {kept.path} (step 2)" in said
    assert "Free space there, then relaunch to resume from it" in said
    # Nothing half-written: no step-4 (committed or not), no temporary directory, no pointer.
    assert sorted(p.name for p in root.iterdir()) == [store.LATEST, "step-00000002"]
    assert (root / store.LATEST).read_text() == "step-00000002\n"
    assert problems(kept.path) == []
    dcp_to_torch_save(kept.path, tmp_path / "kept.pt")  # every tensor of it reads back
    tensors = torch.load(tmp_path / "kept.pt")
    assert {key.split(".")[0] for key in tensors} == {"model", "optim", "rng"}
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = cli.run("launch", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from step 2" in resumed.stdout
    assert [c.step for c in store.committed(root)] == [2, 4]
    assert not store.leftovers(root)
    # The room said was the room the save took once there was some.
    took = store.dir_bytes(store.newest(root).path)
    assert abs(took - need) < 0.01 * need, (took, need)


@pytest.mark.slow
def test_a_failed_resume_leaves_the_run_dirs_config_as_it_was(cli, tmp_path):
    """A resume whose ranks fail before they save anything restores config.yaml: the run dir
    still describes what its checkpoints were trained with, not the failed try's overrides."""
    run_dir = tmp_path / "run"
    common = ("launcher.device=cpu", "parallel.dp=2", "train.seq_len=64", "train.eval_every=0")
    first = cli.run("launch", *common, "train.max_steps=2", "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stderr[-2000:]
    before = (run_dir / "config.yaml").read_text()
    failed = cli.run("launch", "--resume", str(run_dir), "train.max_steps=4", "optim.lr=0.001",
                     env={"PARTRAIN_TEST_FAULT": "1:3"})
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-2000:]
    assert "changed on resume: optim.lr" in failed.stdout
    assert "injected fault" in failed.stdout + failed.stderr
    assert (run_dir / "config.yaml").read_text() == before
    # The command the failure message gives would resume without the overrides: said.
    assert (f"{run_dir / 'config.yaml'} is as before this resume, which saved nothing: to resume "
            f"with its overrides again, partrain launch --resume {run_dir} train.max_steps=4 "
            "optim.lr=0.001") in " ".join(failed.stderr.split()), failed.stderr[-2000:]
    again = cli.run("launch", "--resume", str(run_dir), "train.max_steps=3", "--dry-run")
    assert again.returncode == 0 and "changed on resume: train.max_steps 2 -> 3" in again.stdout, \
        again.stdout[-2000:] + again.stderr[-2000:]

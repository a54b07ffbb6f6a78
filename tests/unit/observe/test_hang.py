"""The hang watch's parts, in one process: the limit it takes from the config, when a rank calls
a step hung (twice the limit for the first step of a start; saves and evaluations timed only in
one collective, and a quiet rank reporting where it is once another did),
what its report says, the launcher's summary of every report, and the launcher's signal that
fetches the stack of a rank that could not report (a real child process, a real signal).
Through the CLI with real ranks: tests/integration/test_hang.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from partrain.observe import hang, hang_launcher
from partrain.observe.hang import HangWatch
from partrain.observe.hang_launcher import summary


@pytest.mark.parametrize("hang_timeout_s, collective_timeout_s, limit", [
    (None, 120, 40), (None, 30, 10), (None, 2, None), (0, 120, None), (7, 120, 7)])
def test_the_limit_from_the_launcher_section(hang_timeout_s, collective_timeout_s, limit):
    launcher = SimpleNamespace(hang_timeout_s=hang_timeout_s,
                               collective_timeout_s=collective_timeout_s)
    assert hang.hang_limit(launcher) == limit


def _watch(tmp_path, limit_s):
    fired = []
    watch = HangWatch(tmp_path, rank=0, world_size=1, limit_s=limit_s, on_hang=fired.append)
    return watch.start(), fired


def _wait_for(fired, seconds):
    deadline = time.monotonic() + seconds
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    return fired


def test_a_step_without_progress_is_a_hang_and_the_report_says_where(tmp_path):
    (tmp_path / "logs").mkdir()
    watch, fired = _watch(tmp_path, 0.3)
    watch.begin(1)
    watch.end(1)
    watch.begin(2)
    report = _wait_for(fired, 10)[0]
    watch.stop()
    assert (report["rank"], report["step"], report["phase"], report["first_step"]) == (
        0, 2, "in step 2", False)
    assert report["idle_s"] >= 0.3 and report["limit_s"] == 0.3
    # The main thread (this test) was in _wait_for's sleep: in no collective, and not in
    # partrain's code either, so only the stack names it.
    assert "collective" not in report
    assert any("test_hang.py" in frame and "_wait_for" in frame for frame in report["stack"])
    written = json.loads((tmp_path / "logs" / "hang" / "rank-0.json").read_text())
    assert written == report


def test_the_first_step_of_a_start_gets_twice_the_limit(tmp_path):
    (tmp_path / "logs").mkdir()
    watch, fired = _watch(tmp_path, 0.5)
    watch.begin(1)
    assert not _wait_for(fired, 0.8)  # past the limit, within twice it
    report = _wait_for(fired, 10)[0]
    watch.stop()
    assert report["first_step"] and report["limit_s"] == 1.0
    lines = summary(tmp_path, [report])
    assert lines[0].startswith("hang: no rank made progress for 1 s (twice "
                               "launcher.hang_timeout_s: the first step of a start) in step 1")


def test_saves_and_evaluations_are_not_timed_nor_before_the_first_step(tmp_path):
    (tmp_path / "logs").mkdir()
    watch, fired = _watch(tmp_path, 0.2)
    assert not _wait_for(fired, 0.6)  # building the model: not timed
    watch.begin(1)
    watch.end(1)
    with watch.quiet("in a save"):
        assert not _wait_for(fired, 0.6)
    assert _wait_for(fired, 10)  # the clock runs again after it
    watch.stop()


def test_a_quiet_rank_reports_where_it_is_once_another_rank_reported_and_goes_on(tmp_path):
    """Rank 0 is writing its part of a checkpoint (quiet, in no collective) when rank 1, waiting
    for it, reports a hang: rank 0 writes its own report (`follows`), without ending; a report
    from before this start is not followed."""
    directory = tmp_path / "logs" / hang.HANG_DIR
    directory.mkdir(parents=True)
    hang.write_json(directory / "rank-1.json", _report(1, world=2, time=time.time() - 60))
    fired = []
    watch = HangWatch(tmp_path, rank=0, world_size=2, limit_s=0.2, on_hang=fired.append).start()
    watch.begin(2)
    watch.end(2)
    with watch.quiet("in the checkpoint save after step 2"):
        time.sleep(0.8)  # twice the limit, and more: no collective waited in, nothing to follow
        assert not (directory / "rank-0.json").exists()
        hang.write_json(directory / "rank-1.json", _report(1, world=2, quiet=True,
                                                          phase="in the checkpoint save"))
        deadline = time.monotonic() + 10
        while not (directory / "rank-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    watch.stop()
    mine = json.loads((directory / "rank-0.json").read_text())
    assert (mine["follows"], mine["phase"], mine["step"]) == (
        True, "in the checkpoint save after step 2", 2)
    assert not fired
    lines = summary(tmp_path, hang.read_reports(tmp_path))
    # The headline is the reporting rank's, not the follower's.
    assert lines[0] == ("hang: no rank made progress for 5 s (one wait in one collective, near "
                        "launcher.collective_timeout_s: a save or an evaluation is not timed as "
                        "a whole) in the checkpoint save; who waits on whom:"), lines


def test_a_quiet_wait_is_timed_until_shortly_before_the_collective_timeout(tmp_path):
    """Twice the limit at least; with a collective timeout, QUIET_MARGIN_S before it (a peer
    deleting pruned checkpoints at the run's end is slow, not stuck)."""
    assert HangWatch(tmp_path, 0, 2, 40, collective_timeout_s=120).quiet_limit_s == 105
    assert HangWatch(tmp_path, 0, 2, 5, collective_timeout_s=12).quiet_limit_s == 10
    assert HangWatch(tmp_path, 0, 2, 5).quiet_limit_s == 10
    assert HangWatch(tmp_path, 0, 2, None, collective_timeout_s=120).quiet_limit_s is None


def test_no_limit_no_thread(tmp_path):
    watch, fired = _watch(tmp_path, None)
    assert watch._thread is None
    watch.begin(1)
    assert not _wait_for(fired, 0.3)


def _report(rank, world=4, step=3, **extra):
    return {"rank": rank, "world_size": world, "step": step, "phase": f"in step {step}",
            "time": time.time(),
            "limit_s": 5, "first_step": False, "stack": ["x.py:1 in f"], **extra}


def test_the_summary_groups_ranks_by_where_they_wait(tmp_path):
    tp = {"op": "all_reduce", "group": "the tp group", "ranks": [0, 1]}
    reports = [_report(0, collective=tp, at="partrain/parallel/tp_collectives.py:45 in _all_reduce"),
               _report(2, collective=tp, at="partrain/parallel/tp_collectives.py:45 in _all_reduce"),
               _report(1, at="partrain/train/loop.py:9 in run_step", code="time.sleep(9)")]
    lines = summary(tmp_path, reports)
    assert lines[0] == ("hang: no rank made progress for 5 s (launcher.hang_timeout_s=5) in step "
                        "3; who waits on whom:")
    assert lines[1] == ("  ranks 0, 2 wait in all_reduce on the tp group (ranks 0, 1), called at "
                        "partrain/parallel/tp_collectives.py:45 in _all_reduce")
    assert lines[2] == ("  rank 1 is in no collective: at partrain/train/loop.py:9 in run_step: "
                        "time.sleep(9)")
    assert lines[3] == "  the ranks in no collective are the ones the others wait for"
    assert lines[4].startswith("  rank 3 did not report") and "no stack of it was dumped" in lines[4]
    assert summary(tmp_path, []) == []


def test_every_rank_at_one_place_says_a_slow_step_looks_so_too(tmp_path):
    """A step of 5.1 s under a 5 s limit: every rank reported the same wait, none behind, and the
    summary read as a hang in DDP's all-reduce (a reviewer's run). It now says that a step
    slower than the limit looks like this, and which keys to raise; not where a rank is behind."""
    ddp = {"op": "all_reduce", "group": None, "ranks": None}
    same = [_report(rank, world=2, collective=ddp, at="partrain/parallel/data.py:134 in backward")
            for rank in (0, 1)]
    said = summary(tmp_path, same)
    assert said[-2] == ("  every rank is at the same place and none is behind: a step slower "
                        "than the 5 s limit looks like this too; if the steps are that slow, "
                        "raise launcher.hang_timeout_s (and launcher.collective_timeout_s, above "
                        "twice it)"), said
    behind = [same[0], _report(1, world=2, at="partrain/train/loop.py:9 in run_step")]
    assert not any("slower than" in line for line in summary(tmp_path, behind))
    assert not any("slower than" in line for line in summary(tmp_path, same[:1]))


def test_a_rank_that_did_not_report_is_found_in_its_faulthandler_dump(tmp_path):
    """A real faulthandler dump, from a process whose main thread runs in a partrain/train/rank.py
    (as every rank's does) that calls into another partrain module, stuck there in the standard
    library."""
    package = tmp_path / "src" / "partrain" / "train"
    package.mkdir(parents=True)
    (package / "stuck.py").write_text(
        "import faulthandler, sys, time\n"
        "def wait():\n"
        "    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)\n")
    (package / "rank.py").write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\nimport stuck\nstuck.wait()\n")
    log = tmp_path / "logs" / "rank-1.log"
    log.parent.mkdir()
    with open(log, "w") as err:
        subprocess.run([sys.executable, str(package / "rank.py"), str(package)], stderr=err,
                       check=True, timeout=60)
    assert hang_launcher.dumped_at(log) == "partrain/train/stuck.py:3 in wait"
    lines = summary(tmp_path, [_report(0, world=2)])
    assert ("  rank 1 did not report (its main thread holds the GIL, or its node is gone): its "
            "stack, dumped on its launcher's signal, is at partrain/train/stuck.py:3 in "
            "wait") in lines


def test_the_launcher_signals_a_worker_that_did_not_report(tmp_path):
    """A real child of this process named like a worker, listening as workers do: once a report
    appears, the requester sends it DUMP_SIGNAL and its stack lands in its log."""
    log = tmp_path / "rank-1.log"
    code = ("import faulthandler, signal, sys, time\n"
            f"faulthandler.register({int(hang.DUMP_SIGNAL)}, file=sys.stderr, all_threads=True)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    with open(log, "w") as err:
        child = subprocess.Popen([sys.executable, "-c", code, "partrain.train"], stderr=err,
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in hang_launcher.local_workers()
        (tmp_path / "logs" / "hang").mkdir(parents=True)
        with hang_launcher.DumpRequester(tmp_path, poll_s=0.05, grace_s=0.1):
            hang.write_json(tmp_path / "logs" / "hang" / "rank-0.json", _report(0, pid=-1))
            deadline = time.monotonic() + 20
            while "most recent call first" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "most recent call first" in log.read_text()
        assert child.poll() is None  # asked for its stack, not ended
        # A report from before the requester started (a previous launch's) asks nobody.
        assert hang.read_reports(tmp_path, since=time.time() + 1) == []
    finally:
        child.kill()
        child.wait()


# Under the main-module guard: each fork imports this script again as __mp_main__ (forkserver
# prepares a child as spawn does), and without the guard that import started processes of its own
# and failed, so the forks died within a second; on a busy machine they were gone before the test
# looked (a flake: ProcessLookupError reading their /proc status, or no workers found).
RANK_SERVER_LAUNCHER = """
import multiprocessing, time
from multiprocessing import forkserver

if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(["partrain.launch.rank_server"])
    ranks = [multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
             for _ in range(2)]
    for rank in ranks:
        rank.start()
    print(forkserver._forkserver._forkserver_pid, *(rank.pid for rank in ranks), flush=True)
    time.sleep(60)
"""


def _ignores(pid: int, signum: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigIgn line for {pid}")


def test_a_launchers_workers_are_its_rank_servers_forks_not_the_server(tmp_path):
    """launcher.start_method=forkserver, with multiprocessing's real forkserver: the launcher's
    workers (the ones it signals) are the server's two forks, not the server itself, whose command
    line names partrain.train too (its preload). The server ignores SIGUSR2 (rank_server.py), and
    so do its forks until a rank takes the signal."""
    script = tmp_path / "launcher.py"
    script.write_text(RANK_SERVER_LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        server, *ranks = map(int, launcher.stdout.readline().split())
        assert b"partrain.launch.rank_server" in Path(f"/proc/{server}/cmdline").read_bytes()
        assert hang_launcher.local_workers(launcher.pid) == sorted(ranks)
        for pid in (server, *ranks):
            assert _ignores(pid, signal.SIGUSR2), pid
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_without_nccl_there_is_no_flight_recorder_to_dump(tmp_path):
    """This CPU build of torch has no NCCL: the dump is skipped (on CUDA it writes
    logs/nccl-trace/rank-N; no GPU here to show it)."""
    watch = HangWatch(tmp_path, rank=0, world_size=1, limit_s=1, cuda=True)
    watch._dump_flight_recorder()
    assert not (tmp_path / "logs" / hang.TRACE_DIR).exists()
    env = hang.flight_recorder_env(tmp_path)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "logs" / "nccl-trace" / "rank-")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0


def test_the_dump_signal_is_not_one_partrain_or_slurm_uses():
    assert hang.DUMP_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    assert signal.SIGRTMIN < hang.DUMP_SIGNAL <= signal.SIGRTMAX


SUSPENDED = """
import sys, time
from pathlib import Path
from partrain.observe.hang import HangWatch
watch = HangWatch(Path(sys.argv[1]), rank=0, world_size=1, limit_s=4,
                  on_hang=lambda report: print("hang", flush=True)).start()
watch.begin(1)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_suspended_process_is_not_a_hang_once_it_goes_on(tmp_path):
    """SIGSTOP for longer than the limit, then SIGCONT (Ctrl-Z and `fg`; SLURM's suspend): the
    monotonic clock ran on while the process was stopped, and the run was ended as a hang the
    moment it went on (a reviewer's run). The watch now moves its clock past a suspension; a
    step that then makes no progress is still a hang."""
    child = subprocess.Popen([sys.executable, "-c", SUSPENDED, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline() == "ready\n"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(10)  # beyond the first step's limit, 2 x 4 s
        os.kill(child.pid, signal.SIGCONT)
        import select

        said, _, _ = select.select([child.stdout], [], [], 3)
        assert not said, f"the suspension was taken for a hang: {child.stdout.readline()!r}"
        assert child.stdout.readline() == "hang\n"  # 8 s of no progress after it went on
    finally:
        child.kill()
        child.wait()


GIL_HELD = """
import ctypes, sys, time
from pathlib import Path
from partrain.observe.hang import HangWatch
fired = []
watch = HangWatch(Path(sys.argv[1]), rank=0, world_size=1, limit_s=1,
                  on_hang=fired.append).start()
watch.begin(1); watch.end(1); watch.begin(2)  # past the first step's doubled limit
libc = ctypes.PyDLL(None)
for _ in range(3):
    libc.sleep(6)  # a C call that holds the GIL and uses no CPU: the watch polls late, idle
    time.sleep(0.3)
    if fired:
        break
print("hang" if fired else "no hang", flush=True)
"""


@pytest.mark.slow
def test_a_main_thread_that_blocks_holding_the_gil_is_still_a_hang(tmp_path):
    """Its late, CPU-idle polls look like a suspension: each was taken for one and the clock
    moved on, so a stall in a C call holding the GIL was never reported (today's review).
    A suspension is credited once per step."""
    res = subprocess.run([sys.executable, "-c", GIL_HELD, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert res.stdout.strip() == "hang", res.stdout + res.stderr[-2000:]

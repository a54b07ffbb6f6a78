"""`partrain runs` (launch/runs.py): each run dir's state, last step and loss, read from what it
holds, on run dirs made by hand: done, failed, running, killed, preempted, prepared, garbage.
It reads only, and what it cannot make sense of is `unknown`, never an error. And what a launch
records for it (logs/state.json) and prints after a run (start.py)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from partrain.launch.runs import read_run


def _run_dir(root, name, *, max_steps=10, steps=(), state=None, pid=None, host=None,
             checkpoint=None, reason="final", error=False):
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: {name}\ntrain:\n  max_steps: {max_steps}\n")
    if steps:
        lines = [json.dumps({"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0}) for s in steps]
        lines.insert(1, json.dumps({"step": steps[0], "val_loss": 9.0}))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if state is not None:
        record = {"state": state, "pid": pid or os.getpid(), "host": host or socket.gethostname()}
        (run / "logs" / "state.json").write_text(json.dumps(record))
    if checkpoint is not None:
        ckpt = run / "checkpoints" / f"step-{checkpoint:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / ".metadata").write_bytes(b"")
        (ckpt / "meta.json").write_text(json.dumps({"step": checkpoint, "reason": reason}))
        (ckpt / "config.yaml").write_text((run / "config.yaml").read_text())
    if error:
        (run / "logs" / "error-rank-1.json").write_text("{}")
    return run


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def runs_root(tmp_path):
    root = tmp_path / "runs"
    _run_dir(root, "done", steps=range(1, 11), state="done", checkpoint=10)
    _run_dir(root, "failed", steps=range(1, 4), state="failed", error=True)
    _run_dir(root, "running", steps=range(1, 6), state="running")
    _run_dir(root, "killed", steps=range(1, 3), state="running", pid=_dead_pid())
    _run_dir(root, "elsewhere", state="running", pid=_dead_pid(), host="another-node-0")
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "config.yaml").write_bytes(b"\xff\x00: [")
    (garbage / "metrics.jsonl").write_bytes(b"\x00\xffnot json\n{\"step\": \"x\", \"loss\": 1}\n")
    (garbage / "logs").mkdir()
    (garbage / "logs" / "state.json").write_text('["not", "an", "object"]')
    os.mkfifo(garbage / "checkpoints")  # a pipe would block a reader that opens it
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("not a run")
    (root / "a-file.txt").write_text("not a directory: not listed")
    return root


EXPECTED = {"done": ("done", 10, 4.0, 10), "failed": ("failed", 3, 4.7, None),
            "running": ("running", 5, 4.5, None), "killed": ("killed", 2, 4.8, None),
            "elsewhere": ("running", None, None, None), "garbage": ("unknown", None, None, None),
            "foreign": ("unknown", None, None, None)}


def test_each_state_as_json(run_main, runs_root):
    result = run_main("runs", "--root", str(runs_root), "--json")
    assert result.code == 0, result.stderr
    listed = {os.path.basename(run["path"]): run for run in json.loads(result.stdout)}
    assert {name: (run["state"], run["step"], run["loss"] and round(run["loss"], 6),
                   run["checkpoint"]) for name, run in listed.items()} == EXPECTED
    assert listed["done"]["max_steps"] == 10 and listed["garbage"]["max_steps"] is None
    assert listed["elsewhere"]["host"] == "another-node-0"


def test_the_table(run_main, runs_root, monkeypatch):
    monkeypatch.chdir(runs_root.parent)
    result = run_main("runs")  # ./runs by default
    assert result.code == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["STATE", "STEP", "LOSS", "CKPT", "RUN", "DIR"]
    by_dir = {row.split()[-1]: row.split()[:-1] for row in rows}
    assert by_dir["runs/done"] == ["done", "10/10", "4.0000", "10"]
    assert by_dir["runs/failed"] == ["failed", "3/10", "4.7000", "-"]
    assert by_dir["runs/garbage"] == ["unknown", "-", "-", "-"]
    assert len(rows) == len(EXPECTED)


@pytest.mark.parametrize("made, state", [
    (dict(steps=range(1, 11), checkpoint=10), "done"),
    (dict(steps=range(1, 5), error=True), "failed"),
    (dict(steps=range(1, 5), checkpoint=4, reason="preemption"), "preempted"),
    (dict(), "prepared"),  # `partrain slurm` wrote it; nothing trained yet
    (dict(steps=range(1, 5)), "unknown"),
])
def test_a_run_dir_without_a_state_file_is_read_from_what_it_holds(tmp_path, made, state):
    assert read_run(_run_dir(tmp_path, "old", **made)).state == state


def test_one_run_dir_as_root_is_itself(run_main, runs_root):
    result = run_main("runs", "--root", str(runs_root / "done"), "--json")
    assert [run["state"] for run in json.loads(result.stdout)] == ["done"]


def test_a_run_dirs_checkpoints_are_no_runs(run_main, runs_root):
    """`--root RUN_DIR/checkpoints`: each checkpoint holds a config.yaml, and is not a run."""
    result = run_main("runs", "--root", str(runs_root / "done" / "checkpoints"), "--json")
    assert result.code == 0 and json.loads(result.stdout) == [], result.stdout


def test_no_runs_and_a_missing_root(run_main, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_main("runs")
    assert result.code == 0 and "./runs does not exist" in result.stdout
    assert run_main("runs", "--json").stdout == "[]\n"
    result = run_main("runs", "--root", "elsewhere")
    assert result.code == 2 and "--root elsewhere does not exist" in result.stderr


def test_it_writes_nothing(run_main, runs_root):
    before = sorted((p, p.stat().st_mtime_ns) for p in runs_root.rglob("*")
                    if not p.is_fifo())
    run_main("runs", "--root", str(runs_root))
    assert sorted((p, p.stat().st_mtime_ns) for p in runs_root.rglob("*")
                  if not p.is_fifo()) == before


@pytest.mark.parametrize("code, state", [(0, "done"), (1, "failed"), (3, "preempted"),
                                         (4, "diverged"), (130, "interrupted")])
def test_launch_records_the_state_its_workers_ended_in(run_main, tmp_path, monkeypatch, code,
                                                       state):
    """The launcher says `running` before its workers start, and how they ended after."""
    import partrain.launch.local as local

    seen = []

    def workers(run_dir, spec, console_print):
        seen.append(json.loads((run_dir / "logs" / "state.json").read_text())["state"])
        return code

    monkeypatch.setattr(local, "launch_workers", workers)
    monkeypatch.chdir(tmp_path)
    environment = dict(os.environ)
    # spawn: no rank server to start for workers that are not started
    result = run_main("launch", "launcher.device=cpu", "parallel.dp=1",
                      "launcher.start_method=spawn", "--run-dir", "run")
    assert result.code == code and seen == ["running"]
    # What the ranks' environment needed (OMP_NUM_THREADS, the launcher's pid) is not left in
    # this process's for the next launch from it (a user's OMP_NUM_THREADS would be kept).
    assert dict(os.environ) == environment
    record = json.loads((tmp_path / "run" / "logs" / "state.json").read_text())
    assert (record["state"], record["exit_code"]) == (state, code)
    assert read_run(tmp_path / "run").state == state
    assert "next:" not in result.stdout  # no checkpoint was saved: nothing to sample or resume


def test_a_forked_launch_leaves_the_environment_as_it_was(run_main, tmp_path, monkeypatch):
    """The rank server runs with the run dir in the environment (PARTRAIN_RUN_DIR, for anyone
    looking for the run's processes); the next launch from this process does not inherit it."""
    import partrain.launch.local as local
    from partrain.launch.forked import RUN_DIR_ENV

    seen = []

    def workers(run_dir, spec, console_print):
        seen.append(os.environ[RUN_DIR_ENV])
        return 0

    monkeypatch.setattr(local, "launch_workers", workers)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    environment = dict(os.environ)
    result = run_main("launch", "launcher.device=cpu", "parallel.dp=1",
                      "launcher.start_method=forkserver", "--run-dir", "run")
    assert result.code == 0, result.stderr
    assert seen == [str(tmp_path / "run")] and dict(os.environ) == environment


def test_next_steps_name_the_run_dir(tmp_path):
    from partrain.launch.start import next_steps
    from tests.unit.helpers import compose, quick

    run = _run_dir(tmp_path, "my run", checkpoint=10)
    lines = next_steps(run, quick("train.max_steps=10"))
    quoted = f"'{run}'"
    assert [line.split("   #")[0] for line in lines] == [
        f"next: partrain sample {quoted} --prompt 'def main('",
        f"next: partrain export {quoted} --out 'hf/my run'",
        f"next: partrain launch --resume {quoted} train.max_steps=20"]
    moe = next_steps(run, compose("model=tiny-moe", "train.max_steps=10"))
    assert not any("export" in line for line in moe)  # --format hf refuses a mixture of experts
    assert next_steps(_run_dir(tmp_path, "none"), quick()) == []


@pytest.fixture
def live_launch():
    """Another process on this host, standing in for a launcher that runs."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _says_running(run_dir, pid, **extra):
    from partrain.launch.runs import _start_ticks

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    record = {"state": "running", "pid": pid, "started": _start_ticks(pid),
              "host": socket.gethostname(), "nnodes": 1, **extra}
    (run_dir / "logs" / "state.json").write_text(json.dumps(record))


@pytest.mark.parametrize("resuming", [False, True])
def test_a_run_dir_a_launch_runs_in_takes_no_other(tmp_path, live_launch, resuming):
    """A resume, or the same command again, while the run trains: both would write and prune
    checkpoints in one run dir (a user's second shell, a job submitted twice)."""
    from partrain.errors import ConfigError
    from partrain.launch.rundir import check_not_in_use

    run_dir = tmp_path / "run"
    _says_running(run_dir, live_launch.pid)
    flag = "--resume" if resuming else "--run-dir"
    with pytest.raises(ConfigError, match=f"{flag} {run_dir} is in use: a launch runs in it "
                                          f"\\(pid {live_launch.pid}, logs/state.json\\)") as info:
        check_not_in_use(run_dir, 1, resuming)
    # What to do next fits both commands that meet it (`launch`; `slurm --resume`, which submits
    # a job: "launch again" was said to it), and a resume is not sent to a new run dir.
    said = str(info.value)
    assert "then run this command again" in said and "launch again" not in said, said
    assert ("give a new --run-dir" in said) is not resuming, said
    # A launch of several nodes meets the one of its own job's node 0 (here on one host: network
    # namespaces); one of a single node is refused by it, as it is by a single-node launch.
    _says_running(run_dir, live_launch.pid, nnodes=2)
    check_not_in_use(run_dir, 2, resuming)
    with pytest.raises(ConfigError, match="is in use"):
        check_not_in_use(run_dir, 1, resuming)
    _says_running(run_dir, live_launch.pid, nnodes=1)
    with pytest.raises(ConfigError, match="is in use"):
        check_not_in_use(run_dir, 2, resuming)


HOLDER = """
import sys, time
from pathlib import Path
from partrain.launch.rundir import hold_run_dir
with hold_run_dir(Path(sys.argv[1]), int(sys.argv[2]), False):
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_run_dir_lock_is_one_launchs_per_node_and_goes_with_it(tmp_path):
    """hold_run_dir, a real flock held by another process: this node's lock refuses a second
    holder naming the first, another node's is its own, and once the holder is killed outright
    (no handler runs) the lock is free again at once."""
    from partrain.errors import ConfigError
    from partrain.launch.rundir import hold_run_dir, lock_path

    run_dir = tmp_path / "run"  # not made yet: a fresh run's launch holds it before it writes
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for resuming, flag in ((False, "--run-dir"), (True, "--resume")):
            with pytest.raises(ConfigError, match=f"{flag} {run_dir} is in use: a launch runs in it "
                                                  f"\\(pid {holder.pid}, its lock "):
                with hold_run_dir(run_dir, 0, resuming):
                    pass
        with hold_run_dir(run_dir, 1, False):  # node 1 of the same job, on this host
            pass
    finally:
        holder.kill()
        holder.wait()
    with hold_run_dir(run_dir, 0, False):
        assert lock_path(run_dir, 0).read_text() == f"{os.getpid()}\n"
    assert not lock_path(run_dir, 0).exists()  # let go and removed: nothing piles up in /tmp
    assert not run_dir.exists()


SLOW_HOLDER = """
import fcntl, os, sys, time
from pathlib import Path
path = Path(sys.argv[1])
path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
time.sleep(60)
"""


@pytest.mark.parametrize("writes_after_s", [0.5, 60])
def test_a_launch_refused_between_the_holders_flock_and_its_pid_names_it(
        tmp_path, monkeypatch, writes_after_s):
    """Two launches started together: the second met the lock after the first took its flock and
    before it wrote its pid, and said `pid unknown` and `kill -USR2 unknown` (CI, stop 55). It now
    waits a moment for the pid; a holder that never writes one is named by its lock alone."""
    from partrain.errors import ConfigError
    from partrain.launch import rundir
    from partrain.launch.rundir import hold_run_dir, lock_path

    monkeypatch.setattr(rundir, "PID_WRITTEN_WITHIN_S", 2.0)
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", SLOW_HOLDER, str(lock_path(run_dir, 0)),
                               str(writes_after_s)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as refused:
            with hold_run_dir(run_dir, 0, False):
                pass
    finally:
        holder.kill()
        holder.wait()
    said = str(refused.value)
    assert "unknown" not in said, said
    if writes_after_s < rundir.PID_WRITTEN_WITHIN_S:
        assert f"(pid {holder.pid}, its lock " in said and f"kill -USR2 {holder.pid}`" in said
    else:
        assert "its pid not written there" in said and "kill -USR2" not in said, said


def test_a_pid_given_to_another_process_since_is_not_the_launch(tmp_path, live_launch):
    """state.json says running with the pid of a launcher that died without a word, and the
    system has since given that pid to another process (here: a live process whose start time
    is not the recorded one): neither `runs` nor a new launch takes it for the launch."""
    from partrain.launch.rundir import check_not_in_use
    from partrain.launch.runs import _start_ticks

    run_dir = tmp_path / "run"
    _says_running(run_dir, live_launch.pid, started=_start_ticks(live_launch.pid) - 1)
    check_not_in_use(run_dir, 1, resuming=True)
    assert read_run(run_dir).state == "killed"
    _says_running(run_dir, live_launch.pid)
    assert read_run(run_dir).state == "running"


def test_the_last_step_is_a_whole_number_not_true(tmp_path):
    """A line `{"step": true, "loss": 2.5}` showed as step True (`isinstance(True, int)`)."""
    from partrain.launch.runs import last_step

    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 3.0}\n{"step": true, "loss": 2.5}\n'
                                            '{"step": 8, "loss": true}\n')
    assert last_step(tmp_path) == (8, None)
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 3.0}\n{"step": true, "loss": 2.5}\n')
    assert last_step(tmp_path) == (7, 3.0)

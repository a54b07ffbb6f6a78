"""What each run dir under a folder is doing: `partrain runs` reads, never writes, and a run dir
it cannot make sense of (half written, foreign) is shown as `unknown`, never an error.

The state comes from `logs/state.json`, which the launcher of node 0 writes when its workers
start (`running`, with its pid and host) and when they end (from its exit code: `done`,
`failed`, `preempted`, `diverged`, `interrupted`). A `running` launcher that is gone from this
host was killed outright (`killed`); one on another host cannot be asked and stays `running`.
A run dir from before this file (or a copy without logs/) is read from what it holds: an error
a rank recorded, a preemption checkpoint, the last step against train.max_steps; a run dir
`partrain slurm` prepared and nothing has trained in yet is `prepared`. The last step and its
loss are metrics.jsonl's last step line.
"""

import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from partrain.checkpoint import store
from partrain.config.frozen import CONFIG

STATE_FILE = Path("logs") / "state.json"
# The launcher's exit codes (launch/local.py, the CLI's 2) as a run's state.
ENDED = {0: "done", 1: "failed", 2: "failed", 3: "preempted", 4: "diverged", 130: "interrupted"}
TAIL_BYTES = 1 << 16  # metrics.jsonl is read from its end: its last step line is in there
SMALL_FILE_BYTES = 1 << 20  # state.json and config.yaml of a run are far smaller


def write_state(run_dir: Path, state: str, exit_code: int | None = None,
                nnodes: int = 1) -> None:
    """Record the run's state in logs/state.json, whole or not at all (a rename): with the
    launcher's pid, its start time (a pid the system gave to another process since is not this
    launcher) and host, and the launch's node count (the launchers of one job's other nodes may
    share the host: network namespaces, containers)."""
    record = {"state": state, "exit_code": exit_code, "pid": os.getpid(),
              "started": _start_ticks(os.getpid()), "host": socket.gethostname(),
              "nnodes": nnodes, "at": time.time()}
    path = run_dir / STATE_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.rename(path)


@dataclass
class RunInfo:
    """One run dir as `partrain runs` shows it; None where it does not say."""

    path: str
    state: str
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    checkpoint: int | None = None  # the newest committed checkpoint's step
    host: str | None = None  # where the launcher runs (or ran), when recorded
    updated: float | None = None  # the newest of its state, metrics and config, in seconds

    def as_json(self) -> dict:
        return asdict(self)


def _small_regular(path: Path, limit: int = SMALL_FILE_BYTES) -> bytes | None:
    """The bytes of a regular file of at most `limit` bytes; None for anything else (a pipe
    would block a read, a device never end)."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        with open(path, "rb") as f:
            return f.read(limit)
    except (OSError, ValueError):
        return None


def _json(path: Path) -> dict | None:
    raw = _small_regular(path)
    try:
        data = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def finished(run_dir: Path, max_steps: int) -> bool:
    """Whether the run dir's run ended: its last launch said `done` (logs/state.json), or its
    metrics reached `max_steps` (a run dir without that record)."""
    record = _json(run_dir / STATE_FILE)
    step, _ = last_step(run_dir)
    return (record is not None and record.get("state") == ENDED[0]) or \
        (step is not None and step >= max_steps)


def ended_done_at(run_dir: Path, max_steps: int) -> bool:
    """Whether the run dir's last launch ended `done` with its metrics at `max_steps` or past:
    trained to the end, whatever its newest checkpoint (checkpoint.save_last=false keeps none of
    the last step)."""
    record = _json(run_dir / STATE_FILE)
    step, _ = last_step(run_dir)
    return (record is not None and record.get("state") == ENDED[0]
            and step is not None and step >= max_steps)


def running_here(run_dir: Path) -> tuple[int, int] | None:
    """(pid, node count) of a launch that says it is running in the run dir, on this host and
    alive (a launch on another host, or one that died without a word, cannot be told from
    here)."""
    record = _json(run_dir / STATE_FILE)
    if record is None or record.get("state") != "running" or \
            record.get("host") != socket.gethostname() or record.get("pid") == os.getpid():
        return None
    nnodes = record.get("nnodes")
    return ((record["pid"], nnodes if isinstance(nnodes, int) else 1)
            if process_alive(record.get("pid"), record.get("started")) else None)


def _max_steps(run_dir: Path) -> int | None:
    import yaml

    raw = _small_regular(run_dir / CONFIG)
    try:
        cfg = yaml.safe_load(raw) if raw is not None else None
        value = cfg["train"]["max_steps"]
    except (yaml.YAMLError, TypeError, KeyError, RecursionError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def last_step(run_dir: Path) -> tuple[int | None, float | None]:
    """The last step line of metrics.jsonl (a line with a loss): its step and loss."""
    path = run_dir / "metrics.jsonl"
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            return None, None
        with open(path, "rb") as f:
            f.seek(max(0, info.st_size - TAIL_BYTES))
            lines = f.read(TAIL_BYTES).decode("utf-8", "replace").splitlines()
    except (OSError, ValueError):
        return None, None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # the first line cut by the seek, or one being written
        step = record.get("step") if isinstance(record, dict) and "loss" in record else None
        if isinstance(step, int) and not isinstance(step, bool):  # `true` is no step
            loss = record["loss"]
            return step, (float(loss) if isinstance(loss, (int, float))
                          and not isinstance(loss, bool) else None)
    return None, None


def process_alive(pid, started=None) -> bool:
    """Whether process `pid` runs, and is the one that started at `started` (clock ticks since
    boot, `_start_ticks`) where that was recorded."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    except OSError:
        return False
    now = _start_ticks(pid)
    return not (isinstance(started, int) and now is not None and now != started)


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22); None
    where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])  # after the name: state is field 3, starttime field 22
    except (OSError, IndexError, ValueError):
        return None


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except (OSError, ValueError):
        return None


def _recorded_state(record: dict) -> str:
    state = record.get("state")
    if state != "running":
        return state if state in ENDED.values() else "unknown"
    if record.get("host") == socket.gethostname() and not process_alive(record.get("pid"),
                                                                  record.get("started")):
        return "killed"  # the launcher ended without a word: SIGKILL, out of memory, a reboot
    return "running"


def _derived_state(run_dir: Path, step: int | None, max_steps: int | None,
                   newest: store.Checkpoint | None) -> str:
    """The state of a run dir that records none, from what it holds."""
    try:
        failed = any((run_dir / "logs").glob("error-rank-*.json"))
    except OSError:
        failed = False
    if failed:
        return "failed"
    done_at = max((s for s in (step, newest and newest.step) if s is not None), default=None)
    if max_steps is not None and done_at is not None and done_at >= max_steps:
        return "done"
    if newest is not None and newest.reason == "preemption":
        return "preempted"
    if step is None and newest is None and max_steps is not None:
        return "prepared"
    return "unknown"


def read_run(run_dir: Path) -> RunInfo:
    """What the run dir says of itself; `unknown` for whatever it does not."""
    step, loss = last_step(run_dir)
    max_steps = _max_steps(run_dir)
    newest = store.newest(run_dir / store.CHECKPOINTS)
    record = _json(run_dir / STATE_FILE)
    if record is not None:
        state = _recorded_state(record)
    else:
        state = _derived_state(run_dir, step, max_steps, newest)
    host = record.get("host") if record is not None and isinstance(record.get("host"), str) \
        else None
    times = [t for t in (_mtime(run_dir / STATE_FILE), _mtime(run_dir / "metrics.jsonl"),
                         _mtime(run_dir / CONFIG), _mtime(run_dir)) if t is not None]
    return RunInfo(str(run_dir), state, step, max_steps, loss,
                   newest.step if newest is not None else None, host,
                   max(times) if times else None)


def list_runs(root: Path) -> list[RunInfo]:
    """Every directory under `root`, oldest first; `root` itself when it is one run dir."""
    if (root / CONFIG).is_file() or (root / STATE_FILE).is_file():
        return [read_run(root)]
    runs = []
    with os.scandir(root) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            path = Path(root) / entry.name
            # A checkpoint holds a config.yaml too (`--root RUN_DIR/checkpoints`): not a run.
            if is_dir and not entry.name.startswith(".") and \
                    not (path / store.DCP_METADATA).exists():
                runs.append(read_run(path))
    return sorted(runs, key=lambda r: (r.updated or 0, r.path))


def render(runs: list[RunInfo]) -> list[str]:
    """The table `partrain runs` prints: state, step (of max_steps), loss, newest checkpoint,
    the run dir."""
    rows = [("STATE", "STEP", "LOSS", "CKPT", "RUN DIR")]
    for run in runs:
        step = "-" if run.step is None else str(run.step)
        if run.max_steps is not None:
            step += f"/{run.max_steps}"
        loss = "-" if run.loss is None else f"{run.loss:.4f}"
        ckpt = "-" if run.checkpoint is None else str(run.checkpoint)
        rows.append((run.state, step, loss, ckpt, run.path))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4]
            for row in rows]

"""Who waits on whom: a step that makes no progress (launcher.hang_timeout_s) becomes one summary.

Every rank runs a watch thread (HangWatch). The loop tells it when a step begins and ends. A rank
that has made no progress for the limit calls it a hang. The limit is hang_timeout_s, and twice
that until the first step of this start has ended: that step compiles (train.compile), builds NCCL
communicators and warms caches, so it is told apart by being the first, as torchtitan does with
its init and train timeouts; building the model and loading a checkpoint before it are not timed
(a collective there fails at launcher.collective_timeout_s).

Saves and evaluations (`quiet`) are not timed as a whole: writing a large checkpoint to a slow
file system may take any time. What is timed there is one wait: a main thread that waits in the
same collective until QUIET_MARGIN_S before launcher.collective_timeout_s (where gloo or NCCL
would fail with an error that names only the waiting rank; at least twice hang_timeout_s) calls
it a hang. So late, because a peer may be slow there and not stuck: rank 0 deleting pruned
checkpoints on a network file system at the end of the run while the others wait in its last
gather; such a wait failed at the collective timeout before, and fails no sooner now. A rank that is
`quiet` when another rank reports a hang writes its own report too, without ending (the agent ends
it): the rank stuck writing its part of a checkpoint is named as the one the others wait for.

On a hang the thread reads the main thread's Python stack: the torch.distributed collective it
waits in (which op, on which process group, with which ranks) and the partrain line that called
it, or, in none, the line it is at. It writes that to RUN_DIR/logs/hang/rank-N.json and every
thread's stack to the rank's log (faulthandler), waits a few seconds for the other ranks'
reports, records `Hang: ...` as its error and ends its process. The elastic agent then ends the
job, or restarts it under launcher.max_restarts, as for any failed rank; the launcher prints one
summary from every rank's report (hang_launcher.py's `summary`). The thread can look while the main thread waits:
c10d's collectives release the GIL while they block.

A rank whose main thread holds the GIL (stuck in C code) cannot report: once a report appears,
each node's launcher sends its ranks that have none DUMP_SIGNAL (hang_launcher.py), on which faulthandler, registered
at start, writes their stacks from C into their logs. Not SIGUSR2: that one is preemption.

On CUDA the launcher turns on PyTorch's NCCL flight recorder (flight_recorder_env): it dumps into
RUN_DIR/logs/nccl-trace/ on a collective timeout, and the watch dumps it there with its report;
`torchfrtrace RUN_DIR/logs/nccl-trace` reads who is at which collective sequence number.
"""

import faulthandler
import json
import linecache
import os
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

HANG_DIR = "hang"  # under RUN_DIR/logs/
TRACE_DIR = "nccl-trace"  # under RUN_DIR/logs/: the NCCL flight recorder's dumps
DUMP_SIGNAL = signal.SIGRTMIN + 3  # a real-time signal nothing else uses: the stacks, from C
FIRST_STEP_FACTOR = 2
GATHER_S = 5.0  # how long a rank that saw the hang waits for the others' reports
# A quiet rank's wait in one collective is a hang this long before the collective timeout: its
# report, the others' (GATHER_S) and the stacks are written before gloo or NCCL give up.
QUIET_MARGIN_S = 15.0
# A poll of the watch this much later than asked, with the process's CPU time all but still
# meanwhile (under a tenth of the delay), was a suspension: SIGSTOP (Ctrl-Z, SLURM's
# PreemptMode=SUSPEND, `scontrol suspend`), during which the monotonic clock runs on. Its length
# is not idleness: the clock of the watch moves past it.
SUSPENDED_AFTER_S = 5.0
PREFIX = "Hang: "  # the error a rank records; the launcher reads it from the error file
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_NOT_OURS = tuple(os.sep + name + os.sep for name in ("torch", "deepspeed", "site-packages"))


def hang_limit(launcher) -> int | None:
    """The hang timeout in seconds from the launcher section, or None when the watch is off."""
    value = launcher.hang_timeout_s
    if value is None:
        value = launcher.collective_timeout_s // 3
    return value or None


def flight_recorder_env(run_dir: Path) -> dict[str, str]:
    """The variables that turn on PyTorch's NCCL flight recorder for the workers, dumping into
    RUN_DIR/logs/nccl-trace/rank-N on a timeout (both spellings: torch renamed them in 2.7)."""
    prefix = str(run_dir / "logs" / TRACE_DIR / "rank-")
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def listen_for_dumps() -> None:
    """On DUMP_SIGNAL, every thread's stack to stderr (the rank's log once it is redirected: the
    descriptor is what counts), written from C. First thing in a worker: the signal's default
    action would end the process."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


class Hang(Exception):
    """A rank that made no progress for the hang timeout; its error file starts with PREFIX."""


class HangWatch:
    """One rank's watch (see the module docstring). `begin`/`end` a step, `quiet()` around what
    is not timed, `stop()` at the end. With no limit it does nothing."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, limit_s: float | None,
                 cuda: bool = False, on_hang=None, collective_timeout_s: float | None = None):
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.limit_s, self.cuda = limit_s, cuda
        self.quiet_limit_s = None if limit_s is None else max(
            FIRST_STEP_FACTOR * limit_s,
            (collective_timeout_s or 0) - QUIET_MARGIN_S)
        self.step = None  # the step in progress or last ended
        self.first_ended = False
        self.since = None  # monotonic time of the last progress; None = not timed
        self.progress = 0  # marks of progress (begin, end, a quiet part's end)
        self._credited = -1  # the mark whose clock a suspension last moved (once a mark)
        self.phase = "before the first step"
        self.quiet_now = False  # inside quiet(): only one long wait in a collective is a hang
        self._waiting = None  # (the frame the main thread waits in, since when), when quiet
        self.started = time.time()  # other ranks' reports from before this start are stale
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = None
        self.on_hang = on_hang or self._exit  # given the report; by default ends the process

    def start(self) -> "HangWatch":
        if self.limit_s:
            self._thread = threading.Thread(target=self._run, name="partrain-hang-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def begin(self, step: int) -> None:
        with self._lock:
            self.step, self.phase, self.since = step, f"in step {step}", time.monotonic()
            self.progress += 1

    def end(self, step: int) -> None:
        with self._lock:
            self.first_ended = True
            self.phase, self.since = f"after step {step}", time.monotonic()
            self.progress += 1

    @contextmanager
    def quiet(self, phase: str):
        """Not timed inside (a save, an evaluation), but for one long wait in a collective (see
        the module docstring); the clock restarts after it. `phase` says what it is (`doing`
        says it again inside)."""
        with self._lock:
            before, self.since = self.since, None
            self.quiet_now, self.phase, self._waiting = True, phase, None
        try:
            yield
        finally:
            with self._lock:
                self.since = time.monotonic() if before is not None else None
                self.quiet_now, self._waiting = False, None
                self.progress += 1

    def doing(self, phase: str) -> None:
        """What this quiet part does now (in the evaluation after step N, ...)."""
        with self._lock:
            self.phase = phase

    def stop(self) -> None:
        self._stopped.set()

    def _limit(self) -> float:
        return self.limit_s * (1 if self.first_ended else FIRST_STEP_FACTOR)

    def _run(self) -> None:
        poll = min(1.0, self.limit_s / 10)
        last, cpu = time.monotonic(), time.process_time()
        while not self._stopped.wait(poll):
            with self._lock:
                now, now_cpu = time.monotonic(), time.process_time()
                late = now - last - poll
                if late > SUSPENDED_AFTER_S and now_cpu - cpu < late / 10:
                    self._suspended(late)
                last, cpu = now, now_cpu
                idle = None if self.since is None else now - self.since
                limit, quiet = self._limit(), self.quiet_now
                if quiet:
                    idle, limit = self._waited(now), self.quiet_limit_s
            if idle is not None and idle > limit:
                self.on_hang(self._report(idle, limit, quiet))
                return
            if quiet and any(r["rank"] != self.rank
                             for r in read_reports(self.run_dir, since=self.started)):
                self._report(None, None, quiet, follows=True)
                return

    def _suspended(self, seconds: float) -> None:
        """The process was stopped for `seconds` (SUSPENDED_AFTER_S): they count as no one's
        idleness (the other ranks were stopped with it, or report a hang themselves). Once per
        mark of progress: a main thread that blocks holding the GIL (a C call that sleeps or
        waits) also leaves the watch late with the CPU still, again and again; its second late
        poll in the same step is a hang, as it was before suspensions were told apart."""
        if self._credited == self.progress:
            return
        self._credited = self.progress
        if self.since is not None:
            self.since += seconds
        if self._waiting is not None:
            self._waiting = (self._waiting[0], self._waiting[1] + seconds)

    def _waited(self, now: float) -> float | None:
        """How long the main thread has waited in the collective it waits in now (None: in
        none). The frame is held, so a later call is another object, never taken for it."""
        anchor = waiting_frame(sys._current_frames().get(self._main))
        if anchor is None:
            self._waiting = None
            return None
        if self._waiting is None or self._waiting[0] is not anchor:
            self._waiting = (anchor, now)
        return now - self._waiting[1]

    def _report(self, idle: float | None, limit: float | None, quiet: bool = False,
                follows: bool = False) -> dict:
        """Write this rank's report and every thread's stack, and wait a moment for the other
        ranks' reports (they saw the hang at about the same time). `follows`: another rank
        reported a hang while this one was quiet (a save, an evaluation): this one only says
        where it is."""
        frame = sys._current_frames().get(self._main)
        report = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                  "host": socket.gethostname(), "time": time.time(), "step": self.step,
                  "phase": self.phase, "idle_s": None if idle is None else round(idle, 1),
                  "limit_s": limit, "first_step": not self.first_ended and not quiet,
                  "quiet": quiet, "follows": follows, **where(frame)}
        del frame
        directory = self.run_dir / "logs" / HANG_DIR
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / f"rank-{self.rank}.json", report)
        said = (f"another rank reported a hang while this one was {self.phase}" if follows else
                f"no progress for {limit:g} s {self.phase} (hang)")
        print(f"partrain: {said}; every thread's stack follows", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if follows:
            return report
        if self.cuda:
            self._dump_flight_recorder()
        deadline = time.monotonic() + GATHER_S
        while (time.monotonic() < deadline and
               len(list(directory.glob("rank-*.json"))) < self.world_size):
            time.sleep(0.1)
        return report

    def _dump_flight_recorder(self) -> None:
        try:
            import torch

            dump = torch._C._distributed_c10d._dump_nccl_trace()
        except (AttributeError, RuntimeError):  # a build without NCCL, or nothing recorded
            return
        directory = self.run_dir / "logs" / TRACE_DIR
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank-{self.rank}").write_bytes(dump)

    def _exit(self, report: dict) -> None:
        """Record the hang as this rank's error (the agent reads it) and end the process."""
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        waits = report.get("collective")
        what = (f"waits in {waits['op']} on {waits['group']}" if waits else
                f"is at {report.get('at') or 'an unknown line'}")
        error = Hang(f"no progress for {report['limit_s']:g} s {report['phase']} "
                     f"(launcher.hang_timeout_s); rank {self.rank} {what}")
        ErrorHandler().record_exception(error)
        sys.stderr.flush()
        os._exit(1)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _walk(frame) -> tuple:
    """From a thread's innermost Python frame outwards: the outermost public function of
    torch.distributed.distributed_c10d on its stack (the collective partrain called), the
    innermost partrain frame, and the first frames as `file:line in function`."""
    collective, ours, stack = None, None, []
    while frame is not None:
        code = frame.f_code
        if len(stack) < 12:
            stack.append(f"{short_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
        if code.co_filename.endswith(_C10D) and not code.co_name.startswith("_"):
            collective = frame  # keep going: an outer one (broadcast_object_list) wins
        if ours is None and is_partrain(code.co_filename):
            ours = frame
        frame = frame.f_back
    return collective, ours, stack


def _waits_in_ours(ours) -> bool:
    """partrain's line waits for a transfer: it says what (`waiting_for`), or calls .wait()."""
    return ours is not None and ("waiting_for" in ours.f_locals or ".wait()" in linecache.getline(
        ours.f_code.co_filename, ours.f_lineno))


def waiting_frame(frame):
    """The frame a thread waits for a collective in (the c10d call, or partrain's line that
    waits), or None where it waits in none that Python can see."""
    collective, ours, _ = _walk(frame)
    return collective if collective is not None else ours if _waits_in_ours(ours) else None


def where(frame) -> dict:
    """Where a thread is, from its innermost Python frame: the collective it waits in (the
    outermost public function of torch.distributed.distributed_c10d on its stack: the one partrain
    called), and the innermost partrain line, with its source."""
    collective, ours, stack = _walk(frame)
    found = {"stack": stack}
    if collective is not None:
        found["collective"] = {"op": collective.f_code.co_name, **_group(collective)}
    elif _waits_in_ours(ours) and "waiting_for" in ours.f_locals:  # what partrain awaits
        found["collective"] = {"op": f"wait() for the {ours.f_locals['waiting_for']}",
                               "group": "", "ranks": None}
    elif _waits_in_ours(ours):
        found["collective"] = {"op": "wait() for an async send, receive or collective",
                               "group": "", "ranks": None}
    elif stack and stack[0].startswith("torch/autograd/"):
        # DDP's gradient all-reduce (and ZeRO's hooks) wait inside autograd, in C++.
        found["collective"] = {"op": "backward (gradient hooks: DDP's bucketed all-reduce "
                                     "waits there, in C++)", "group": "", "ranks": None}
    if ours is not None:
        line = linecache.getline(ours.f_code.co_filename, ours.f_lineno).strip()
        found["at"] = (f"{short_path(ours.f_code.co_filename)}:{ours.f_lineno} in "
                       f"{ours.f_code.co_name}")
        found["code"] = line
    return found


def is_partrain(path: str) -> bool:
    """partrain's own code (a checkout or an install), not this module, not a library under it."""
    tail = path.rpartition(os.sep + "partrain" + os.sep)[2]
    return (bool(tail) and tail != path and not any(part in os.sep + tail for part in _NOT_OURS)
            and not path.endswith(os.path.join("observe", "hang.py")))


def short_path(path: str) -> str:
    """partrain/train/loop.py, torch/distributed/distributed_c10d.py: from the package down."""
    parts = Path(path).parts
    for package in ("partrain", "torch", "deepspeed"):
        if package in parts:
            index = len(parts) - 1 - parts[::-1].index(package)
            return "/".join(parts[index:])
    for index in range(len(parts) - 1, -1, -1):  # the standard library: re/__init__.py
        if re.fullmatch(r"python\d+\.\d+", parts[index]):
            return "/".join(parts[index + 1:])
    return path


def _group(frame) -> dict:
    """The process group a c10d collective was called with (its `group` argument; None is the
    default group), by its name and ranks."""
    import torch.distributed as dist

    group = frame.f_locals.get("group")
    try:
        group = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        name = getattr(group, "group_desc", "") or ""
    except (RuntimeError, ValueError, AttributeError):
        return {"group": "an unknown group", "ranks": None}
    name = name.removeprefix("mesh_")
    label = ("the default group" if name in ("", "default_pg", "undefined") else
             f"the {name} group")
    return {"group": label, "ranks": ranks}


def read_reports(run_dir: Path, since: float = 0.0) -> list[dict]:
    """The hang reports the ranks wrote (see HangWatch), by rank; only those written at or after
    `since` (a time.time(): a launcher's start), not a previous launch's that another node has
    not cleared yet."""
    reports = []
    for path in sorted((run_dir / "logs" / HANG_DIR).glob("rank-*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and report.get("time", 0) >= since:
            reports.append(report)
    return sorted(reports, key=lambda r: r.get("rank", 0))


def clear_reports(run_dir: Path, ranks) -> None:
    for rank in ranks:
        (run_dir / "logs" / HANG_DIR / f"rank-{rank}.json").unlink(missing_ok=True)

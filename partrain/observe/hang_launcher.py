"""The launcher's side of a hang (the ranks' side is hang.py): one summary from every rank's
report, where a rank that wrote none was (its log's dumped stack), and asking this node's ranks
without a report for their stacks (DumpRequester) once another rank has reported.

A rank whose main thread holds the GIL (stuck in C code) cannot report: once a report appears,
each node's launcher sends its ranks that have none hang.DUMP_SIGNAL, on which faulthandler,
registered at their start, writes their stacks from C into their logs. The ranks of this node
are the launcher's children, or the rank server's (launcher.start_method=forkserver):
`local_workers`.
"""

import os
import re
import threading
import time
from pathlib import Path

from partrain.observe.hang import (
    DUMP_SIGNAL,
    HANG_DIR,
    TRACE_DIR,
    is_partrain,
    read_reports,
    short_path,
)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def summary(run_dir: Path, reports: list[dict]) -> list[str]:
    """One summary of a hang from every rank's report: which ranks wait in which collective on
    which group, called from where, and where the others are."""
    if not reports:
        return []
    world = max(r.get("world_size", 0) for r in reports)
    first = min([r for r in reports if not r.get("follows")] or reports,
                key=lambda r: r.get("step") or 0)
    limit = first.get("limit_s") or 0
    how = ("twice launcher.hang_timeout_s: the first step of a start" if first.get("first_step")
           else "one wait in one collective, near launcher.collective_timeout_s: a save or an "
           "evaluation is not timed as a whole" if first.get("quiet") else
           f"launcher.hang_timeout_s={limit:.0f}")
    lines = [f"hang: no rank made progress for {limit:.0f} s ({how}) {first.get('phase')}; "
             "who waits on whom:"]
    places: dict[str, list[int]] = {}
    for report in reports:
        waits = report.get("collective")
        at = report.get("at") or (report.get("stack") or ["an unknown place"])[0]
        if waits:
            ranks = waits.get("ranks")
            place = (f"wait in {waits['op']}" + (f" on {waits['group']}" if waits["group"] else "")
                     + (f" (ranks {', '.join(map(str, ranks))})" if ranks else "")
                     + f", called at {at}")
        else:
            code = report.get("code")
            place = f"are in no collective: at {at}" + (f": {code}" if code else "")
        places.setdefault(place, []).append(report["rank"])
    for place, ranks in places.items():
        verb = place if len(ranks) > 1 else (place.replace("wait in", "waits in", 1)
                                             .replace("are in no", "is in no", 1))
        lines.append(f"  {_ranks(ranks)} {verb}")
    if any(r.get("collective") for r in reports) and not all(r.get("collective")
                                                                for r in reports):
        lines.append("  the ranks in no collective are the ones the others wait for")
    elif len(places) == 1 and len({r["rank"] for r in reports}) == world and \
            not first.get("quiet"):
        # Nobody is behind: a stuck collective (the network, a NIC) looks so, and so does a
        # step that only takes longer than the limit (a slow file system, a loaded machine)
        lines.append(f"  every rank is at the same place and none is behind: a step slower than "
                     f"the {limit:.0f} s limit looks like this too; if the steps are that slow, "
                     "raise launcher.hang_timeout_s (and launcher.collective_timeout_s, above "
                     "twice it)")
    for rank in sorted(set(range(world)) - {r["rank"] for r in reports}):
        dumped = dumped_at(run_dir / "logs" / f"rank-{rank}.log")
        lines.append(f"  rank {rank} did not report (its main thread holds the GIL, or its node "
                     "is gone): " + (f"its stack, dumped on its launcher's signal, is at "
                                     f"{dumped}" if dumped else "no stack of it was dumped"))
    lines.append(f"  every rank's Python stack: {run_dir / 'logs'}/rank-N.log; the reports: "
                 f"{run_dir / 'logs' / HANG_DIR}/")
    traces = run_dir / "logs" / TRACE_DIR
    if traces.is_dir() and any(traces.iterdir()):
        lines.append(f"  NCCL flight recorder: {traces}/ (read it with: torchfrtrace {traces})")
    return lines


_FRAME = re.compile(r'\s+File "(.+)", line (\d+) in (\S+)')


# Where each rank log of this node's current attempt begins (the logs are appended to across
# attempts and launches): what an earlier one said is not this one's last words, nor its stack.
_ATTEMPT_STARTS: dict[str, int] = {}


def mark_attempt_start(logs: Path, ranks) -> None:
    """At each (re)start of this node's workers: their logs are read from their present ends."""
    for rank in ranks:
        log = logs / f"rank-{rank}.log"
        try:
            _ATTEMPT_STARTS[str(log)] = log.stat().st_size
        except OSError:
            _ATTEMPT_STARTS[str(log)] = 0


def log_tail(log: Path, size: int = 1 << 16) -> str | None:
    """The end of a rank's log as text (its last `size` bytes, of what this node's present
    attempt wrote where it is this node's rank: mark_attempt_start), None where it cannot be
    read: what a dead or hung rank said last is there."""
    try:
        with open(log, "rb") as f:
            f.seek(max(_ATTEMPT_STARTS.get(str(log), 0), f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return None


def dumped_at(log: Path) -> str | None:
    """Where the main thread was in the last faulthandler dump in a rank's log: its innermost
    partrain line, and what that called (faulthandler writes the innermost frame first)."""
    text = log_tail(log)
    if text is None:
        return None
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    for block in reversed(blocks):
        frames = [m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
        if not any(path.endswith(os.path.join("partrain", "train", "rank.py"))
                   for path, _, _ in frames):
            continue  # not the main thread (every rank, spawned or forked, runs in rank.py)
        for i, (path, line, name) in enumerate(frames):
            if is_partrain(path):
                inner = (f" (in {short_path(frames[i - 1][0])}:{frames[i - 1][1]} "
                         f"{frames[i - 1][2]})" if i else "")
                return f"{short_path(path)}:{line} in {name}{inner}"
    return None


class DumpRequester:
    """The launcher's side: once any rank reported a hang, ask this node's workers that have not
    for their stacks (DUMP_SIGNAL: faulthandler writes them from C). A thread, polling."""

    def __init__(self, run_dir: Path, poll_s: float = 0.5, grace_s: float = 2.0):
        self.run_dir, self.poll_s, self.grace_s = run_dir, poll_s, grace_s
        self.started = time.time()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="partrain-hang-dumps",
                                        daemon=True)

    def __enter__(self) -> "DumpRequester":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()

    def _run(self) -> None:
        asked = set()
        seen_at = None
        while not self._stopped.wait(self.poll_s):
            reports = read_reports(self.run_dir, since=self.started)
            if not reports:
                seen_at = None
                continue
            seen_at = seen_at or time.monotonic()
            if time.monotonic() - seen_at < self.grace_s:
                continue
            reported = {r["pid"] for r in reports}
            for pid in local_workers():
                if pid not in reported and pid not in asked:
                    asked.add(pid)
                    try:
                        os.kill(pid, DUMP_SIGNAL)
                    except ProcessLookupError:
                        pass


WORKER_MARKER = b"partrain.train"  # in a spawned rank's command line: python -m partrain.train
RANK_SERVER_MARKER = b"multiprocessing.forkserver"  # in the rank server's (and its forks')


def parent_of(pid: int) -> int | None:
    """pid's parent, from Linux's /proc/PID/stat (the name in parentheses may hold spaces); None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def local_workers(parent: int | None = None) -> list[int]:
    """The pids of this launcher's worker processes, from /proc: its children that run
    `python -m partrain.train` (launcher.start_method=spawn), and the children of its rank server
    (multiprocessing's forkserver, launcher.start_method=forkserver: each is a forked rank)."""
    parent = parent or os.getpid()
    processes = {}
    for entry in Path("/proc").glob("[0-9]*"):
        ppid = parent_of(int(entry.name))
        try:
            if ppid is not None:
                processes[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except OSError:
            continue
    servers = {pid for pid, (ppid, cmdline) in processes.items()
               if ppid == parent and RANK_SERVER_MARKER in cmdline}
    return sorted(pid for pid, (ppid, cmdline) in processes.items()
                  if ppid in servers or (ppid == parent and WORKER_MARKER in cmdline
                                         and RANK_SERVER_MARKER not in cmdline))

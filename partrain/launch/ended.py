"""Ranks that end in the middle of a run without a word.

A rank's process ends in one of three ways: it finished (the last step, or a clean stop on a
preemption signal), it failed (its elastic error file says why, or the agent saw a non-zero exit
code), or it exited with code 0 before the end: `os._exit(0)` in a model's or a library's code.
torch's elastic agent counts the third as a success. With spawned ranks a one-rank run said
`done` after 3 of 200 steps; with forked ones (launcher.start_method=forkserver) the agent waits
for a return value that never comes, and the launcher waited forever while `partrain runs` said
`running`; with two ranks the other one failed on the lost peer and was blamed.

So each rank says where it stands in RUN_DIR/logs/rank-N.state.json (train/rank.py): its pid and
attempt as it starts, and `ended` when it finished. The launcher's EndWatch, a thread, polls this
node's ranks: a rank whose process is gone, that neither finished nor recorded an error, and that
ended before the agent saw any failure, exited with code 0 in the middle (a non-zero exit or a
signal is the agent's to see, at once). If the launch goes on without it for GRACE_S (the others
wait in a collective), the watch stops this node's other ranks so that the agent ends the attempt
(or restarts it, launcher.max_restarts); if none is left, it sends the launcher SIGTERM, which
the agent takes as a stop. The launcher then names that rank. `sys.exit()` inside a rank is an
error the rank records itself (train/loop.py).
"""

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from partrain.launch.failures import recorded
from partrain.launch.runs import process_alive

GRACE_S = 3.0  # longer than a rank that lost its peer waits before it exits (train/rank.py)
# A rank that exits 0 is followed by the agent's first failure no sooner than the others' wait on
# their lost peer (2 s, train/rank.py); ranks killed together (the OOM killer, a `kill -9` of
# several) end within a poll of the agent seeing one of them. Between the two: this.
KILLED_TOGETHER_S = 1.0


def state_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank-{rank}.state.json"


def _write(run_dir: Path, rank: int, record: dict) -> None:
    path = state_path(run_dir, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def rank_started(run_dir: Path, rank: int, attempt: int) -> None:
    """The rank's side, as it starts: its pid, for its launcher's watch."""
    _write(run_dir, rank, {"pid": os.getpid(), "attempt": attempt, "ended": None})


def rank_finished(run_dir: Path, rank: int, attempt: int) -> None:
    """The rank's side, at a clean end: what follows is only the process's exit."""
    _write(run_dir, rank, {"pid": os.getpid(), "attempt": attempt, "ended": time.time()})


def read_state(run_dir: Path, rank: int) -> dict | None:
    try:
        record = json.loads(state_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def clear(run_dir: Path, ranks) -> None:
    """At the start of an attempt (launch/local.py, with the error files)."""
    for rank in ranks:
        state_path(run_dir, rank).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """The process runs: a zombie, ended and not yet reaped (a spawned rank until the agent's
    next poll), does not. Without /proc, `partrain runs`' signal check (a zombie counts there)."""
    if not os.path.isdir("/proc/self"):
        return process_alive(pid)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class _AgentSawAFailure(logging.Handler):
    """The moment the agent (or torch.multiprocessing for forked ranks) first said that a worker
    failed or is being stopped (a warning or an error), or that it restarts the workers (at INFO:
    after a failure, or when another node's agent asks for a new round): a rank that ended after
    it was stopped, not early, and the agent is handling what happened."""

    LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")

    def __init__(self):
        super().__init__(logging.INFO)
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and (record.levelno >= logging.WARNING or
                                "will restart worker group" in str(record.msg)):
            self.at = time.monotonic()


class EndWatch:
    """The launcher's side (see the module docstring). `specs` is the agent's RunDirLogsSpecs:
    its `starts` and `ranks` say the attempt and this node's ranks in it."""

    def __init__(self, run_dir: Path, specs, poll_s: float = 0.5, grace_s: float = GRACE_S,
                 one_node: bool = True):
        self.run_dir, self.specs, self.poll_s, self.grace_s = Path(run_dir), specs, poll_s, grace_s
        self.one_node = one_node
        self._early: dict[int, dict[int, float]] = {}  # attempt -> rank -> when seen gone
        self._pids: dict[tuple[int, int], int] = {}  # (attempt, rank) -> its process
        self._attempt = None
        self._agent = _AgentSawAFailure()
        self.stopped_launch = False  # the watch sent the launcher SIGTERM
        self._acted = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="partrain-end-watch", daemon=True)

    def __enter__(self) -> "EndWatch":
        for name in _AgentSawAFailure.LOGGERS:
            logging.getLogger(name).addHandler(self._agent)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join()
        for name in _AgentSawAFailure.LOGGERS:
            logging.getLogger(name).removeHandler(self._agent)

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Look at this node's ranks once; act on one that ended early and was not followed."""
        with self._lock:
            attempt, ranks = self.specs.starts - 1, dict(self.specs.ranks)
            if attempt < 0:
                return
            self._attempt = attempt
            early = self._early.setdefault(attempt, {})
            for rank in ranks.values():
                # The state file is read only until the rank's pid is known and once its process
                # is gone: the run dir may be on a shared file system, under thousands of ranks.
                pid = self._pids.get((attempt, rank))
                if rank in early or (pid is not None and alive(pid)):
                    continue
                state = read_state(self.run_dir, rank)
                if state is None or state.get("attempt") != attempt:
                    continue
                pid = self._pids[(attempt, rank)] = int(state.get("pid", 0))
                if state.get("ended") or alive(pid):
                    continue
                if self._agent.at is not None or self._acted or recorded(
                        self.run_dir / "logs" / f"error-rank-{rank}.json") is not None:
                    continue  # stopped by the agent or this watch, or failed with an error
                early[rank] = time.monotonic()
            if (early and not self._acted and self._agent.at is None and
                    time.monotonic() - min(early.values()) >= self.grace_s):
                self._acted = True
                self._stop_the_rest(ranks.values(), attempt)

    def new_attempt(self) -> None:
        """The agent starts the workers again (local.py's RunDirLogsSpecs, before it does): what
        it saw fail was the last attempt's."""
        with self._lock:
            self._agent.at, self._acted = None, False

    def _stop_the_rest(self, ranks, attempt: int) -> None:
        """The launch went on without the rank that ended: end this attempt. SIGTERM to this
        node's other ranks (the agent sees them fail); none left, on one node, SIGTERM to the
        launcher (the agent's handler stops it), unless the agent's handler is not in place. On
        several nodes the others' ranks fail on the lost peer (or their hang watch fires): their
        agents start a new round, which this node's agent joins (a restart), or their launchers
        end and this one loses the store (local.py names the rank then)."""
        living = [pid for rank in ranks
                  if (pid := self._pids.get((attempt, rank))) is not None and alive(pid)]
        for pid in living:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not living and self.one_node and getattr(signal.getsignal(signal.SIGTERM),
                                                    "__module__", "").startswith("torch."):
            self.stopped_launch = True
            os.kill(os.getpid(), signal.SIGTERM)

    def ended_early(self, attempt: int | None = None, not_these=()) -> list[int]:
        """The ranks of this node that exited with code 0 in the middle of `attempt` (the last
        one by default), leaving out `not_these` (ranks the agent saw fail) and those that ended
        within KILLED_TOGETHER_S before the agent saw a failure (forked ranks killed together:
        the agent names only the first)."""
        self.poll()
        with self._lock:
            attempt = self._attempt if attempt is None else attempt
            saw = self._agent.at
            return sorted(rank for rank, when in self._early.get(attempt, {}).items()
                          if rank not in not_these and
                          (saw is None or saw - when >= KILLED_TOGETHER_S))

    def unfinished(self) -> list[int]:
        """After an attempt the agent counted as a success: this node's ranks that did not
        finish (each exited with code 0 in the middle, or before it could say so)."""
        attempt = self.specs.starts - 1
        states = {rank: read_state(self.run_dir, rank) or {}
                  for rank in self.specs.ranks.values()}
        return sorted(rank for rank, state in states.items()
                      if not (state.get("attempt") == attempt and state.get("ended")))

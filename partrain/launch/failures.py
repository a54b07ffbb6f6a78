"""How the workers ended, said for a person: which rank failed first with an error of its own
(a rank that only lost its peer is a symptom), how a rank that recorded nothing ended, the line
said at an in-job restart, a hang's summary, where to resume from, and a full disk. The
launcher (launch/local.py) decides the exit code; these say why."""

import json
import re
import shutil
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from partrain.observe import hang, hang_launcher
from partrain.observe.metrics import recorded_losses


# A rank whose peer died fails too, often first (its collective breaks at once); these are the
# words gloo and NCCL use for that. The launcher names the rank with the real error instead.
PEER_LOST = ("Connection closed", "Connection reset", "Broken pipe", "NCCL communicator was aborted",
             "remote process exited")


def lost_a_peer(error: str) -> bool:
    """The error is a collective broken by a peer that ended, not the rank's own."""
    return any(words in error for words in PEER_LOST)


def recorded(path: Path) -> str | None:
    """The first line of the error a rank recorded in its elastic error file, if it did."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message", data) if isinstance(data, dict) else data
    if isinstance(message, dict):
        message = message.get("message")
    return str(message).strip().splitlines()[0] if message else None


def last_step(run_dir: Path) -> int | None:
    """The last step metrics.jsonl records (rank 0 writes it; the run dir is shared)."""
    step = None
    for step, _ in recorded_losses(run_dir):
        pass
    return step


def restart_reporter(run_dir: Path, max_restarts: int, console_print, multi_node: bool = False):
    """What the launcher says when the agent restarts the workers: who failed, at which step,
    with what error, and where the restart resumes from."""
    from partrain.checkpoint import store

    since = time.time()  # hang reports of this launch only

    def report(attempt: int, errors: dict[int, str | None], ended: dict[int, int],
               early: list[int] = (), preempted: bool = False) -> None:
        """`errors`: what this node's ranks recorded (None: nothing); `ended`: the exit code of
        the rank the agent saw fail first (negative: the signal that killed it); `early`: ranks
        that exited with code 0 in the middle (launch/ended.py); `preempted`: a preemption
        signal came to this launcher, passed on to the restarted workers."""
        hung = say_hang(run_dir, since, console_print)
        failed = {rank: text for rank, text in errors.items()
                  if text and not lost_a_peer(text)}
        silent = {rank: code for rank, code in ended.items() if not errors.get(rank)}
        who = ("the hang ended every worker" if hung else
               "; ".join(f"rank {rank} failed: {text}" for rank, text in sorted(failed.items()))
               or "; ".join(f"rank {rank} exited with code 0 before the end of the run and "
                            "recorded no error" for rank in early)
               or "; ".join(f"rank {rank} {ending(code)}{_quoted(run_dir, rank)}"
                            for rank, code in sorted(silent.items()))
               or ("a rank on another node failed (this node's ranks lost their peers or were "
                   "stopped; the failed rank is in that node's output and its logs/rank-N.log)"
                   if multi_node else
                   "every rank lost its peer and none recorded an error of its own (the ranks' "
                   "logs: logs/rank-N.log)"))
        step = last_step(run_dir)
        newest = store.newest(run_dir / store.CHECKPOINTS)
        start = (f"from {newest.path.name} (step {newest.step})" if newest else
                 "from the start: no checkpoint was committed yet")
        console_print(f"{who} (after step {step if step is not None else 0}); restart {attempt} "
                      f"of {max_restarts} (launcher.max_restarts), {start}"
                      + ("; the preemption signal (SIGUSR2) this launcher got goes to the "
                         "restarted workers: they save at their first step and exit 3"
                         if preempted else ""))
    return report


def _quoted(run_dir: Path, rank: int) -> str:
    words = last_words(run_dir / "logs" / f"rank-{rank}.log")
    return f" (its log ends: {words})" if words else ""


def say_hang(run_dir: Path, since: float, console_print) -> bool:
    """Print the summary of a hang from the ranks' reports written since `since` (this launch's);
    False if there are none."""
    lines = hang_launcher.summary(run_dir, hang.read_reports(run_dir, since))
    for line in lines:
        console_print(line)
    return bool(lines)


_LAST_WORDS = re.compile(r"what\(\)|terminate called|[A-Za-z]+Error\b|Fatal Python error|"
                         r"collective mismatch")


def last_words(log: Path, limit: int = 300) -> str | None:
    """What a rank that recorded no Python error said last before it died, from the end of its
    log: C++'s `what():` line (gloo aborts a rank that meets another rank's collective with
    SIGABRT, and says `Is there a distributed collective mismatch in your code?` only there), or
    an error line. None if nothing like it is there."""
    text = hang_launcher.log_tail(log)
    if text is None:
        return None
    found = [" ".join(line.split()) for line in text.splitlines() if _LAST_WORDS.search(line)]
    said = next((line for line in reversed(found) if "what()" in line), None) or \
        (found[-1] if found else None)
    return said[:limit] + ("..." if len(said) > limit else "") if said else None


def ending(exitcode: int) -> str:
    """How a process that recorded no error ended, from its exit code."""
    if exitcode < 0:
        return f"was {killed_by(exitcode)}"
    return f"exited with code {exitcode} and recorded no error"


def killed_by(exitcode: int) -> str:
    """The signal that a negative exit code says killed the process, named."""
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


def failure_message(failure) -> str:
    """A failed rank's recorded error; for one that recorded none, how it ended."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    if not message or message.startswith("To enable traceback"):
        message = f"exited with code {failure.exitcode} (no Python error recorded)"
    elif failure.exitcode < 0 and message.startswith("Signal "):  # torch's words, no error file
        message = f"{killed_by(failure.exitcode)} (no Python error recorded)"
    return message.strip()


def add_recorded(err: ChildFailedError, log_dir: Path, ranks) -> None:
    """Add to the failures the agent saw what every other rank of this node (`ranks`, global)
    recorded in its error file in this attempt. The agent reports the ranks whose end it saw at
    one poll; with forked ranks (launcher.start_method=forkserver) only the first, since
    torch.multiprocessing stops the others at once, and that one may only have lost its peer."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for rank in ranks:
        path = log_dir / f"error-rank-{rank}.json"
        if rank in err.failures or recorded(path) is None:
            continue
        try:
            err.failures[rank] = ProcessFailure(local_rank=-1, pid=-1, exitcode=1,
                                                error_file=str(path))
        except (OSError, ValueError, KeyError, TypeError):
            continue


def describe_failure(err: ChildFailedError) -> tuple[int, str]:
    """The rank that failed first with an error of its own (not a lost peer, which is a symptom)
    and its message from its error file; the first failure if every one is a lost peer."""
    by_time = sorted(err.failures.items(), key=lambda item: item[1].timestamp)
    for rank, failure in by_time:
        if not lost_a_peer(failure_message(failure)):
            return rank, failure_message(failure)
    rank, failure = err.get_first_failure()
    return rank, failure_message(failure)


def first_line(err: Exception) -> str:
    """The error and its cause in one line (c10d wraps the socket error it met)."""
    parts = [text.strip().splitlines()[0] for text in (str(err), str(err.__cause__ or ""))
             if text.strip()]
    return ": ".join(parts) or f"{type(err).__name__}: not all nodes joined in time"


def workers_started(agent_log: Path, since: int = 0) -> bool:
    """Whether the agent got past the rendezvous and started this node's workers: the
    rendezvous's own line that this node joined a round (the agent's "Starting worker group"
    does not reach the log: its logger is not the rendezvous's), after byte `since` of the log
    (where this launch's agent began: a relaunch in the run dir appends)."""
    try:
        with open(agent_log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    return re.search(r"has joined round \d+ of the rendezvous", text) is not None


# A rank's error on loading a checkpoint (checkpoint/state.py, its `said`): "reading the
# weights of PATH failed: ..."
UNREADABLE = re.compile(r"reading the (?:weights|optimizer state|generator states) of (\S+) "
                        r"failed")


def where_to_resume(run_dir: Path, failure: str = "") -> str:
    """The newest committed checkpoint and the command that goes on from it; where the rank's
    `failure` was reading that very checkpoint (files damaged with their sizes intact: zeros
    after a power cut), how to go on from the one before it instead (resuming from it again
    failed again)."""
    from partrain.checkpoint import store

    committed = store.committed(run_dir / store.CHECKPOINTS)
    if not committed:
        return ("no checkpoint was committed, so nothing was kept: the same command starts "
                "the run again")
    newest, unreadable = committed[-1], UNREADABLE.search(failure)
    if unreadable and Path(unreadable.group(1)).resolve() == newest.path.resolve():
        aside = newest.path.parent.parent / f"{newest.path.name}.unreadable"
        then = (f"relaunch with partrain launch --resume {run_dir}: it goes on from step "
                f"{committed[-2].step}" if len(committed) > 1 else
                "run the same command again: no checkpoint is before it, and the run starts "
                "again from step 1")
        return (f"the newest checkpoint, {newest.path} (step {newest.step}), could not be read: "
                f"its files are damaged. Move it aside (mv {newest.path} {aside}) and {then}")
    return (f"the newest checkpoint is {newest.path} (step {newest.step}); go on from it with "
            f"partrain launch --resume {run_dir}")


def space_left(run_dir: Path) -> str:
    """What the run dir's file system has left, said for a person."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError as err:
        return f"its file system cannot be asked ({err.strerror or err})"
    if free < 1 << 20:
        return (f"the run dir's file system is full ({free:,} bytes free at {run_dir}): free "
                "space there, then relaunch to resume from the newest committed checkpoint")
    return f"{free:,} bytes are free at {run_dir}"

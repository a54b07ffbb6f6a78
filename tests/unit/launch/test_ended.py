"""The launcher's watch for a rank that exits with code 0 in the middle of a run
(launch/ended.py), with real processes standing in for the ranks: each writes its state file as
a rank does (train/rank.py), then lives on, finishes, fails or just ends."""

import logging
import subprocess
import sys
import time

import pytest

from partrain.launch import ended

STAND_IN = """
import sys, time
from pathlib import Path
from partrain.launch import ended
run_dir, rank, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ended.rank_started(run_dir, rank, 0)
if how == "finish":
    ended.rank_finished(run_dir, rank, 0)
elif how == "fail":
    (run_dir / "logs" / f"error-rank-{rank}.json").write_text('{"message": "RuntimeError: x"}')
    sys.exit(1)
elif how == "live":
    time.sleep(60)
"""


class Specs:
    """What EndWatch reads of the agent's RunDirLogsSpecs: the attempt and this node's ranks."""

    def __init__(self, ranks):
        self.starts, self.ranks = 1, dict(enumerate(ranks))


@pytest.fixture
def ranks(tmp_path):
    (tmp_path / "logs").mkdir()
    procs = []

    def start(rank, how):
        proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(tmp_path), str(rank), how])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _settle(watch, procs):
    for proc in procs:
        if proc.args[-1] != "live":
            proc.wait(timeout=60)
    watch.poll()


def test_only_a_rank_that_ended_without_a_word_is_early(tmp_path, ranks):
    procs = [ranks(0, "finish"), ranks(1, "exit0"), ranks(2, "fail"), ranks(3, "live")]
    deadline = time.monotonic() + 60
    while not all(ended.read_state(tmp_path, r) for r in range(4)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    watch = ended.EndWatch(tmp_path, Specs(range(4)), grace_s=3600)
    _settle(watch, procs)
    assert watch.ended_early() == [1]
    assert watch.ended_early(not_these={1: 0}) == []  # the agent saw it fail: not early
    assert watch.unfinished() == [1, 2, 3]  # only rank 0 said it finished


def test_a_rank_that_ended_after_the_agent_saw_a_failure_was_stopped_not_early(tmp_path, ranks):
    watch = ended.EndWatch(tmp_path, Specs([0]), grace_s=3600)
    with watch:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").error(
            "failed (exitcode: %s) local_rank: %s", -9, 1)
        _settle(watch, [ranks(0, "exit0")])
        assert watch.ended_early() == []


def test_after_the_grace_the_watch_stops_this_nodes_other_ranks(tmp_path, ranks):
    """The others would wait in a collective for the one that left: they are sent SIGTERM so
    that the agent ends (or restarts) the attempt."""
    living = ranks(1, "live")
    watch = ended.EndWatch(tmp_path, Specs([0, 1]), poll_s=0.05, grace_s=0.5)
    with watch:
        _settle(watch, [ranks(0, "exit0")])
        assert living.wait(timeout=30) == -15
    assert watch.ended_early() == [0] and not watch.stopped_launch


def test_ranks_killed_together_are_not_early(tmp_path, ranks):
    """Forked ranks killed together (the OOM killer, `kill -9` of both): the agent names only
    the first it sees, within a poll; the other must not read as an exit with code 0. A rank
    that exits 0 is followed by the agent's first failure only after its peers' wait (2 s)."""
    watch = ended.EndWatch(tmp_path, Specs([0]), grace_s=3600)
    failed = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    with watch:
        _settle(watch, [ranks(0, "exit0")])
        failed.error("failed (exitcode: %s) local_rank: %s", -9, 1)  # within a poll
        assert watch.ended_early() == []
    later = ended.EndWatch(tmp_path, Specs([1]), grace_s=3600)
    with later:
        _settle(later, [ranks(1, "exit0")])
        time.sleep(ended.KILLED_TOGETHER_S + 0.1)
        failed.error("failed (exitcode: %s) local_rank: %s", 1, 0)  # the peer, 2 s later
        assert later.ended_early() == [1]


def test_a_restart_the_agent_begins_is_left_to_it(tmp_path, ranks):
    """Another node's agent asked for a new round (a membership change, said at INFO): this
    node's agent restarts its workers, and the watch does not stop the launch under it."""
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    level = agent.level
    agent.setLevel(logging.INFO)  # as the launcher sets it (local.py, _quiet_agent_logs)
    watch = ended.EndWatch(tmp_path, Specs([0]), poll_s=0.05, grace_s=2.0)
    with watch:
        _settle(watch, [ranks(0, "exit0")])
        agent.info(
            "[%s] Detected %s new nodes from group_rank=%s; will restart worker group",
            "partrain", 1, 0)
        time.sleep(2.5)
    agent.setLevel(level)
    assert not watch.stopped_launch and watch._acted is False

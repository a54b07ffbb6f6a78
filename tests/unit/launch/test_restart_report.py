"""What the launcher tells the workers and says at an in-job restart (launch/local.py, launch/failures.py), without
an agent: RunDirLogsSpecs numbers the attempts by its own starts (the same on every node, where
torch's count is not), and the restart line names a rank that died without recording an error by
how it ended."""

import logging

from partrain.launch.failures import restart_reporter
from partrain.launch.local import RunDirLogsSpecs


def _envs(ranks, count="0"):
    return {local: {"RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": count}
            for local, rank in enumerate(ranks)}


def test_every_start_is_the_next_attempt_whatever_torch_counted(tmp_path):
    (tmp_path / "logs").mkdir()
    heard = []
    specs = RunDirLogsSpecs(tmp_path / "logs", lambda *args: heard.append(args))
    told = []
    # torch's count stays 0 at the second start: a membership change, not counted by the agent.
    for count in ("0", "0", "1"):
        envs = _envs([2, 3], count)
        specs.reify(envs)
        told.append({env["TORCHELASTIC_RESTART_COUNT"] for env in envs.values()})
    assert told == [{"0"}, {"1"}, {"2"}]
    assert [attempt for attempt, *_ in heard] == [1, 2]


def _restarted(tmp_path, failed=None, multi_node=True) -> str:
    """What the launcher says at the first restart of ranks 2 and 3 (local ranks 0 and 1), after
    the agent logged `failed` (exit code, local rank) for this node, as torch's process context
    does when a worker dies."""
    said = []
    specs = RunDirLogsSpecs(tmp_path / "logs", restart_reporter(tmp_path, 1, said.append,
                                                                multi_node))
    specs.reify(_envs([2, 3]))
    if failed:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").error(
            "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", *failed, 1234, "python")
    specs.reify(_envs([2, 3], "1"))
    [line] = said
    return line


def test_a_killed_rank_is_named_by_how_it_ended(tmp_path):
    (tmp_path / "logs").mkdir()
    start = ("(after step 0); restart 1 of 1 (launcher.max_restarts), from the start: no "
             "checkpoint was committed yet")
    assert _restarted(tmp_path, (-9, 1)) == f"rank 3 was killed by SIGKILL {start}"
    assert _restarted(tmp_path, (7, 0)) == f"rank 2 exited with code 7 and recorded no error {start}"
    # Nothing of this node failed by itself: the failure was elsewhere.
    assert _restarted(tmp_path) == (
        "a rank on another node failed (this node's ranks lost their peers or were stopped; the "
        f"failed rank is in that node's output and its logs/rank-N.log) {start}")
    # One node: never another node's.
    assert _restarted(tmp_path, multi_node=False) == (
        "every rank lost its peer and none recorded an error of its own (the ranks' logs: "
        f"logs/rank-N.log) {start}")


def test_a_forked_rank_gets_the_launchers_environment_with_its_own_variables(tmp_path,
                                                                              monkeypatch):
    """A spawned rank inherits the launcher's environment through Popen; a forked one holds the
    rank server's, from before the launcher set what it sets later (the network interface, the
    flight recorder): RunDirLogsSpecs(forked=True) hands each fork the launcher's environment,
    the agent's variables first."""
    (tmp_path / "logs").mkdir()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "veth-late")
    monkeypatch.setenv("RANK", "99")  # the launcher's own, if it had one: the agent's wins
    forked, spawned = _envs([2, 3]), _envs([2, 3])
    RunDirLogsSpecs(tmp_path / "logs", forked=True).reify(forked)
    RunDirLogsSpecs(tmp_path / "logs").reify(spawned)
    assert [env["GLOO_SOCKET_IFNAME"] for env in forked.values()] == ["veth-late"] * 2
    assert [env["RANK"] for env in forked.values()] == ["2", "3"]
    assert all("GLOO_SOCKET_IFNAME" not in env for env in spawned.values())


def test_workers_started_reads_only_this_launchs_part_of_the_agent_log(tmp_path):
    """The agent's log is appended to by every launch in the run dir (a requeue, a resume): a
    rendezvous that completed in an earlier launch must not make this launch's failed one
    read as a store lost during the run."""
    from partrain.launch.failures import workers_started

    log = tmp_path / "launcher-node-1.log"
    log.write_text("2026-11-28 13:12:55,178 torch.distributed.elastic.rendezvous.dynamic_"
                   "rendezvous INFO The node 'n1_1_0' has joined round 0 of the rendezvous "
                   "'quickstart' as rank 1 in a world of size 2.\n")
    since = log.stat().st_size
    assert workers_started(log) and not workers_started(log, since)
    with log.open("a") as f:
        f.write("... The node 'n1_2_0' attempts to join the next round of the rendezvous\n")
    assert not workers_started(log, since)
    with log.open("a") as f:
        f.write("... The node 'n1_2_0' has joined round 1 of the rendezvous 'quickstart' ...\n")
    assert workers_started(log, since)
    assert not workers_started(tmp_path / "missing.log")


def test_last_words_quote_a_c_abort_over_the_python_lines_before_it(tmp_path):
    """A rank killed by a signal records no Python error; what its log says last is the why
    (gloo's `what():` before a SIGABRT), quoted by the launcher."""
    from partrain.launch.failures import last_words

    log = tmp_path / "rank-1.log"
    log.write_text("step 1 loss 5.5\nValueError: an old, handled one\nterminate called after "
                   "throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
                   "pair.cc:456] op.preamble.length <= op.nbytes. Is there a distributed "
                   "collective mismatch in your code?\n")
    assert last_words(log).startswith("what(): [enforce fail at pair.cc:456]")
    log.write_text("step 1 loss 5.5\nstep 2 loss 5.3\n")
    assert last_words(log) is None
    assert last_words(tmp_path / "missing.log") is None
    log.write_text("RuntimeError: " + "x" * 400 + "\n")
    assert last_words(log).endswith("...") and len(last_words(log)) == 303


def test_an_earlier_attempts_words_and_stacks_are_not_this_ones(tmp_path):
    """Rank logs are appended to across attempts and launches: a restart's line quoted the
    previous attempt's injected error for a rank killed by SIGKILL, and the hang summary gave an
    earlier launch's stack as "dumped on its launcher's signal" for a rank that dumped none (a
    reviewer's runs). Each attempt's start is marked (RunDirLogsSpecs.reify): only what comes
    after it is read."""
    from partrain.launch.failures import last_words
    from partrain.observe.hang_launcher import dumped_at

    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank-3.log"
    old_stack = ('Current thread 0x00007f (most recent call first):\n'
                 '  File "/x/partrain/parallel/data.py", line 134 in backward\n'
                 '  File "/x/partrain/train/rank.py", line 40 in main\n')
    log.write_text("RuntimeError: injected fault at step 3\n" + old_stack)
    assert last_words(log) and dumped_at(log)  # before any attempt of this launcher
    specs = RunDirLogsSpecs(logs, restart_reporter(tmp_path, 1, lambda line: None, False))
    specs.reify(_envs([2, 3]))
    assert last_words(log) is None and dumped_at(log) is None
    with log.open("a") as f:
        f.write("step 4 loss 5.1\nValueError: this attempt's own\n")
    assert last_words(log) == "ValueError: this attempt's own"

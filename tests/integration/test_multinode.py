"""Two nodes by hand, emulated by two network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2, addresses that exist only inside them): `partrain launch --nnodes 2` in each, as a user
types it on two machines. Each node sees only its own interface and loopback, so the test fails
if a worker advertises 127.0.0.1 or the wrong interface. Only GPUs and NCCL are missing: the
ranks use gloo on CPU. Needs root (`ip netns add`); skipped, with the reason, where not permitted.
"""

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import (
    CLI,
    PARITY_COMMON,
    assert_parity,
    processes_mentioning,
    ranks_of,
    read_metrics,
    running,
    survivors,
)

pytestmark = pytest.mark.slow

SUBNET = "10.77.0"
PORT = 29400  # inside the namespaces: nothing else listens there
FAST_FAIL = ("launcher.rdzv_timeout_s=30", "launcher.collective_timeout_s=30")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def two_nodes():
    """Two namespaces, node 0 at 10.77.0.1 and node 1 at 10.77.0.2; deleted at the end."""
    tag = uuid.uuid4().hex[:6]
    names = (f"pt{tag}a", f"pt{tag}b")
    result = _ip("netns", "add", names[0])
    if result.returncode != 0:
        pytest.skip(f"cannot create network namespaces here (`ip netns add`: "
                    f"{result.stderr.strip()}); needs root")
    try:
        _ip("netns", "add", names[1]).check_returncode()
        _ip("link", "add", f"v{tag}a", "netns", names[0], "type", "veth",
            "peer", "name", f"v{tag}b", "netns", names[1]).check_returncode()
        for i, (ns, dev) in enumerate(zip(names, (f"v{tag}a", f"v{tag}b"))):
            for command in (["addr", "add", f"{SUBNET}.{i + 1}/24", "dev", dev],
                            ["link", "set", dev, "up"], ["link", "set", "lo", "up"]):
                _ip("-n", ns, *command).check_returncode()
        yield names, (f"v{tag}a", f"v{tag}b")
    finally:
        for ns in names:
            _ip("netns", "del", ns)


def _start_nodes(cli, names, run_dir, *overrides, nproc=2, env=None):
    env = {"OMP_NUM_THREADS": "1", **(env or {})}  # two "machines" share these 2 cores
    return [cli.start("launch", *overrides, *FAST_FAIL, "--nnodes", "2", "--nproc-per-node",
                      str(nproc), "--node-rank", str(rank), "--rdzv-endpoint",
                      f"{SUBNET}.1:{PORT}", "--run-dir", str(run_dir), env=env,
                      prefix=("ip", "netns", "exec", ns))
            for rank, ns in enumerate(names)]


def _processes_in(namespace: str) -> list[int]:
    """Every process in a network namespace: what runs on that emulated node."""
    ns_inode = os.stat(f"/run/netns/{namespace}").st_ino
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ns_inode:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _wait_for_steps(run_dir, *nodes):
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline, "training never started"
        for node in nodes:
            assert node.poll() is None, node.communicate()
        time.sleep(0.2)


def test_two_nodes_dp2_tp2_match_one_process(cli, tmp_path, two_nodes, single_process_reference):
    names, devices = two_nodes
    run_dir = tmp_path / "run"  # both nodes write to one run dir, as on a shared file system
    procs = _start_nodes(cli, names, run_dir, *PARITY_COMMON, "parallel.dp=2", "parallel.tp=2",
                         "train.micro_batch_size=4")
    outputs = [proc.communicate(timeout=240) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stdout + stderr
    # Each node found, and said, the interface that reaches the endpoint.
    for i, (stdout, _) in enumerate(outputs):
        assert f"this node is {SUBNET}.{i + 1} on {devices[i]} (the route to {SUBNET}.1:{PORT})" \
            in stdout, stdout
        assert f"GLOO_SOCKET_IFNAME={devices[i]}" in stdout
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == \
        [f"rank-{r}.log" for r in range(4)]
    steps, _ = read_metrics(run_dir)
    assert_parity(steps, single_process_reference, "2 namespaces x 2 ranks, dp2 x tp2")


@pytest.mark.parametrize("lost_node", [1, 0])
def test_losing_a_node_ends_the_other_with_exit_1(cli, tmp_path, two_nodes, lost_node):
    """A node goes away mid-run (its launcher and workers killed): the other stops within the
    collective timeout, exit 1, saying what was lost. Node 0 holds the rendezvous store: node
    1 loses it (or its ranks their peers first) and must not blame a rendezvous that never
    completed."""
    names, _ = two_nodes
    run_dir = tmp_path / "run"
    nodes = _start_nodes(cli, names, run_dir, "launcher.device=cpu",
                         "train.max_steps=100000", "train.eval_every=0",
                         "parallel.dp=4", "train.micro_batch_size=4")
    _wait_for_steps(run_dir, *nodes)
    other = nodes[1 - lost_node]

    # Each of its processes (each in a session of its own) is killed.
    lost = time.monotonic()
    for pid in _processes_in(names[lost_node]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # ended between the listing and the kill (its parent's went)
            pass
    _, stderr = other.communicate(timeout=90)
    elapsed = time.monotonic() - lost
    said = " ".join(stderr.split())
    assert other.returncode == 1, stderr
    assert "all 2 nodes must join" not in said, stderr
    if lost_node == 1:
        assert "failed" in said and "every other rank was stopped" in said, stderr
    else:
        assert (f"lost the rendezvous store at {SUBNET}.1" in said and "node 0 ended or cannot "
                "be reached" in said) or "a rank on another node failed" in said, stderr
        assert "no checkpoint was committed" in said, stderr
    assert elapsed < 45, f"node {1 - lost_node} took {elapsed:.0f} s to notice"
    print(f"node {1 - lost_node} ended {elapsed:.1f} s after node {lost_node} was lost")
    assert processes_mentioning(str(run_dir)) == []


# Not node 0's launcher alone: it hosts the rendezvous store, whose loss makes node 1's agent stop
# every rank of the job, lifeline or not, so that case could not fail.
@pytest.mark.parametrize("killed", [(0, 1), (1,)], ids=["both-launchers", "node-1-launcher"])
def test_sigkilled_launchers_take_their_workers_along(cli, tmp_path, two_nodes, killed):
    """The launchers of `killed` die by SIGKILL: their workers die with them (their lifeline)
    within 10 s, those of the other node too (their peers are gone), and a surviving launcher
    stops what is left and exits 1."""
    names, _ = two_nodes
    run_dir = tmp_path / "run"
    nodes = _start_nodes(cli, names, run_dir, "launcher.device=cpu", "train.max_steps=100000",
                         "train.eval_every=0", "parallel.dp=4", "train.micro_batch_size=4")
    _wait_for_steps(run_dir, *nodes)
    workers = set()
    for ns, node in zip(names, nodes):
        # `ip netns exec` execs partrain: the pid that cli started is the launcher itself.
        assert b"partrain\0launch" in open(f"/proc/{node.pid}/cmdline", "rb").read()
        on_node = running(_processes_in(ns)) - {node.pid}
        assert len(on_node) >= 2, (ns, on_node)
        workers |= on_node
    survivor = next((node for rank, node in enumerate(nodes) if rank not in killed), None)

    started = time.monotonic()
    for rank in killed:
        os.kill(nodes[rank].pid, signal.SIGKILL)
        nodes[rank].wait()
    left = survivors(lambda: (workers | set(processes_mentioning(str(run_dir))))
                     - {node.pid for node in nodes}, within_s=10)
    gone = time.monotonic() - started
    assert not left, f"workers {sorted(left)} still ran 10 s after launchers {killed} were killed"
    print(f"launchers {killed} killed: every worker gone after {gone:.1f} s")
    if survivor:
        _, stderr = survivor.communicate(timeout=60)
        ended = time.monotonic() - started
        assert survivor.returncode == 1, stderr
        assert "every other rank was stopped" in stderr, stderr
        assert ended < 20, f"the surviving launcher took {ended:.0f} s to end"
        print(f"  the surviving launcher ended after {ended:.1f} s")


def test_missing_nodes_fail_within_the_rendezvous_timeout(cli, tmp_path, two_nodes):
    """Node 1 points at an endpoint where nobody listens; node 0 waits for a node that never
    comes. Both stop after launcher.rdzv_timeout_s, exit 1, name the endpoint; no hang."""
    names, _ = two_nodes
    timeout_s = 5
    common = ("launcher.device=cpu", "parallel.dp=2", f"launcher.rdzv_timeout_s={timeout_s}",
              "--nnodes", "2", "--nproc-per-node", "1")
    started = time.monotonic()
    alone = cli.start("launch", *common, "--node-rank", "0", "--rdzv-endpoint",
                      f"{SUBNET}.1:{PORT + 1}", "--run-dir", str(tmp_path / "node0"),
                      prefix=("ip", "netns", "exec", names[0]))
    lost = cli.start("launch", *common, "--node-rank", "1", "--rdzv-endpoint",
                     f"{SUBNET}.1:{PORT + 2}", "--run-dir", str(tmp_path / "node1"),
                     prefix=("ip", "netns", "exec", names[1]))
    for proc, endpoint, message in (
            (lost, f"{SUBNET}.1:{PORT + 2}", f"node 1 could not reach it within "
                                             f"launcher.rdzv_timeout_s={timeout_s} s"),
            (alone, f"{SUBNET}.1:{PORT + 1}", f"all 2 nodes must join within "
                                              f"launcher.rdzv_timeout_s={timeout_s} s")):
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 1, stderr
        assert f"rendezvous at {endpoint} failed" in stderr and message in stderr, stderr
        assert "Traceback" not in stderr
    elapsed = time.monotonic() - started
    assert elapsed < timeout_s + 25, f"{elapsed:.0f} s for a {timeout_s} s rendezvous timeout"
    print(f"both nodes gave up {elapsed:.1f} s after the start (timeout {timeout_s} s)")


def test_nodes_that_do_not_see_one_run_dir_stop_with_exit_2(cli, tmp_path, two_nodes):
    """The issue's node-local run dirs: each node its own --run-dir (as node-local disks are).
    The old code trained, committed checkpoints whose shards were on the other node and exited
    0; now every node exits 2 before any step, naming what each node saw."""
    names, _ = two_nodes
    env = {"OMP_NUM_THREADS": "1"}
    dirs = [tmp_path / f"local{rank}" for rank in range(2)]
    procs = [cli.start("launch", "launcher.device=cpu", "parallel.dp=4", "checkpoint.every=3",
                       "train.max_steps=6", *FAST_FAIL, "--nnodes", "2", "--nproc-per-node", "2",
                       "--node-rank", str(rank), "--rdzv-endpoint", f"{SUBNET}.1:{PORT}",
                       "--run-dir", str(dirs[rank]), env=env, prefix=("ip", "netns", "exec", ns))
             for rank, ns in enumerate(names)]
    outputs = [proc.communicate(timeout=240) for proc in procs]
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        text = stdout + stderr
        assert proc.returncode == 2, text
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, text
        error = errors[0]
        print(f"node {rank}: exit {proc.returncode}: {error}")  # shown with -s, for notes
        assert "Traceback" not in text
        for words in ("--run-dir: the nodes do not see one run dir",
                      f"node 0 (", f"at {dirs[0]}: found it", f"node 1 (",
                      f"at {dirs[1]}: no such file", "a shared file system mounted at the same path",
                      "partrain slurm", "Nothing was trained"):
            assert words in error, (words, error)
    for run_dir in dirs:  # nothing trained, no checkpoint begun, no check file left
        assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)[0]
        assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
        assert not (run_dir / ".partrain-node-check").exists()
    for ns in names:
        assert not survivors(lambda ns=ns: _processes_in(ns), 10), f"{ns} kept processes"


RESTART_COMMON = ("launcher.device=cpu", "parallel.dp=2", "train.seq_len=64", "train.eval_every=0",
                  "train.max_steps=8", "checkpoint.every=2")


@pytest.fixture(scope="module")
def two_node_reference(two_nodes, tmp_path_factory):
    """The restart test's run on the same two nodes, uninterrupted: its steps."""
    cli, run_dir = CLI(), tmp_path_factory.mktemp("plain") / "run"
    try:
        procs = _start_nodes(cli, two_nodes[0], run_dir, *RESTART_COMMON, nproc=1)
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    finally:
        cli.kill_all()
    return read_metrics(run_dir)[0]


@pytest.mark.parametrize("paused", [
    # The killed rank sleeps before its part of step 6's save: rank 0 (node 0) waits for it in a
    # collective, sees the connection close and fails too, so both agents count a restart.
    pytest.param("1:6:before", id="node-0-in-a-collective"),
    # Rank 0 (node 0) sleeps outside any collective: node 0's workers are still running when
    # node 1's agent asks for a new rendezvous, and node 0's agent restarts them as a membership
    # change, which torch's agents do not count as a restart.
    pytest.param("0:6:before", id="node-0-busy"),
])
def test_a_worker_killed_on_node_1_restarts_both_nodes_from_the_newest_checkpoint(
        cli, tmp_path, two_nodes, two_node_reference, paused):
    """Two nodes x 1 rank, launcher.max_restarts=1: node 1's worker is killed (SIGKILL) after
    step 4's checkpoint is committed. Both nodes restart their workers, which resume from step 4;
    both launchers say so and exit 0, and the run ends bit-identical to the uninterrupted one on
    the same two nodes (the data position is the step)."""
    from partrain.checkpoint import store

    names, _ = two_nodes
    run_dir = tmp_path / "run"
    nodes = _start_nodes(cli, names, run_dir, *RESTART_COMMON, "launcher.max_restarts=1",
                         nproc=1, env={"PARTRAIN_TEST_SAVE_PAUSE": paused})
    log = run_dir / "logs" / f"rank-{paused[0]}.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "PARTRAIN_TEST_SAVE_PAUSE: rank" in log.read_text()):
        assert time.monotonic() < deadline, "the pause at step 6 never came"
        for node in nodes:
            assert node.poll() is None, node.communicate()
        time.sleep(0.2)
    assert store.newest(run_dir / store.CHECKPOINTS).step == 4
    [worker] = set(ranks_of(run_dir)) & set(_processes_in(names[1]))
    os.kill(worker, signal.SIGKILL)

    outputs = [node.communicate(timeout=240) for node in nodes]
    said = [" ".join((stdout + stderr).split()) for stdout, stderr in outputs]
    # Node 1's launcher names its rank that died; node 0's says the failure was elsewhere.
    who = [("a rank on another node failed (this node's ranks lost their peers or were stopped; "
            "the failed rank is in that node's output and its logs/rank-N.log)"),
           "rank 1 was killed by SIGKILL"]
    for rank, (node, text) in enumerate(zip(nodes, said)):
        print(f"node {rank}: exit {node.returncode}: {text[-1500:]}")  # shown with -s, for notes
        assert node.returncode == 0, text[-3000:]
        assert (f"{who[rank]} (after step 6); restart 1 of 1 (launcher.max_restarts), from "
                "step-00000004 (step 4)") in text, text
        assert "Traceback" not in text
    assert "loaded step 4's checkpoint" in said[0]

    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 9))  # one line per step
    for got, want in zip(steps, two_node_reference):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
    for ns in names:
        assert not survivors(lambda ns=ns: _processes_in(ns), 10), f"{ns} kept processes"


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_rank_that_exits_0_on_node_1_is_named_there(cli, tmp_path, two_nodes, restarts):
    """os._exit(0) in node 1's only rank at step 3 (forked ranks, the CPU default). Node 1's
    launcher said node 0 ended (its store went away when node 0's rank failed on the lost peer),
    and with a restart left its watch stopped the launch under the agent's new round, node 0
    then waited out the rendezvous and said node 0 itself had ended. Now node 1 names its rank,
    node 0 says the failure was elsewhere; with a restart both go on and finish."""
    names, _ = two_nodes
    run_dir = tmp_path / "run"
    nodes = _start_nodes(cli, names, run_dir, *RESTART_COMMON,
                         f"launcher.max_restarts={restarts}", nproc=1,
                         env={"PARTRAIN_TEST_FAULT": "1:3:exit0"})
    said = [" ".join((stdout + stderr).split())
            for stdout, stderr in (node.communicate(timeout=240) for node in nodes)]
    for node, text in zip(nodes, said):
        assert node.returncode == (0 if restarts else 1), text[-3000:]
        assert "Traceback" not in text and "node 0 ended" not in text, text[-3000:]
    if restarts:
        assert ("rank 1 exited with code 0 before the end of the run and recorded no error "
                "(after step 2); restart 1 of 1") in said[1], said[1][-3000:]
        assert "a rank on another node failed" in said[0] and "restart 1 of 1" in said[0]
    else:
        assert ("rank 1 exited with code 0 after step 2, before the end of the run, and "
                "recorded no error") in said[1], said[1][-3000:]
        assert "a rank on another node failed" in said[0], said[0][-3000:]

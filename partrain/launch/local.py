"""Run the workers under torch's elastic agent (torch.distributed.launcher API, as torchrun does).

One node: a c10d rendezvous on 127.0.0.1 with port 0, so the store takes a free port and two
runs can share a machine. Many nodes: every node names the same --rdzv-endpoint and job id; node 0
hosts the rendezvous store there (`is_host`: c10d's own guess from the hostname fails behind NAT,
in containers and for 127.0.0.1), and every node advertises its own address on the interface that
reaches the endpoint (netif.py), so that workers never offer 127.0.0.1 to another machine. A node
that cannot reach the endpoint, or nodes that do not all arrive, fail after
launcher.rdzv_timeout_s with a message naming the endpoint (exit 1), not a hang. c10d numbers the
nodes in the order of their addresses: --node-rank picks the host of the store, not the ranks.
Each worker is `python -m partrain.train RUN_DIR` (launcher.start_method=spawn), or a fork of the
node's rank server that already imported torch and partrain (forkserver; forked.py). If one rank
fails, the agent stops the others within its monitor interval and shutdown timeout; we read the
failed rank's elastic error file (and every other rank's that recorded one) and exit 1 (when
every rank stopped together, its message and code: 4 from the divergence guard, 2 when the nodes
do not see one run dir). A rank whose process exits with code 0 before the end, which the agent
counts as finished, is a failed rank too (ended.py).
SIGINT/SIGTERM reach the agent, which stops all workers; we exit 130. SIGUSR2 (SLURM's
warning before a time limit or a preemption) is passed to the workers, which save a checkpoint at
one step and end; we then exit 3, "relaunch to resume" (preemption.py). A launcher
killed outright (SIGKILL) takes its workers with it through their lifeline (lifeline.py).
"""

import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import (
    LogsDest,
    LogsSpecs,
    SignalException,
)
from torch.distributed import DistStoreError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from partrain.launch import ended, forked
from partrain.launch.failures import (
    add_recorded,
    describe_failure,
    failure_message,
    first_line,
    last_step,
    last_words,
    lost_a_peer,
    recorded,
    restart_reporter,
    say_hang,
    space_left,
    where_to_resume,
    workers_started,
)
from partrain.launch.netif import split_endpoint, wait_for_endpoint
from partrain.launch.preemption import FORWARDER
from partrain.observe import hang, hang_launcher

EXIT_OK, EXIT_RANK_FAILED, EXIT_PREEMPTED, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 1, 3, 4, 130
# A rank's error file names its exception first. Every rank raises one of these together, and
# the launcher says its message as the error and exits with its code: the divergence guard
# (partrain.train.guard), its check of the state a run starts from, a checkpoint whose files do
# not read back as written (partrain.checkpoint.verify), the run-dir check of a
# multi-node start (partrain.train.shared_dir), train.float8 on GPUs without FP8
# (partrain.parallel.float8), offload to nvme without libaio or a writable path
# (partrain.parallel.zero), a preemption signal whose save was refused (partrain.train.loop),
# and a forward whose output breaks the contract (partrain.models.forward.ForwardContract: one the
# meta device could not run before the start; under pp only the last stage raises it, and the
# agent stops the others).
STOPPED = {"Diverged: ": EXIT_DIVERGED, "NonFiniteStart: ": 2, "DamagedCheckpoint: ": 2,
           "RunDirNotShared: ": 2, "ForwardContract: ": 2,
           "Float8Unavailable: ": 2, "OffloadUnavailable: ": 2,
           "PreemptedUnsaved: ": EXIT_PREEMPTED}


def stopped(message: str | None) -> tuple[str, int] | None:
    """(what to say, exit code) when a rank's recorded error is one of STOPPED's."""
    for prefix, code in STOPPED.items():
        if message and message.startswith(prefix):
            return message[len(prefix):], code
    return None


class StoppedTogether(Exception):
    """Raised by the agent's next start of the workers in place of a restart (launcher.max_restarts)
    when they ended on one of STOPPED's errors: the guard's, a refused preemption save, a bad
    setup. A restart would diverge again, or train on after a preemption signal it no longer
    knows of, until the job is killed without a requeue."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.message, self.code = message, code


class _AgentFailures(logging.Handler):
    """How the agent's workers ended: it logs the first failed one of each attempt ("failed
    (exitcode: -9) local_rank: 1 ..."); kept by local rank, to say how a rank that recorded no
    error ended (killed by a signal, or an exit code)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.exitcodes: dict[int, int] = {}
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("failed (exitcode") and len(record.args or ()) >= 2:
            try:
                self.exitcodes[int(record.args[1])] = int(record.args[0])
            except (TypeError, ValueError):
                pass


class RunDirLogsSpecs(LogsSpecs):
    """Elastic error files in RUN_DIR/logs/; the workers send their own output to rank-N.log.
    The agent asks for them at every (re)start of the workers: at a restart, `on_restart` hears
    first what the failed ranks recorded, before their files are cleared for the new attempt,
    and how those that recorded nothing ended.

    It also numbers the attempts. torch's agent counts a restart only after its own workers
    failed (TORCHELASTIC_RESTART_COUNT); an agent whose workers were still running when another
    node's agent asked for a new rendezvous restarts them as a membership change, uncounted, and
    its workers would look for the others under another attempt's store prefix
    (parallel/dist.py) and never meet them. Every agent starts its workers once per rendezvous
    round, so the number of starts is the same on every node: that is the attempt the workers
    are told."""

    def __init__(self, log_dir: Path, on_restart=None, forked: bool = False):
        super().__init__(log_dir=str(log_dir))
        self.on_restart = on_restart
        self.forked = forked
        self.starts = 0
        self.ranks: dict[int, int] = {}  # the last attempt's global rank of each local rank
        self.ended = _AgentFailures() if on_restart is not None else None
        self.end_watch = None  # the launch's ended.EndWatch: ranks that exited 0 in the middle

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        errors = {}
        attempt, self.starts = self.starts, self.starts + 1
        for env in envs.values():
            env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
            if self.forked:  # a spawned rank gets the launcher's environment from Popen
                env.update({k: v for k, v in os.environ.items() if k not in env})
        if attempt and self.on_restart is not None:
            codes = {self.ranks[local]: code for local, code in self.ended.exitcodes.items()
                     if local in self.ranks}
            self.ended.exitcodes.clear()
            said = {int(env["RANK"]): recorded(
                Path(self._root_log_dir) / f"error-rank-{env['RANK']}.json")
                for env in envs.values()}
            for text in said.values():  # every rank stopped on purpose: no restart helps
                if stopped(text):
                    raise StoppedTogether(*stopped(text))
            early = (self.end_watch.ended_early(attempt - 1, not_these=codes)
                     if self.end_watch is not None else [])
            self.on_restart(attempt, said, codes, early, FORWARDER.deliver_again())
        self.ranks = {local: int(env["RANK"]) for local, env in envs.items()}
        hang_launcher.mark_attempt_start(Path(self._root_log_dir), self.ranks.values())
        hang.clear_reports(Path(self._root_log_dir).parent, (env["RANK"] for env in envs.values()))
        ended.clear(Path(self._root_log_dir).parent, self.ranks.values())
        if self.end_watch is not None:
            self.end_watch.new_attempt()
        for local_rank, env in envs.items():
            path = Path(self._root_log_dir) / f"error-rank-{env['RANK']}.json"
            path.unlink(missing_ok=True)
            env["TORCHELASTIC_ERROR_FILE"] = str(path)
            errors[local_rank] = str(path)
        console = dict.fromkeys(envs, "")  # "" = inherit the launcher's stdout/stderr
        return LogsDest(stdouts=console, stderrs=dict(console), tee_stdouts={}, tee_stderrs={},
                        error_files=errors)


@dataclass
class ElasticLaunch:
    """What the agent needs beyond the run dir: the node's place in the job."""

    nnodes: int
    nproc_per_node: int
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0; None = this machine, free port
    run_id: str = "partrain"
    rdzv_timeout_s: int = 120
    local_addr: str | None = None  # this node's address as the other nodes reach it
    max_steps: int | None = None  # train.max_steps: a preemption save before it means exit 3
    max_restarts: int = 0  # launcher.max_restarts: the agent restarts this node's workers
    cuda: bool = False  # NCCL workers: the flight recorder is turned on
    start_method: str = "spawn"  # spawn | forkserver (launcher.start_method, resolved)

    @property
    def multi_node(self) -> bool:
        return self.rdzv_endpoint is not None


def _quiet_agent_logs(run_dir: Path, spec: ElasticLaunch) -> Path:
    """The agent's own chatter goes to logs/launcher.log (one per node when nodes share the run
    dir: launcher-node-R.log); the launcher prints what matters."""
    path = run_dir / "logs" / (f"launcher-node-{spec.node_rank}.log" if spec.multi_node
                               else "launcher.log")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    # torch.multiprocessing: with forked ranks, its "Terminating process ... via signal SIGTERM"
    # when it stops the others after a failure.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher",
                 "torch.multiprocessing"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return path


def launch_workers(run_dir: Path, spec: ElasticLaunch, console_print=print) -> int:
    """Run every local rank to the end; return the launcher's exit code (0, 1, 2, 3, 4 or 130)."""
    agent_log = _quiet_agent_logs(run_dir, spec)
    # SLURM sends SIGUSR2 shortly before the time limit (`partrain slurm` asks for it), or on a
    # preemption: the workers save at one step and stop (preemption.py); this launcher passes the
    # signal on and then exits 3, "relaunch to resume".
    FORWARDER.install()
    started = time.time()
    if spec.cuda:  # the NCCL flight recorder: who is at which collective, dumped on a hang
        (run_dir / "logs" / hang.TRACE_DIR).mkdir(exist_ok=True)
        for name, value in hang.flight_recorder_env(run_dir).items():
            os.environ.setdefault(name, value)
    if spec.multi_node and spec.node_rank != 0 and not _node_0_reachable(spec, console_print):
        return EXIT_RANK_FAILED
    config = _launch_config(run_dir, spec, console_print)
    code = _run_agent(config, run_dir, spec, agent_log, console_print)
    if code != EXIT_OK:
        return code
    saved = _preemption_save(run_dir, started, spec.max_steps)
    if saved is not None:
        again = ("every node's command again (a `partrain slurm` job requeues itself)"
                 if spec.multi_node else
                 f"partrain launch --resume {shlex.quote(str(run_dir))}")
        console_print(f"saved at step {saved.step} on a preemption signal ({saved.path}, "
                      f"{saved.meta.get('seconds', 0):.2f} s from signal to commit); relaunch "
                      f"to resume: {again}")
        return EXIT_PREEMPTED
    return EXIT_OK


def _node_0_reachable(spec: ElasticLaunch, console_print) -> bool:
    """Wait for node 0's store here, in Python: c10d's own retries print C++ stack traces and
    take more than twice the timeout before giving up. False (and why, printed) if it never
    answered within launcher.rdzv_timeout_s."""
    host, port = split_endpoint(spec.rdzv_endpoint)
    problem = wait_for_endpoint(host, port, spec.rdzv_timeout_s)
    if problem:
        console_print(f"rendezvous at {spec.rdzv_endpoint} failed: node {spec.node_rank} "
                      f"could not reach it within launcher.rdzv_timeout_s="
                      f"{spec.rdzv_timeout_s} s ({problem})")
        console_print("  is node 0 running `partrain launch` with --rdzv-endpoint "
                      f"{spec.rdzv_endpoint}, and is that address reachable from here?")
    return not problem


def _launch_config(run_dir: Path, spec: ElasticLaunch, console_print=print) -> LaunchConfig:
    """torchrun's settings for this node: a fixed node count, launcher.max_restarts (each said as
    it happens), a c10d rendezvous on 127.0.0.1 (one node) or at the endpoint (many), and a quick
    stop of the others on a failure."""
    rdzv_configs = {"join_timeout": spec.rdzv_timeout_s, "timeout": spec.rdzv_timeout_s}
    if spec.multi_node:
        # read_timeout bounds the connection to the store, so an unreachable endpoint fails in
        # time; only node 0 hosts the store.
        rdzv_configs.update(read_timeout=spec.rdzv_timeout_s, is_host=spec.node_rank == 0)
    options = dict(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id,
        role="partrain",
        rdzv_backend="c10d",
        rdzv_endpoint=spec.rdzv_endpoint if spec.multi_node else "127.0.0.1:0",
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.2,
        start_method=spec.start_method,
        logs_specs=RunDirLogsSpecs(run_dir / "logs", restart_reporter(
            run_dir, spec.max_restarts, console_print, spec.multi_node)
            if spec.max_restarts else None,
            forked=spec.start_method == "forkserver"),
        local_addr=spec.local_addr if spec.multi_node else "127.0.0.1",
        shutdown_timeout=5,  # seconds between SIGTERM and SIGKILL for the surviving ranks
    )
    # Older torch releases lack some of these fields (shutdown_timeout came in 2.12).
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(**{k: v for k, v in options.items() if k in known})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _run_agent(config: LaunchConfig, run_dir: Path, spec: ElasticLaunch, agent_log: Path,
               console_print) -> int:
    """Run the workers under the agent; how it ended decides the exit code: EXIT_OK when every
    rank finished (each said so: ended.py), else EXIT_DIVERGED (the divergence guard stopped every rank), EXIT_RANK_FAILED
    (a rank failed, or the rendezvous did: each said with the log to read) or
    EXIT_INTERRUPTED."""
    since = time.time()  # hang reports of this launch only
    logged = _size(agent_log)  # the log is appended to: what this launch's agent says follows
    if spec.start_method == "forkserver":  # the rank server runs already (start.py)
        entrypoint, args = forked.rank, (str(run_dir),)
    else:
        entrypoint, args = sys.executable, ("-u", "-m", "partrain.train", str(run_dir))
    watch = config.logs_specs.end_watch = ended.EndWatch(run_dir, config.logs_specs,
                                                         one_node=not spec.multi_node)
    alone = spec.nnodes * spec.nproc_per_node == 1
    unused = (f" (launcher.max_restarts={spec.max_restarts} unused: no rank of this node was "
              "left for the agent to restart)" if spec.max_restarts else "")
    try:
        with hang_launcher.DumpRequester(run_dir), watch:
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        add_recorded(err, run_dir / "logs", config.logs_specs.ranks.values())
        exhausted = (f" (restarts exhausted: launcher.max_restarts={spec.max_restarts})"
                     if spec.max_restarts else "")
        early = watch.ended_early(not_these=err.failures)
        if early:  # it ended before anything the agent saw: the others failed or were stopped
            _say_ended_early(run_dir, early, exhausted, console_print)
            return EXIT_RANK_FAILED
        if any(failure_message(f).startswith(hang.PREFIX) for f in err.failures.values()):
            say_hang(run_dir, since, console_print)
            if FORWARDER.received_at is not None and FORWARDER.received_at >= since:
                # SLURM requeues only on exit 3: a job preempted while hung is not requeued.
                console_print("  a preemption signal (SIGUSR2) came while the ranks were hung: "
                              "nothing could be saved on it, and the launcher exits 1 (a "
                              "`partrain slurm` job is not requeued)")
            console_print(f"  every worker was stopped{exhausted}; {where_to_resume(run_dir)}")
            return EXIT_RANK_FAILED
        for failure in err.failures.values():
            if stopped(failure_message(failure)):
                said, code = stopped(failure_message(failure))
                console_print(f"error: {said}")
                return code
        rank, message = describe_failure(err)
        if spec.multi_node and lost_a_peer(message):
            # Every rank here only lost a peer: the one that failed is on another node.
            console_print(f"a rank on another node failed: this node's rank {rank} lost its peer "
                          f"({message}){exhausted}; the failed rank and its error are in that "
                          "node's output and its logs/rank-N.log")
            console_print(f"  every other rank was stopped; {where_to_resume(run_dir)}")
            return EXIT_RANK_FAILED
        console_print(f"rank {rank} failed: {message}{exhausted}")
        words = (last_words(run_dir / "logs" / f"rank-{rank}.log")
                 if "no Python error recorded" in message else None)
        if words:  # a C++ abort (gloo's collective mismatch) says why only in the rank's log
            console_print(f"  its log ends: {words}")
        console_print(f"  its log: {run_dir / 'logs' / f'rank-{rank}.log'}; every other rank "
                      f"was stopped; {where_to_resume(run_dir, message)}")
        return EXIT_RANK_FAILED
    except StoppedTogether as stop:
        console_print(f"error: {stop.message}")
        return stop.code
    except (RendezvousError, DistStoreError) as err:
        early = watch.ended_early()
        if early:  # node 0 ended on the peer it lost before this node's watch spoke
            _say_ended_early(run_dir, early, "", console_print)
            return EXIT_RANK_FAILED
        if workers_started(agent_log, logged) and spec.node_rank == 0:
            # This node hosts the store: the others did not come back to a new round (a
            # restart), their launchers ended or their nodes are gone.
            console_print(f"the other nodes did not join the rendezvous at {spec.rdzv_endpoint} "
                          f"again within launcher.rdzv_timeout_s={spec.rdzv_timeout_s} s "
                          f"({first_line(err)}): their launchers ended (their output says why) "
                          f"or their nodes are gone; this node's workers were stopped; "
                          f"{where_to_resume(run_dir)}. The agent's log: {agent_log}")
            return EXIT_RANK_FAILED
        if workers_started(agent_log, logged):
            # The store on node 0 went away mid-run: node 0's launcher ended or its node is gone.
            console_print(f"lost the rendezvous store at {spec.rdzv_endpoint} during the run "
                          f"({first_line(err)}): node 0 ended or cannot be reached (its output "
                          f"says why); this node's workers were stopped; "
                          f"{where_to_resume(run_dir)}. The agent's log: {agent_log}")
            return EXIT_RANK_FAILED
        console_print(f"rendezvous at {spec.rdzv_endpoint} failed: {first_line(err)}")
        console_print(f"  all {spec.nnodes} nodes must join within launcher.rdzv_timeout_s="
                      f"{spec.rdzv_timeout_s} s: is `partrain launch` running on every node with "
                      f"--nnodes {spec.nnodes} and --rdzv-endpoint {spec.rdzv_endpoint}? "
                      f"The agent's log: {agent_log}")
        return EXIT_RANK_FAILED
    except json.JSONDecodeError:
        # The agent read a failed rank's error file and found it empty or cut short: the rank
        # could not write it, and a full file system is the usual reason.
        console_print(f"a rank failed and its error file in {run_dir / 'logs'} could not be "
                      f"read: {space_left(run_dir)}; every other rank was stopped. The ranks' logs: "
                      f"{run_dir / 'logs'}/rank-N.log")
        return EXIT_RANK_FAILED
    except (SignalException, KeyboardInterrupt):
        if watch.stopped_launch:  # the watch's own SIGTERM: every rank here had ended
            _say_ended_early(run_dir, watch.ended_early(), unused, console_print, alone)
            return EXIT_RANK_FAILED
        console_print(f"interrupted: all workers stopped; {where_to_resume(run_dir)}")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # from here on, nothing to pass it to
    unfinished = watch.unfinished()
    if unfinished:  # the agent counts an exit with code 0 as a rank's success
        _say_ended_early(run_dir, unfinished, unused, console_print, alone)
        return EXIT_RANK_FAILED
    return EXIT_OK


def _say_ended_early(run_dir: Path, ranks: list[int], exhausted: str, console_print,
                     alone: bool = False) -> None:
    """Ranks that exited with code 0 before the end (ended.py), named with what to do."""
    step = last_step(run_dir)
    who = (f"rank {ranks[0]}" if len(ranks) == 1 else
           "ranks " + ", ".join(str(rank) for rank in ranks))
    console_print(f"{who} exited with code 0 after step {step if step is not None else 0}, "
                  f"before the end of the run, and recorded no error{exhausted}: something in "
                  "the rank ended its process (os._exit in a model's or a library's code, or a "
                  "signal handler of its own)")
    others = "" if alone else "every other rank was stopped; "
    console_print(f"  its log: {run_dir / 'logs' / f'rank-{ranks[0]}.log'}; {others}"
                  f"{where_to_resume(run_dir)}")


def _preemption_save(run_dir: Path, started: float, max_steps: int | None):
    """The checkpoint this launch's workers saved on a preemption signal before the last step,
    if they did (the workers end cleanly after it; the committed checkpoint says why it was
    saved, on the shared run dir every node sees)."""
    from partrain.checkpoint import store

    newest = store.newest(run_dir / store.CHECKPOINTS)
    if (newest is None or newest.reason != "preemption" or
            newest.meta.get("saved_at", 0) < started - 1 or
            (max_steps is not None and newest.step >= max_steps)):
        return None
    return newest

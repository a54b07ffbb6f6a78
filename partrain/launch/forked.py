"""Ranks forked from one rank server per node (launcher.start_method=forkserver).

A spawned rank (`python -m partrain.train RUN_DIR`, launcher.start_method=spawn) imports torch,
DTensor, torch.distributed.checkpoint and partrain anew: about 4 s of CPU a rank, paid by every
rank of a node at once, and again at every restart. A forked rank starts from the rank server
instead, multiprocessing's forkserver, which imported all of that once: the elastic agent runs
the function `rank` below as its entrypoint (a function entrypoint with start_method
forkserver, as torchrun's --start-method), and multiprocessing forks each rank from the server.
The launcher starts the server as soon as its checks have passed (launch/start.py), so that the
server's imports run beside the launcher's own; it is single-threaded, with no process group and
no CUDA context, so every rank still begins from a clean state. A rank's environment is the
launcher's when the agent starts it, as for a spawned rank: elastic sets it in the fork
(local.py's RunDirLogsSpecs hands it the launcher's environment with each rank's variables).

What differs from a spawned rank, each handled here or where it is used:
- the parent is the rank server, not the launcher (lifeline.py ties a forked rank to both);
- the command line is the server's (`python -c 'from multiprocessing.forkserver import ...'`),
  so the launcher finds its ranks as the server's children (observe/hang_launcher.local_workers), and
  the environment names the run dir (PARTRAIN_RUN_DIR, absolute) for anyone looking for a
  run's processes;
- SIGUSR2 is ignored in the server (rank_server.py) and in a fork until the rank takes it;
- the rank returns to the agent at a clean end (multiprocessing then ends the process without
  the interpreter's teardown, as `os._exit` does for a spawned rank);
- the server imports with Python's garbage collector off, and a rank freezes what it inherited
  before it turns the collector on (heap.py).
When the workers have ended, the launcher kills the server (it holds nothing of the run).
"""

import importlib
import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from partrain.launch.heap import after_fork

RUN_DIR_ENV = "PARTRAIN_RUN_DIR"
# rank_server first: from then on SIGUSR2 cannot end the server. The rest is what every rank
# imports (partrain.train.rank brings the training loop, torch, DTensor and DCP) and what the
# agent's entrypoint needs to unpickle in each fork.
PRELOAD = ["partrain.launch.rank_server", "partrain.train.rank", "partrain.launch.forked",
           "torch.distributed.elastic.multiprocessing.api"]
# What torch imports on first use in every layout (DDP's and FSDP's wrappers, DeepSpeed, the
# optimizer's step): about 1 s of CPU a rank. Preloaded for two ranks or more a node, where it
# saves that much per rank (a dp2 x tp2 launch took 14.5 s of CPU instead of 17.7, dp4 x tp2
# 21 instead of 27.6); one rank alone would only wait for the server's import (0.8 s later).
SHARED_BY_RANKS = ["torch._dynamo"]
# What torch.compile imports on its first call, inductor's compile_fx: about 2.5 s of CPU. A rank
# of a DeepSpeed ZeRO run makes that call whether it compiles or not (DeepSpeed's check of the
# optimizer imports its Muon optimizer, which decorates a function with torch.compile), as does
# a run with train.compile; for such runs with two ranks or more a node the server imports it
# once instead (a ZeRO-3 dp2 launch, with parallel/zero.py's LOCAL_SIZE: CPU 21.0 -> 16.7 s).
COMPILER = ["torch._inductor.compile_fx"]


@contextmanager
def rank_server(run_dir: Path, ranks: int = 1, compiles: bool = False):
    """The node's rank server, running for the block: started now, with this environment (which
    holds what must hold when torch is imported: OMP_NUM_THREADS, the launcher's pid, start.py's
    rank_env) and the run dir's path, and killed at the end. Started before the launcher itself
    imports torch, so that the two imports run side by side; what the launcher sets later reaches
    each rank with elastic's variables (local.py, RunDirLogsSpecs). `ranks`: this node's, and
    `compiles` (the ranks will call torch.compile), for what the server preloads."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    # multiprocessing's resource tracker outlives the launcher by a moment: it is started before
    # the run dir is in the environment, so that it is not taken for one of the run's processes.
    # It starts with SIGUSR2 and SIGHUP blocked (a mask outlives exec; the tracker unblocks only
    # SIGINT and SIGTERM): SLURM signals every process of the step before a time limit, a closed
    # terminal hangs up every process of its session, either default action would end it, and
    # the tracker the ranks start again in its place prints a traceback for each shared-memory
    # segment it never saw. Blocked here, not ignored, so that a signal for the launcher
    # meanwhile waits for its handler instead of being lost.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2, signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _stop_server()  # one this process started before holds another launch's environment
    before = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(Path(run_dir).absolute())
    try:
        shared = SHARED_BY_RANKS + COMPILER * compiles if ranks > 1 else []
        multiprocessing.set_forkserver_preload(PRELOAD + shared)
        # The server starts with SIGINT blocked, for good (a mask outlives exec and fork): a
        # Ctrl-C reaches every process of the terminal's group, and during its imports it
        # printed a KeyboardInterrupt traceback (multiprocessing ignores SIGINT in the server
        # only after them); the launcher stops it either way. A pending signal is not passed to
        # a fork, and each rank unblocks SIGINT (train/rank.py).
        interrupts = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, interrupts)
        yield
    finally:
        _stop_server()
        if before is None:  # an in-process launch (the tests') leaves the environment as it was
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = before


def _stop_server() -> None:
    """Kill the server and reap it. multiprocessing has no public way to stop its forkserver; the
    private one is used where it exists, and otherwise the server ends with the launcher."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGKILL)  # the ranks have ended; nothing in it needs a clean end
    except ProcessLookupError:
        pass
    server._stop()


def rank(run_dir: str) -> None:
    """The agent's entrypoint in a forked rank: train to the end and return (on a failure the
    rank ends itself with exit code 1, as a spawned one does)."""
    after_fork()
    # As `python -u` does for a spawned rank: rank 0's progress reaches the console at once.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    importlib.import_module("partrain.train.rank").run(run_dir)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()

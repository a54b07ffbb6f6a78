"""One rank's life around the training loop, however it was started: tied to its launcher
(lifeline), its stack on the launcher's request (hang dumps), SIGUSR2 noted for a clean save
(preemption), then `loop.main`. Started as `python -m partrain.train RUN_DIR` (__main__.py,
launcher.start_method=spawn) or forked from the node's rank server (partrain.launch.forked,
launcher.start_method=forkserver)."""

import os
import signal
import sys
import time
import traceback
from pathlib import Path

from partrain.launch.ended import rank_finished, rank_started
from partrain.launch.failures import lost_a_peer
from partrain.launch.lifeline import hold_lifeline
from partrain.launch.preemption import PreemptionFlag
from partrain.observe.hang import listen_for_dumps
from partrain.train.loop import main

# How long a rank whose collective only lost a peer waits before it exits (run, below).
LOST_PEER_GRACE_S = 2.0


def run(run_dir: str, early_signals: list[float] = ()) -> None:
    """Train this rank to the end and return; on any failure, end the process with exit code 1
    (the error file is written by then). early_signals: times SIGUSR2 arrived before this rank
    could take it (the first counts)."""
    # First of all: from here on, a launcher killed with SIGKILL takes this rank along; and a
    # launcher that asks for this rank's stack (a hang elsewhere) gets it.
    hold_lifeline()
    listen_for_dumps()
    # Its pid for the launcher, which watches for a rank that ends in the middle without a word
    # (launch/ended.py), and at the end, that it finished.
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    rank_started(Path(run_dir), rank, attempt)
    # SIGINT raises KeyboardInterrupt, whatever this rank inherited: a forked rank's server
    # blocks it (forked.rank_server), and a launch started in the background by a script (`cmd
    # &`) ignores it. The agent stops the ranks with the signal it got: ignored, a Ctrl-C left
    # them training (and saving) until it killed them 5 s later.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # Then: SIGUSR2 asks for a checkpoint and a clean stop (the launcher passes SLURM's on).
    preemption = PreemptionFlag()
    preemption.install()
    if early_signals and preemption.at is None:
        preemption.at = early_signals[0]
    try:
        main(run_dir, preemption)
        rank_finished(Path(run_dir), rank, attempt)
    except BaseException as err:
        # @record has written the error file for the launcher. Skip interpreter teardown: the
        # other ranks are being stopped, and gloo's destructors could abort on a half-open group.
        if not isinstance(err, KeyboardInterrupt):  # Ctrl-C: the launcher says so, once
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if lost_a_peer(f"{err} {err.__cause__ or ''}"):
            # The rank that died first must be the one the agent sees end first: with forked
            # ranks it reports one failure a poll (every 0.2 s), the first process it finds
            # ended, and a rank killed by a signal recorded nothing to name it by otherwise.
            # The agent stops this rank before the grace is over.
            time.sleep(LOST_PEER_GRACE_S)
        os._exit(1)

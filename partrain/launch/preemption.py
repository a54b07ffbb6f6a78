"""Preemption: SLURM's SIGUSR2 before a time limit or a preemption, from launcher to every rank.

SLURM signals every process of the job step (the `partrain launch` process on each node and its
workers); `kill -USR2` by hand, or a site's tooling, may reach only the launcher, whose workers run
in sessions of their own (torch's elastic agent starts them with start_new_session). So the
launcher passes the signal on (`SignalForwarder`) and a rank takes it once (the first signal's
time counts). It must not reach the elastic agent as a death signal: the agent would stop the
workers after its close timeout, mid-save. A spawned worker sets its handler before it imports
torch (train/__main__.py); a forked one starts with the signal ignored, as its rank server does
(rank_server.py). The launcher delivers only to workers whose handler is set, so that an early
signal neither kills a worker nor is lost. On the ranks, `PreemptionFlag` notes the time of the signal;
at the end of every step the ranks agree (a min-reduce of that time, infinity for "not signalled")
so that all save at the same step even when only some were signalled.
"""

import math
import os
import signal
import threading
import time
from pathlib import Path

from partrain.observe.hang_launcher import local_workers

PREEMPT_SIGNAL = signal.SIGUSR2


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler installed for the signal (/proc/PID/status SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class SignalForwarder:
    """Launcher side: on SIGUSR2, deliver it to every local worker once its handler is set."""

    def __init__(self, patience_s: float = 300.0):
        self.patience_s = patience_s
        self.received_at: float | None = None

    def install(self) -> None:
        """Idempotent; `partrain launch` installs it first thing, so that a signal during the
        config's validation or the rendezvous is kept for the workers, not a death."""
        signal.signal(PREEMPT_SIGNAL, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.time()
        self._start_delivery()

    def _start_delivery(self) -> None:
        threading.Thread(target=self._deliver, name="partrain-preempt", daemon=True).start()

    def deliver_again(self) -> bool:
        """At a restart of the workers (launcher.max_restarts): a signal this launcher got goes
        to the new workers too, since the ones that had it may have failed before they saved
        (under SLURM it comes once, before the time limit; lost, the job trained on until its
        SIGTERM and was not requeued). True where there was one to pass on."""
        if self.received_at is None:
            return False
        self._start_delivery()
        return True

    def _deliver(self) -> None:
        deadline, delivered = time.monotonic() + self.patience_s, set()
        while time.monotonic() < deadline:
            workers = set(local_workers())
            for pid in workers - delivered:
                if _catches(pid, PREEMPT_SIGNAL):
                    try:
                        os.kill(pid, PREEMPT_SIGNAL)
                    except ProcessLookupError:
                        pass
                    delivered.add(pid)
            if workers and workers <= delivered:
                return
            time.sleep(0.05)


class PreemptionFlag:
    """Worker side: remembers when SIGUSR2 arrived; `agreed()` is the collective decision."""

    def __init__(self):
        self.at: float | None = None

    def install(self) -> None:
        signal.signal(PREEMPT_SIGNAL, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.at is None:
            self.at = time.time()

    def agreed(self, device) -> float | None:
        """Collective over all ranks: the earliest signal time, or None if no rank got one."""
        import torch
        import torch.distributed as dist

        when = torch.tensor([math.inf if self.at is None else self.at], dtype=torch.float64,
                            device=device)
        dist.all_reduce(when, op=dist.ReduceOp.MIN)
        value = when.item()
        return None if math.isinf(value) else value


# The launcher's one forwarder (a process has one handler per signal).
FORWARDER = SignalForwarder()

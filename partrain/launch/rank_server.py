"""Imported first by the rank server (partrain.launch.forked), and by nothing else: SIGUSR2 is
ignored there. SLURM signals every process of the job step before a time limit or a
preemption; the signal's default action would end the server, and with it (PR_SET_PDEATHSIG,
lifeline.py) every rank, mid-step. Its forks start with the signal ignored too until the rank
installs its handler (PreemptionFlag); the launcher's forwarder waits for that handler before it
passes the signal on, so none is lost.

It also turns Python's cyclic garbage collector off for the server's imports (heap.py says why):
each rank turns it on again, after freezing what it inherited (forked.rank)."""

import gc
import signal

signal.signal(signal.SIGUSR2, signal.SIG_IGN)
gc.disable()

"""`python -m partrain.train RUN_DIR`: one rank of a run, as the elastic agent starts it."""

# Before torch is imported (seconds): SLURM signals every process of the job step, and the
# default action of SIGUSR2 would end this rank. Noted here; PreemptionFlag takes it over.
import signal as _signal
import time as _time

_EARLY_SIGNAL: list[float] = []
_signal.signal(_signal.SIGUSR2, lambda signum, frame: _EARLY_SIGNAL.append(_time.time()))

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from partrain.launch.lifeline import hold_lifeline  # noqa: E402
from partrain.observe.hang import listen_for_dumps  # noqa: E402
from partrain.launch.preemption import PreemptionFlag  # noqa: E402
from partrain.train.loop import main  # noqa: E402

# First of all: from here on, a launcher killed with SIGKILL takes this rank along; and a
# launcher that asks for this rank's stack (a hang elsewhere) gets it.
hold_lifeline()
listen_for_dumps()
# Then: SIGUSR2 asks for a checkpoint and a clean stop (the launcher passes SLURM's on).
preemption = PreemptionFlag()
preemption.install()
if _EARLY_SIGNAL and preemption.at is None:
    preemption.at = _EARLY_SIGNAL[0]
try:
    main(sys.argv[1], preemption)
except BaseException:
    # @record has written the error file for the launcher. Skip interpreter teardown: the other
    # ranks are being stopped, and gloo's destructors could abort on a half-open group.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
# A clean end: main() closed every file of the run (checkpoints, metrics, curves) and ended the
# process group. Skip the interpreter's teardown too: unloading torch module by module costs about
# 0.5 s of CPU a rank, paid by every rank of a CPU node at once; only the log handlers and the
# standard streams are left to flush.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

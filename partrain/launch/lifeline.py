"""No worker outlives its launcher, even one killed with SIGKILL (docs/design.md, exit codes).

The elastic agent starts each worker in a session of its own, so a launcher that dies without
running its handlers (SIGKILL, the OOM killer) takes nobody with it: its workers are re-parented
and train on, writing into the run dir. The launcher puts its pid in PARTRAIN_LAUNCHER_PID and
each worker calls `hold_lifeline()` as it starts:

- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), so that the kernel kills the worker with its parent.
  The signal follows the *thread* that forked the worker, not the process: the agent forks
  (subprocess.Popen) in the thread that called elastic_launch, which stays blocked there until the
  workers have ended, so it never fires early. Then a check that the parent is still the
  launcher: one that died between the fork and the prctl has left no one to send the signal.
  A forked rank (launcher.start_method=forkserver) is the child of the launcher's rank server
  (a single-threaded process): the signal comes with the server's end, but the server outlives a
  launcher killed outright (its forks hold the pipe it watches), so such a rank also watches
  that its parent's parent is still the launcher, as below.
- Other POSIX systems (no prctl), and forked ranks: a daemon thread polls the parent (and the
  rank server's parent) every 0.5 s.
- Windows: nothing (a process is not re-parented there, so the parent pid says nothing).

Only the worker itself is tied: the kernel does not pass the setting on to processes it starts
(torch's data loader workers watch their parent themselves). A DeepSpeed/ZeRO rank is the same
`partrain.train` process, so it is covered.
"""

import ctypes
import os
import signal
import sys
import threading
import time

from partrain.observe.hang_launcher import parent_of

LAUNCHER_PID_ENV = "PARTRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_PERIOD_S = 0.5


def hold_lifeline() -> None:
    """Tie this worker's life to the launcher named in the environment (none: a worker started
    by hand or by another launcher is left alone)."""
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher_pid or sys.platform == "win32":
        return
    launcher_pid, parent = int(launcher_pid), os.getppid()
    if not _die_with_parent() or parent != launcher_pid:
        threading.Thread(target=_watch, args=(launcher_pid, parent), name="partrain-lifeline",
                         daemon=True).start()
    if not _tied(launcher_pid, parent):
        _orphaned()


def _die_with_parent() -> bool:
    """Ask the kernel for SIGKILL when the parent dies; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def _tied(launcher_pid: int, parent: int) -> bool:
    """Still the launcher's: the parent has not changed, and it is the launcher (a spawned rank)
    or the launcher's rank server (a forked rank; without /proc only the parent is watched)."""
    if os.getppid() != parent:
        return False
    return parent == launcher_pid or parent_of(parent) in (launcher_pid, None)


def _watch(launcher_pid: int, parent: int) -> None:
    while _tied(launcher_pid, parent):
        time.sleep(WATCH_PERIOD_S)
    _orphaned()


def _orphaned() -> None:
    """The launcher is gone: nobody will collect this worker's result, so it must not train on."""
    try:
        os.write(2, f"partrain worker {os.getpid()}: the launcher is gone (its pid was "
                    f"{os.environ[LAUNCHER_PID_ENV]}, the parent is now {os.getppid()}); "
                    "stopping\n".encode())
    except OSError:  # stderr may have been the dead launcher's pipe
        pass
    os._exit(1)

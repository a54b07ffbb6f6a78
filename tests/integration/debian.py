"""Debian packages that some integration tests need (SLURM's daemons, libaio for DeepSpeed's
async_io op), installed when missing. The tests are skipped, with the reason printed, only where
that cannot work: not root, or no apt-get. A failed install as root fails the tests instead, so
that CI never passes by skipping them."""

import fcntl
import os
import shutil
import subprocess

LOCK = "/tmp/partrain-tests-apt.lock"


class Unavailable(Exception):
    """The packages cannot be installed on this machine: the tests skip with this reason."""


def install(packages: tuple[str, ...], what: str) -> None:
    """`apt-get install` the packages (once more after `apt-get update` on a fresh machine's
    stale lists); `what` names the missing thing in the reasons."""
    if os.geteuid() != 0:
        raise Unavailable(f"{what} is not installed and installing it needs root "
                          f"(apt-get install {' '.join(packages)})")
    if not shutil.which("apt-get"):
        raise Unavailable(f"{what} is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    # One install at a time (the async_io op's background build installs libaio while a test
    # may install SLURM): a second apt-get would fail on apt's own lock instead of waiting.
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:  # stale package lists on a fresh machine
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"apt-get install {' '.join(packages)} failed:\n{result.stderr[-2000:]}")

"""Debian packages that some integration tests need (SLURM's daemons, libaio for DeepSpeed's
async_io op), installed when missing. The tests are skipped, with the reason printed, only where
that cannot work: not root, or no apt-get. A failed install as root fails the tests instead, so
that CI never passes by skipping them."""

import os
import shutil
import subprocess


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
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:  # stale package lists on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"apt-get install {' '.join(packages)} failed:\n{result.stderr[-2000:]}")

"""Offload to NVMe (parallel.offload_optimizer / offload_params = nvme, DeepSpeed's ZeRO-3 with
its async_io op), the parts that need no torch: each run's own swap folder under
parallel.offload_nvme_path, what a node needs to offload there, and the folder's removal by the
node's launcher. partrain.parallel.zero checks every rank before DeepSpeed starts."""

import errno
import hashlib
import mmap
import os
import shutil
import socket
from pathlib import Path

from partrain.errors import reason


def on_nvme(parallel_cfg) -> list[str]:
    """The keys that offload to nvme (`parallel.offload_optimizer=nvme`, ...), or none."""
    return [f"parallel.{k}=nvme" for k in ("offload_optimizer", "offload_params")
            if parallel_cfg[k] == "nvme"]


def run_swap_dir(nvme_path: str, run_dir: Path) -> Path:
    """This run's folder under parallel.offload_nvme_path: `<run dir's name>-<8 hex digits of its
    absolute path>`. DeepSpeed names its swap files by rank and tensor alone, so two runs given
    the same path (two jobs on one node) would swap through the same files, each overwriting the
    other's optimizer state without a word; a restart or a resume of the run finds its own
    folder again (what it holds is rebuilt from the checkpoint, never read back)."""
    run_dir = Path(run_dir).resolve()
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
    return Path(nvme_path) / f"{run_dir.name}-{digest}"


def _direct_write(folder: Path) -> None:
    """Write one page to a new file in `folder` as DeepSpeed's async_io writes its swap files
    (O_DIRECT, from page-aligned memory), and remove it; an OSError says why not."""
    probe = folder / f".partrain-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        with mmap.mmap(-1, mmap.PAGESIZE) as page:
            os.write(fd, page)
    finally:
        os.close(fd)
        probe.unlink()


def nvme_problem(parallel_cfg, folder: Path) -> str | None:
    """Why this node cannot offload to nvme in `folder` (the run's, under
    parallel.offload_nvme_path), or None (also when nothing goes to nvme). The folder is made if
    missing and must take a file; DeepSpeed's async_io op must be buildable here (libaio's
    headers and library: its own compile-and-link test)."""
    keys = on_nvme(parallel_cfg)
    if not keys:
        return None
    where = (f"parallel.offload_nvme_path={parallel_cfg.offload_nvme_path} (this run's folder "
             f"in it, {folder.name})")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _direct_write(folder)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return (f"{keys[0]}: {where} is on a filesystem of {socket.gethostname()} without "
                    "direct I/O (O_DIRECT), which DeepSpeed's async_io writes its swap files "
                    "with (tmpfs, ramfs and some network filesystems have none); point it at a "
                    "directory on a local NVMe drive")
        return (f"{keys[0]}: {where} cannot be made or written on {socket.gethostname()} "
                f"({reason(err)}); point it at a directory on a local NVMe drive that this user "
                "can write, on every node")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        return (f"{keys[0]} needs DeepSpeed's async_io op, which needs libaio's headers and "
                f"library, and {socket.gethostname()} has none: install them on every node "
                "(Debian and Ubuntu: apt-get install libaio-dev), or say where they are with "
                "CPATH=<dir>/include LIBRARY_PATH=<dir>/lib LD_LIBRARY_PATH=<dir>/lib (gcc's "
                "and the loader's); or offload to the host instead (=cpu)")
    return None


def remove_swap_dir(parallel_cfg, run_dir: Path) -> None:
    """The run's swap folder on this node, removed when the node's launcher ends, however its
    ranks ended (DeepSpeed removes no swap file; a folder left by a launcher killed outright is
    taken again by the run's next start, and removed at its end)."""
    if on_nvme(parallel_cfg):
        shutil.rmtree(run_swap_dir(parallel_cfg.offload_nvme_path, run_dir), ignore_errors=True)

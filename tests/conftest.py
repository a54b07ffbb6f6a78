"""Fixtures shared by every test directory: real file systems that refuse writes.

Root ignores permission bits (CI runs the tests as root), so `chmod` cannot make a directory
that root cannot write. These fixtures mount a small tmpfs instead: the kernel refuses the
writes whoever asks. Each yields a Path on its own mount, inside the test's tmp_path, and
unmounts and removes it at the end of the test, whatever the test did. They skip, with the
reason, where mounting is not permitted (not root, or a container without CAP_SYS_ADMIN).
"""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest


def pytest_configure(config):
    # A suite started in the background (`pytest &` from a script, nohup) has SIGINT ignored, as
    # a shell's background job does, and passes that on to every launcher it starts, which then
    # ignores the Ctrl-C tests' SIGINT as a background job should (the first Ctrl-C "lost" in
    # the full runs of 2026-11-28): the suite runs as from a terminal's foreground.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Run by default (CI runs plain `pytest`); `-m "not slow"` leaves them out for a quick pass
    # under 6 minutes on 2 cores.
    config.addinivalue_line(
        "markers", "slow: the heavy part of the suite: the parity matrices, DeepSpeed runs, "
        "benchmarks, real SLURM daemons and network namespaces")


# Tests that the quick pass leaves to the full suite (which runs them all): each takes 6-20 s of
# the quick pass's 6 minutes, and what it checks has a cheaper neighbour there (one launch, one
# parity run, one resume, one failing rank, one skipped step stay quick). Measured on 2 cores:
# the quick pass ran 8:06 with them, and these are about 130 s of it.
FULL_SUITE_ONLY = (
    "tests/integration/test_restart.py::test_a_restarted_run_ends_as_the_uninterrupted_one[dp2]",
    "tests/integration/test_checkpoint.py::test_preemption_signal_saves_exits_3_and_resumes",
    "tests/integration/test_divergence.py::"
    "test_a_diverging_run_stops_with_exit_4_and_keeps_its_good_checkpoints",
    "tests/integration/test_divergence.py::test_a_checkpoint_holding_a_nan_is_not_trained_from",
    "tests/integration/test_divergence.py::test_skipped_steps_in_a_row_stop_every_rank_with_exit_4",
    "tests/integration/test_failure.py::test_a_full_disk_fails_loudly_and_loses_nothing",
    "tests/integration/test_hang.py::test_a_sleeping_rank_is_named_and_the_others_wait_for_it",
    "tests/integration/test_launch.py::"
    "test_degrees_on_the_command_line_set_the_processes[degrees1-2]",
    "tests/distributed/test_mesh.py::test_mesh_groups_match_parallel_dims",
    "tests/distributed/test_checkpoint.py::test_state_has_the_single_process_names[tp2]",
    "tests/unit/models/test_recompute.py::test_compiled_blocks_train_the_same_model[quickstart-none]",
    "tests/unit/models/test_recompute.py::test_compiled_blocks_train_the_same_model[moe-tiny-none]",
    "tests/unit/plan/test_search.py::test_guide_many_nodes_fast_network",
    "tests/unit/plan/test_search.py::test_guide_many_nodes_slow_network",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(FULL_SUITE_ONLY):
            item.add_marker(pytest.mark.slow)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def _mounted_tmpfs(mount_point: Path, options: str):
    """Mount a tmpfs on mount_point (made here) or skip the test; returns the unmount callback."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the tests as root)")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    mount_point.mkdir()
    done = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point))
    if done.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")

    def unmount():
        done = _run("umount", str(mount_point))
        if done.returncode != 0:  # busy (a file left open): detach now, freed when closed
            done = _run("umount", "-l", str(mount_point))
        assert done.returncode == 0, f"umount {mount_point}: {done.stderr.strip()}"
        mount_point.rmdir()

    return unmount


@pytest.fixture
def readonly_fs(tmp_path):
    """An empty directory on a read-only file system (a tmpfs remounted `ro`): creating anything
    in it, a file or a directory, fails with EROFS ("Read-only file system"), even for root.
    Reading and listing work. Use it as a parent, e.g. `readonly_fs / "out"`."""
    mount_point = tmp_path / "readonly-fs"
    unmount = _mounted_tmpfs(mount_point, "size=64k,mode=0755")
    try:
        done = _run("mount", "-o", "remount,ro", str(mount_point))
        if done.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {done.stderr.strip()}")
        yield mount_point
    finally:
        unmount()


@pytest.fixture
def full_fs(request, tmp_path):
    """An empty directory on a full file system (a 64 KiB tmpfs filled by a file outside that
    directory): creating directories and empty files works (tmpfs gives them no data blocks),
    but writing data fails with ENOSPC ("No space left on device") as soon as it needs a block.
    Leave some room with indirect parametrization, bytes rounded down to whole 4 KiB pages:
    `@pytest.mark.parametrize("full_fs", [8192], indirect=True)`; default 0. The directory
    starts empty, so a test can assert that nothing was left in it."""
    free = getattr(request, "param", 0)
    mount_point = tmp_path / "full-fs"
    unmount = _mounted_tmpfs(mount_point, "size=64k,mode=0755")
    try:
        left = shutil.disk_usage(mount_point).total - free
        with open(mount_point / "filler", "wb", buffering=0) as f:
            while left > 0:
                try:
                    left -= f.write(bytes(min(4096, left)))
                except OSError:  # ENOSPC: full a little early is still full
                    break
        root = mount_point / "root"
        root.mkdir()
        yield root
    finally:
        unmount()

"""Hostile input: run dirs and `data prepare --out` on disks that refuse writes, a real
read-only or full tmpfs (root ignores chmod). The contract and the checks are test_hostile.py's
(tests/unit/cli/hostile.py); the tables of other run dirs are test_hostile_io.py's.
"""

import pytest

from tests.unit.cli.hostile import (
    Ctx,
    assert_refused,
    assert_untouched,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    tree,
)

# ------------------------------------------------------------------------------------------------
# Disks that refuse writes (root ignores chmod: a real read-only or full tmpfs)

COMMANDS = [pytest.param(["launch", "--dry-run"], id="launch"),
            pytest.param(["slurm", "--nodes", "1", "--dry-run"], id="slurm")]


@pytest.mark.parametrize("command", COMMANDS)
def test_run_dir_on_readonly_fs(command, readonly_fs, run_main, tmp_path):
    run_dir = readonly_fs / "run"
    before = tree(tmp_path)
    assert_refused(run_main(*command, "--run-dir", str(run_dir)),
                   ["--run-dir", str(run_dir), "read-only"])
    assert_untouched(tmp_path, before)


@pytest.mark.parametrize("command", COMMANDS)
def test_run_dir_on_full_fs(command, full_fs, run_main, tmp_path):
    run_dir = full_fs / "deeper" / "run"
    before = tree(tmp_path)
    assert_refused(run_main(*command, "--run-dir", str(run_dir)),
                   ["--run-dir", str(run_dir), "bytes free"])
    assert_untouched(tmp_path, before)


def test_prepare_on_readonly_fs(readonly_fs, run_main, tmp_path, monkeypatch):
    text = Ctx(tmp_path, monkeypatch).text()
    out = readonly_fs / "tokens"
    before = tree(tmp_path)
    assert_refused(run_main("data", "prepare", text, "--out", str(out)),
                   ["--out", str(out), "Read-only file system"])
    assert_untouched(tmp_path, before)


@pytest.mark.parametrize("full_fs", [0, 8192], indirect=True)
def test_prepare_on_full_fs(full_fs, run_main, tmp_path, monkeypatch):
    """With 8 KiB of room the first file is written in part before the disk fills."""
    text = Ctx(tmp_path, monkeypatch).text(size=40000)
    out = full_fs / "a" / "tokens"
    before = tree(tmp_path)
    assert_refused(run_main("data", "prepare", text, "--out", str(out)),
                   ["--out", str(out), "No space left on device", "nothing was left behind"])
    assert_untouched(tmp_path, before)
    assert list(full_fs.iterdir()) == []

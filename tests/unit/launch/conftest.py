"""Fixtures of the launch tests."""

from pathlib import Path

import pytest


@pytest.fixture
def sbatch_stub(tmp_path, monkeypatch):
    """An `sbatch` on PATH that answers as told (a stub: the real one is in test_slurm.py)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))

    def make(body: str) -> Path:
        stub = bin_dir / "sbatch"
        stub.write_text(f"#!/bin/sh\n{body}\n")
        stub.chmod(0o755)
        return stub
    return make

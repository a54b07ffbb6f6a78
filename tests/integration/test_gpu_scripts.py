"""The parts of the device scripts (scripts/gpu_check.py) that a CPU can check: a lent GPU's
minutes are few, and a case that fails there must bring back what says why."""

import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_a_failed_case_brings_back_the_failing_ranks_traceback(tmp_path, monkeypatch, capsys):
    """The launcher's output names the error only ("rank 0 failed: ValueError: ..."); the
    traceback is in the rank's log, on the device machine, which is given back after the call.
    The third H200 session spent a call of its 15 minutes fetching one."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_check

    monkeypatch.setenv("PARTRAIN_TEST_FAULT", "0:2")
    overrides = ["launcher.device=cpu", "train.max_steps=3", "train.eval_every=0",
                 "checkpoint.every=0", "checkpoint.save_last=false"]
    row = gpu_check.run_case("ddp", overrides, tmp_path, warmup=0)
    assert row["failed"] == "exit 1", row
    assert "rank 0 failed: RuntimeError: injected fault" in row["log"]
    rank0 = row["rank_log"]["rank-0.log"]
    assert "Traceback (most recent call last)" in rank0 and "injected fault" in rank0
    # and the launch's lines went on to stderr as they came, named by case: a stage stopped at
    # its limit (the fourth session's disk case) still shows how far it got
    streamed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ddp] ")]
    assert any(re.match(r"\[ddp\] step +1 +loss", line) for line in streamed), streamed
    assert any("injected fault" in line for line in streamed), streamed
    sys.modules.pop("gpu_check", None)

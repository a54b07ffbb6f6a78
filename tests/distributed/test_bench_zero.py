"""scripts/bench_zero.py on a small model: for each stage, the bytes the engine really holds
(real DeepSpeed on gloo) are within 10% of the ZeRO formula, and each stage holds less than the
one before."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_zero_measures_the_formulas():
    args = ["--layers", "2", "--dim", "128", "--seq", "64", "--steps", "1", "--json"]
    # Its own process group, killed at the end: the spawned ranks never outlive the test.
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_zero.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    stages = json.loads(out)["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    totals = []
    for s in stages:
        measured = s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"]
        assert abs(measured / s["predicted_bytes"] - 1) <= 0.10, s
        assert s["tokens_per_s_ratio"] > 0
        totals.append(measured)
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / 1.5, totals

"""scripts/bench_tp.py on a tiny model: it runs both implementations, its independent byte count
(wrapped torch.distributed calls) equals the arithmetic, and both start from the same loss. Speed
is the script's business, never asserted here."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tp_counts_the_theoretical_bytes():
    args = ["--json", "--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2",
            "--seq", "32", "--batch", "2", "--steps", "1", "--rounds", "1", "--warmup", "1"]
    # Its own process group, killed at the end: the spawned ranks never outlive the test.
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_tp.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    tokens, dim, layers = 2 * 32, 64, 2
    assert result["tp_block_bytes_theory"] == 4 * layers * tokens * dim * 4
    assert result["tp_bytes_per_step"] == result["tp_bytes_theory"] > result["tp_block_bytes_theory"]
    assert result["tp_collectives_per_step"] == result["tp_collectives_theory"] == 4 * layers + 2 + 3 + 1
    first = result["loss_first_step"]
    assert abs(first["partrain"] - first["dtensor"]) <= 1e-5 * first["dtensor"]
    assert result["partrain_tokens_per_s"] > 0 and result["dtensor_tokens_per_s"] > 0

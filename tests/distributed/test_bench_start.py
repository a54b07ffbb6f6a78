"""scripts/bench_start.py on its smallest launch: both start methods run the same dp2 run
through the CLI, the script checks that they agree on every step's loss and grad_norm (it exits
non-zero otherwise) and measures both. Speed is the script's business, never asserted here."""

import pytest

from tests.distributed.helpers import run_script_json

pytestmark = pytest.mark.slow


def test_bench_start_runs_both_methods_to_the_same_steps():
    result = run_script_json("bench_start.py", "--layouts", "dp2", "--reps", "1", "--steps", "2",
                             timeout=240)
    [row] = result["layouts"]
    assert (row["layout"], row["device"], row["ranks"], row["reps"], row["steps"]) == (
        "dp2", "cpu", 2, 1, 2)
    assert row["largest_gap"] == 0.0  # on CPU the two methods compute the same bits
    for method in ("spawn", "forkserver"):
        assert row[f"{method}_wall_s"] > 0 and row[f"{method}_cpu_s"] > 0
    assert row["wall_ratio"] == row["forkserver_wall_s"] / row["spawn_wall_s"]

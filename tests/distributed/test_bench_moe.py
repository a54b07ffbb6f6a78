"""scripts/bench_moe.py on a tiny MoE at two processes: it runs ep 1 and 2 at the same world size,
each rank holds 1/ep of the expert weights, ep=1 moves nothing, and what ep 2 sent is the formula's
order (the formula assumes uniform routing, a fresh router is near it; the exact count against
the routing is tests/distributed/test_expert.py's). Speed is the script's business, never
asserted."""

import pytest

from tests.distributed.helpers import run_script_json

pytestmark = pytest.mark.slow


def test_bench_moe_runs_every_ep():
    args = ["--world", "2", "--layers", "1", "--dim", "64", "--expert-ffn", "64", "--seq", "32",
            "--batch", "2", "--reps", "1", "--balance-steps", "0"]
    result = run_script_json("bench_moe.py", *args, timeout=240)
    runs = {r["ep"]: r for r in result["runs"]}
    assert sorted(runs) == [1, 2]  # ep=4 needs 4 ranks
    assert runs[1]["bytes_sent"] == runs[1]["formula_bytes"] == 0
    assert runs[2]["memory_ratio"] == pytest.approx(1 / 2)
    assert 0.5 < runs[2]["bytes_over_formula"] < 1.5, runs[2]
    assert runs[2]["tokens_per_s"] > 0
    assert result["balance"] == []

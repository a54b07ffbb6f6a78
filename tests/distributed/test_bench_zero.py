"""scripts/bench_zero.py on a small model: for each stage, the bytes the engine really holds
(real DeepSpeed on gloo) are within 10% of the ZeRO formula, and each stage holds less than the
one before."""

import pytest

from tests.distributed.helpers import run_script_json


@pytest.mark.slow
def test_bench_zero_measures_the_formulas():
    args = ["--layers", "2", "--dim", "128", "--seq", "64", "--steps", "1"]
    stages = run_script_json("bench_zero.py", *args, timeout=400)["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    totals = []
    for s in stages:
        measured = s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"]
        assert abs(measured / s["predicted_bytes"] - 1) <= 0.10, s
        assert s["tokens_per_s_ratio"] > 0
        totals.append(measured)
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0] / 1.5, totals

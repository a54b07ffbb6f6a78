"""scripts/bench_checkpoint.py on a tiny model: both layouts run every measurement, every load
returns the saved tensors, DCP writes each tensor once (dp2's raw files hold it twice) and the
true size matches the model. Speed is the script's business, never asserted here."""

import pytest

from tests.distributed.helpers import run_script_json


@pytest.mark.slow
def test_bench_checkpoint_writes_each_tensor_once():
    args = ["--dim", "64", "--layers", "2", "--vocab", "256", "--heads", "4", "--kv-heads", "2",
            "--reps", "1"]
    layouts = {r["layout"]: r for r in run_script_json("bench_checkpoint.py", *args,
                                                       timeout=400)["layouts"]}
    assert sorted(layouts) == ["dp2", "tp2"]
    for r in layouts.values():
        assert r["loaded_ok"], r
        assert r["true_bytes"] == r["true_bytes_from_model"]
        # At this size DCP's metadata and per-tensor headers are a few percent; never less.
        assert 1.0 < r["bytes_ratio"] < 1.25, r
        assert r["async_bytes"] == pytest.approx(r["dcp_bytes"], rel=0.02)
        assert 0 < r["async_blocked_s"] <= r["async_total_s"]
        assert min(r["save_dcp_s"], r["save_raw_s"], r["load_dcp_s"], r["load_raw_s"]) > 0
    assert layouts["dp2"]["raw_bytes"] > 1.9 * layouts["dp2"]["true_bytes"]
    assert layouts["tp2"]["raw_bytes"] < 1.25 * layouts["tp2"]["true_bytes"]

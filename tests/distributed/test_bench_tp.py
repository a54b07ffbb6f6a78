"""scripts/bench_tp.py on a tiny model: it runs both implementations, its independent byte count
(wrapped torch.distributed calls) equals the arithmetic, and both start from the same loss. Speed
is the script's business, never asserted here."""

from tests.distributed.helpers import run_script_json


def test_bench_tp_counts_the_theoretical_bytes():
    args = ["--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2",
            "--seq", "32", "--batch", "2", "--steps", "1", "--rounds", "1", "--warmup", "1"]
    result = run_script_json("bench_tp.py", *args, timeout=240)
    tokens, dim, layers = 2 * 32, 64, 2
    assert result["tp_block_bytes_theory"] == 4 * layers * tokens * dim * 4
    assert result["tp_bytes_per_step"] == result["tp_bytes_theory"] > result["tp_block_bytes_theory"]
    assert result["tp_collectives_per_step"] == result["tp_collectives_theory"] == 4 * layers + 2 + 3 + 1
    first = result["loss_first_step"]
    assert abs(first["partrain"] - first["dtensor"]) <= 1e-5 * first["dtensor"]
    assert result["partrain_tokens_per_s"] > 0 and result["dtensor_tokens_per_s"] > 0

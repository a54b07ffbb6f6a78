"""bf16 where the layout, not autocast, decides a tensor's dtype. Under DeepSpeed's ZeRO the
module's weights are bf16 and no autocast runs, while pipeline stages send activations as fp32:
a ZeRO-1 run with pp in bf16 (the CUDA default dtype) failed at the second stage's first matmul,
`expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16` (a reviewer's run)."""

import pytest

from tests.integration.conftest import read_metrics

COMMON = ("train.dtype=bf16", "train.max_steps=2", "train.eval_every=0", "checkpoint.every=0",
          "checkpoint.save_last=false", "train.micro_batch_size=2")


@pytest.mark.parametrize("layout", [
    ("parallel.zero_stage=1", "parallel.dp=1", "parallel.pp=2"),
    ("parallel.zero_stage=1", "parallel.dp=1", "parallel.pp=2",
     "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"),
], ids=["zero1-pp2", "zero1-pp2-interleaved"])
def test_zero_with_pp_trains_in_bf16(cli, tmp_path, layout):
    run_dir = tmp_path / "run"
    res = cli.run("launch", *COMMON, *layout, "--nproc-per-node", "2", "--run-dir", str(run_dir),
                  env={"DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    # The tiny model's first loss, ln(256) = 5.55 from random weights, within bf16's rounding.
    assert [s["step"] for s in steps] == [1, 2]
    assert abs(steps[0]["loss"] - 5.529) < 0.02, steps

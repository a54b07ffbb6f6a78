"""train.float8 end to end on CPU: torchao's FP8 layers, emulated (train.float8_emulate), through
real launches; and the refusal on a machine without FP8 matmuls."""

import pytest
import torch

from tests.integration.conftest import PARITY_COMMON, PARITY_STEPS, read_metrics

pytest.importorskip("torchao", reason="the test extra installs torchao")

pytestmark = pytest.mark.slow


def test_fp8_trains_beside_the_same_run_without(cli, tmp_path, single_process_reference):
    """dp2 (DDP), tensorwise, against the parity tests' shared single-process run (fp32, the same
    batches: layouts agree to 1e-4): every step's loss within 1% of it and its gradient norm
    within 25%, and not equal (the layers were swapped). Measured: 0.08% and 2.3% at most
    (torchao 0.18, 2026-11-27)."""
    res = cli.run("launch", *PARITY_COMMON, "parallel.dp=2", "train.float8=true",
                  "train.float8_emulate=true", "--run-dir", str(tmp_path / "fp8"))
    assert res.returncode == 0, res.stderr
    said = " ".join(res.stdout.split())  # the display wraps its lines
    assert "28 linear layers in FP8 (tensorwise, emulated)" in said
    steps = read_metrics(tmp_path / "fp8")[0]
    assert len(steps) == PARITY_STEPS

    def gaps(key):
        return [abs(a[key] - b[key]) / b[key] for a, b in zip(steps, single_process_reference)]
    print(f"fp8 against fp32: loss {max(gaps('loss')):.2e}, grad_norm "
          f"{max(gaps('grad_norm')):.2e}")
    assert 0 < max(gaps("loss")) < 0.01, gaps("loss")
    assert max(gaps("grad_norm")) < 0.25, gaps("grad_norm")
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5


def test_fp8_rowwise_under_fsdp2_pp_and_cp(cli, tmp_path):
    """pp2 x cp2 with FSDP2 over the cp ranks, rowwise: the layers each stage holds are swapped
    (14 of rank 0's 2 blocks), and the run trains."""
    res = cli.run("launch", "parallel.dp=1", "parallel.pp=2", "parallel.cp=2",
                  "parallel.zero_backend=fsdp",
                  "parallel.zero_stage=3", "train.float8=true", "train.float8_emulate=true",
                  "train.float8_recipe=rowwise", "train.max_steps=6", "train.eval_every=0",
                  "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert "14 linear layers in FP8 (rowwise, emulated)" in " ".join(res.stdout.split())
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU is the case")
def test_no_fp8_matmuls_exits_2_on_every_rank(cli, tmp_path):
    """launcher.device=auto on a machine without a GPU: the workers find no FP8 and the launcher
    says so, exit 2, no traceback, nothing left running."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", "launcher.device=auto", "parallel.dp=2", "train.float8=true",
                  "--run-dir", str(run_dir))
    assert res.returncode == 2, res.stderr
    assert "train.float8=true needs GPUs with FP8 matmuls" in res.stderr
    assert "device is cpu" in res.stderr and "Traceback" not in res.stderr
    assert not (run_dir / "metrics.jsonl").exists() or \
        not read_metrics(run_dir)[0]  # no step was trained

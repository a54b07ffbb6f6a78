"""Your own model through the CLI (model.target): the GPT-2-style example (examples/gpt2) with its
tensor-parallel plan and pipeline split trains at dp2 x tp2 x pp2 at layout parity with one
process (docs/design.md: loss and grad_norm within 1e-4 over 10 steps), and its step-5
checkpoint resumes under FSDP2 stage 3 with every block recomputed, at parity again."""

import shutil

import pytest

from tests.integration.conftest import (
    PARITY_COMMON,
    PARITY_STEPS,
    REFERENCE,
    assert_no_abort,
    assert_parity,
    read_metrics,
    resume_layout,
)

pytestmark = pytest.mark.slow

GPT2 = ("model.target=examples.gpt2.model:build", "model.args.dim=64", "train.seq_len=64",
        *PARITY_COMMON, "checkpoint.every=5")


def _run(cli, run_dir, *overrides):
    res = cli.run("launch", *GPT2, *overrides, "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    assert len(steps) == PARITY_STEPS
    return steps, res


def test_the_gpt2_example_keeps_parity_at_dp2_tp2_pp2_and_resumes_on_fsdp(cli, tmp_path):
    reference, _ = _run(cli, tmp_path / "ref", *REFERENCE)
    run_dir = tmp_path / "run"
    steps, res = _run(cli, run_dir, "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                      "train.micro_batch_size=4")
    assert_parity(steps, reference, "gpt2 example dp2 x tp2 x pp2")
    assert_no_abort(run_dir)
    # MFU counts the model's own FLOPs (flops_per_token), not the Llama arithmetic.
    assert all(s.get("mfu") is None or s["mfu"] >= 0 for s in steps)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000010")
    resumed = cli.run("launch", "--resume", str(run_dir), *resume_layout(
        ("parallel.dp=2", "parallel.zero_stage=3", "parallel.zero_backend=fsdp",
         "train.micro_batch_size=4", "train.activation_checkpointing=full")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 5" in resumed.stdout
    after, _ = read_metrics(run_dir)
    assert_parity(after, reference, "gpt2 example resumed on fsdp3 dp2, full recomputation")
    # The end of the run suggests what works for a user's model, and sample refuses clearly.
    assert "next: partrain launch --resume" in resumed.stdout
    assert "next: partrain sample" not in resumed.stdout
    refused = cli.run("sample", str(run_dir), "--prompt", "x")
    assert refused.returncode == 2 and "holds your own model" in refused.stderr, refused.stderr

"""Your own model through the CLI (model.target): the GPT-2-style example (examples/gpt2) with its
tensor-parallel plan and pipeline split trains at dp2 x tp2 x pp2 at layout parity with one
process (docs/design.md: loss and grad_norm within 1e-4 over 10 steps), and its step-5
checkpoint resumes under FSDP2 stage 3 with every block recomputed, at parity again. A user's
model's own state survives a resume bit for bit: a frozen parameter under ZeRO, a persistent
buffer the output reads, and dropout's generator (tests/unit/models/user_models.py)."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

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


SMALL = ("launcher.device=cpu", "train.max_steps=4", "train.eval_every=0", "train.eval_batches=1",
         "train.global_batch_size=16", "train.seq_len=64", "checkpoint.every=2")


def _resumed_as_uninterrupted(cli, run_dir, *flags):
    """Train 4 steps saving at 2 and 4, drop step 4's checkpoint (a job killed after step 2's
    save), relaunch: steps 3-4 must be the uninterrupted run's to the bit."""
    args = ("launch", *SMALL, *flags, "--run-dir", str(run_dir))
    res = cli.run(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    uninterrupted, _ = read_metrics(run_dir)
    assert [s["step"] for s in uninterrupted] == [1, 2, 3, 4]
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")
    res = cli.run(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from step 2" in res.stdout
    resumed, _ = read_metrics(run_dir)
    assert ([(s["step"], s["loss"], s["grad_norm"]) for s in resumed] ==
            [(s["step"], s["loss"], s["grad_norm"]) for s in uninterrupted])
    return res


def _saved(run_dir, step: int) -> dict:
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata, path


@pytest.mark.parametrize("stage", [2, 3])
def test_a_frozen_parameter_saves_and_resumes_under_zero(cli, tmp_path, stage):
    """DeepSpeed holds no fp32 copy of a frozen parameter (its helper gave None and the first
    save crashed): its weight is the module's (gathered under ZeRO-3), with no optimizer state."""
    run_dir = tmp_path / "run"
    _resumed_as_uninterrupted(cli, run_dir, "model.target=tests.unit.models.user_models:frozen",
                              "parallel.dp=2", f"parallel.zero_stage={stage}",
                              "train.micro_batch_size=4")
    keys, _ = _saved(run_dir, 4)
    assert "model.embed.weight" in keys and "optim.head.weight.exp_avg" in keys
    assert not [k for k in keys if k.startswith("optim.embed.")]
    weights = {}
    for step in (2, 4):
        _, path = _saved(run_dir, step)
        state = {"model.embed.weight": torch.zeros(keys["model.embed.weight"].size),
                 "model.head.weight": torch.zeros(keys["model.head.weight"].size)}
        dcp.load(state, checkpoint_id=path, no_dist=True)
        weights[step] = state
    assert weights[2]["model.embed.weight"].abs().sum() > 0
    assert torch.equal(weights[2]["model.embed.weight"], weights[4]["model.embed.weight"])
    assert not torch.equal(weights[2]["model.head.weight"], weights[4]["model.head.weight"])


def test_a_persistent_buffer_is_checkpointed(cli, tmp_path):
    """A counter the output reads resumes from its saved count, not the builder's 0."""
    run_dir = tmp_path / "run"
    _resumed_as_uninterrupted(cli, run_dir, "model.target=tests.unit.models.user_models:counted",
                              *REFERENCE)
    _, path = _saved(run_dir, 4)
    state = {"model.calls": torch.zeros((), dtype=torch.int64)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert state["model.calls"].item() == 4  # one training forward a step


def test_dropout_resumes_bit_identical_on_the_same_layout(cli, tmp_path):
    """Each rank's generator state is in the checkpoint and restored on the same layout."""
    run_dir = tmp_path / "run"
    _resumed_as_uninterrupted(cli, run_dir, "model.target=tests.unit.models.user_models:dropped",
                              "parallel.dp=2", "train.micro_batch_size=4")
    keys, _ = _saved(run_dir, 2)
    assert {"rng.rank0.cpu", "rng.rank1.cpu"} <= set(keys)
    assert "start from train.seed's state" not in (run_dir / "logs" / "rank-0.log").read_text()
    # On another layout the generators are not the saved ones (ranks have other roles): said.
    res = cli.run("launch", "--resume", str(run_dir), "train.max_steps=6", *resume_layout(
        ("parallel.dp=1", "--nproc-per-node", "1", "train.micro_batch_size=16")))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "start from train.seed's state" in (run_dir / "logs" / "rank-0.log").read_text()


def test_a_parameter_made_in_forward_stops_the_run_at_its_first_step(cli, tmp_path):
    """A module made in forward (`self.late = nn.Linear(...)` at the first call) trained on no
    optimizer and broke dp parity, exit 0 (a reviewer's model): now every rank stops after the
    first step, naming the parameters."""
    res = cli.run("launch", *SMALL, "model.target=tests.unit.models.user_models:made_in_forward",
                  "--run-dir", str(tmp_path / "run"))
    said = " ".join(res.stderr.split())
    assert res.returncode == 1, said[-3000:]
    assert ("failed: RuntimeError: the model made parameters in its forward (late.bias, "
            "late.weight)") in said, said[-3000:]


SCALED = '''
from torch import nn


class Scaled(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)

    def forward(self, tokens):
        logits = self.head(self.embed(tokens))
        return logits, logits.abs().max().item()  # .item(): the meta device cannot run it


def build(model_cfg):
    return Scaled(model_cfg.vocab_size)
'''


def test_a_forward_the_meta_device_cannot_run_has_its_output_checked_at_the_first_step(
        cli, tmp_path):
    """A reviewer's model: its forward reads a value out (.item(), which meta tensors cannot) and
    returns a tuple. The check before the start cannot run it; every rank failed with
    "AttributeError: 'tuple' object has no attribute 'flatten'", exit 1. Now the first step
    says the contract's message, as the check before the start says it, exit 2."""
    (tmp_path / "scaled.py").write_text(SCALED)
    res = cli.run("launch", *SMALL, "model.target=scaled:build", "--run-dir",
                  str(tmp_path / "run"), cwd=tmp_path)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, said[-3000:]
    assert ("error: model.target=scaled:build: its forward(tokens) returns tuple, not the logits "
            "tensor (batch, seq, vocabulary) (return the logits alone)") in said, said[-3000:]
    assert "Traceback" not in said and "AttributeError" not in said

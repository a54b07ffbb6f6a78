"""Optimizers and learning-rate schedules (optim.name, optim.schedule) under the layout-parity
contract (docs/design.md), through the CLI: each row trains at a layout with one optimizer and
one schedule, compared step by step (loss and grad_norm, 1e-4 relative) with the single-process
run of the same optimizer and schedule, and its step-5 checkpoint resumed: bit-identical on its
own layout, at parity on another (the optimizer's state, SGD's momentum buffer or Adam's
moments, crosses layouts and backends; the learning rate at step k is the uninterrupted run's).

The schedules are set so that the rate moves in the steps compared: a 2-step warmup, and under
wsd a decay over the last half (steps 6-10, the resumed ones)."""

import shutil

import pytest

from partrain.train.optim import lr_at
from tests.integration.conftest import (
    PARITY_COMMON,
    PARITY_STEPS,
    REFERENCE,
    assert_no_abort,
    assert_parity,
    read_metrics,
    resume_layout,
)

SHORT_WARMUP = ("optim.warmup_steps=2",)
ONE_PROCESS = ("parallel.dp=1", "--nproc-per-node", "1", "train.micro_batch_size=16")


def _launch(cli, run_dir, *overrides):
    res = cli.run("launch", *PARITY_COMMON, *overrides, "checkpoint.every=5", "--run-dir",
                  str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    assert len(steps) == PARITY_STEPS
    return steps


def _resume(cli, run_dir, copy, layout):
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step-00000010")
    res = cli.run("launch", "--resume", str(copy), *(resume_layout(layout) if layout else ()))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from step 5" in res.stdout
    # DeepSpeed's "untested optimizer" warning for SGD is not shown: partrain tests it here.
    assert "untested optimizer" not in res.stdout + res.stderr
    steps, _ = read_metrics(copy)
    assert [s["step"] for s in steps] == list(range(1, PARITY_STEPS + 1))
    return steps


@pytest.mark.parametrize("label,optim,layout,exact,resume_on", [
    # SGD's momentum buffer over tp shards, with gradient accumulation; its checkpoint on one
    # process, where the decay goes on from the same rate.
    ("sgd + wsd, dp2 x tp2",
     ("optim.name=sgd", "optim.lr=0.1", "optim.schedule=wsd", "optim.decay_ratio=0.5"),
     ("parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=4"), True, ONE_PROCESS),
    # Adam (L2 weight decay) as DeepSpeed builds it (Adam with adam_w_mode off). At 1e-3: at the
    # default 3e-3 the run's gradient norm spikes at step 10 on some machines (1.75 -> 4.95 on an
    # AVX-512 EPYC), where rounding differences of 1e-7 grow to 3e-4, plain DDP's as ZeRO's.
    ("adam + linear, zero2 dp2",
     ("optim.name=adam", "optim.lr=1e-3", "optim.schedule=linear", "optim.weight_decay=0.01"),
     ("parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch_size=8"), True, None),
    # SGD with Nesterov momentum on FSDP2's DTensor shards; its momentum buffer read into
    # DeepSpeed's flat partitions (ZeRO-2), which then saves it at step 10. (No resume on its own
    # layout: row 1 holds SGD's, and the suite's time is short.)
    ("sgd nesterov + constant, fsdp3 dp2",
     ("optim.name=sgd", "optim.lr=0.05", "optim.nesterov=true", "optim.schedule=constant"),
     ("parallel.dp=2", "parallel.zero_stage=3", "parallel.zero_backend=fsdp",
      "train.micro_batch_size=8"),
     False, ("parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch_size=8")),
])
@pytest.mark.slow
def test_optimizer_and_schedule_parity_and_resume(cli, tmp_path, label, optim, layout,
                                                  exact, resume_on):
    optim = (*SHORT_WARMUP, *optim)
    reference = _launch(cli, tmp_path / "reference", *REFERENCE, *optim)
    # The rate each step had is the schedule's, here and in the layout's run.
    expected = _expected_lrs(optim)
    assert [s["lr"] for s in reference] == pytest.approx(expected, rel=1e-12)
    steps = _launch(cli, tmp_path / "run", *optim, *layout)
    assert_parity(steps, reference, label)
    assert [s["lr"] for s in steps] == [s["lr"] for s in reference]
    assert_no_abort(tmp_path / "run")

    if exact:
        resumed = _resume(cli, tmp_path / "run", tmp_path / "exact", ())
        for a, b in zip(resumed, steps):
            assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), \
                a["step"]
    if resume_on:
        other = _resume(cli, tmp_path / "run", tmp_path / "other", resume_on)
        assert_parity(other, reference, f"{label}, resumed at step 5 on {' '.join(resume_on)}")
        # What the other layout saved at step 10 is the state of the uninterrupted run: the
        # weights and the optimizer's tensors (SGD's momentum buffers), each within 1e-4.
        # (each rank's generator states, rng.rank<R>.*, are the layout's own: not compared)
        ours, theirs = ({k: v for k, v in _saved(d / "checkpoints" / "step-00000010",
                                                 tmp_path / f"{d.name}.pt").items()
                         if not k.startswith("rng.")}
                        for d in (tmp_path / "run", tmp_path / "other"))
        assert ours.keys() == theirs.keys()
        state = [k for k in ours if k.startswith("optim.") and not k.endswith(".step")]
        assert state and all(k.endswith(".momentum_buffer") == ("sgd" in label) for k in state)
        for key, want in ours.items():
            gap = (theirs[key].double() - want.double()).norm() / want.double().norm()
            assert gap <= 1e-4, (key, float(gap))


def _saved(checkpoint, scratch) -> dict:
    """A checkpoint's tensors, whole, read on this process (DCP's own converter)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch)


def _expected_lrs(optim) -> list[float]:
    """The schedule's rates for steps 1-10 by hand, from the row's keys (the defaults: lr 3e-3,
    min_lr_ratio 0.1)."""
    from omegaconf import OmegaConf

    from partrain.config.schema import OptimConfig

    cfg = OmegaConf.merge(OmegaConf.structured(OptimConfig),
                          OmegaConf.from_dotlist([o.removeprefix("optim.") for o in optim]))
    return [lr_at(step, cfg, PARITY_STEPS) for step in range(1, PARITY_STEPS + 1)]


@pytest.mark.slow
def test_amsgrad_from_a_deepspeed_config_resumes_bit_identical(cli, tmp_path):
    """A DeepSpeed config's `optimizer.params.amsgrad: true` trained, and its resume failed with
    KeyError 'max_exp_avg_sq' (the checkpoint kept Adam's two moments only). Now the third is
    kept, and the resumed steps are the uninterrupted run's."""
    import json

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "optimizer": {
        "type": "Adam", "params": {"lr": 0.001, "amsgrad": True}}}))
    layout = ("parallel.dp=2", "parallel.zero_stage=1", f"parallel.deepspeed_config={config}",
              "train.micro_batch_size=8")
    steps = _launch(cli, tmp_path / "run", *layout)
    resumed = _resume(cli, tmp_path / "run", tmp_path / "exact", ())
    for a, b in zip(resumed, steps):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    saved = _saved(tmp_path / "run" / "checkpoints" / "step-00000010", tmp_path / "saved.pt")
    assert any(key.endswith(".max_exp_avg_sq") for key in saved)

"""The optimizers and learning-rate schedules (partrain/train/optim.py, optim.name and
optim.schedule), what DeepSpeed is told to build for each (partrain/config/deepspeed.py), and the
optimizer state `plan` counts (partrain/plan/costs.py). The rates below are worked by hand for
lr 1e-3, a 10-step warmup, 100 steps and min_lr_ratio 0.1 (floor 1e-4, span 9e-4)."""

from types import SimpleNamespace

import pytest
import torch

from partrain.config.deepspeed import deepspeed_config
from partrain.models.llama import build_model
from partrain.plan.costs import optimizer_state_bytes, zero_memory
from partrain.plan.layout import build_plan
from partrain.train.optim import build_optimizer, lr_at
from tests.unit.helpers import compose, resolved, validated


def optim(schedule, decay_ratio=0.2):
    return SimpleNamespace(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule,
                           decay_ratio=decay_ratio)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule):
    assert lr_at(1, optim(schedule), 100) == pytest.approx(1e-4)
    assert lr_at(5, optim(schedule), 100) == pytest.approx(5e-4)
    assert lr_at(10, optim(schedule), 100) == pytest.approx(1e-3)


@pytest.mark.parametrize("schedule, step, lr", [
    # cosine: progress (step - 10) / 90; 1e-4 + 9e-4 * (1 + cos(pi * progress)) / 2
    ("cosine", 55, 5.5e-4), ("cosine", 40, 1e-4 + 9e-4 * 0.75), ("cosine", 100, 1e-4),
    # linear: 1e-4 + 9e-4 * (1 - progress)
    ("linear", 28, 1e-4 + 9e-4 * 0.8), ("linear", 55, 5.5e-4), ("linear", 91, 1e-4 + 9e-5),
    ("linear", 100, 1e-4),
    ("constant", 11, 1e-3), ("constant", 100, 1e-3),
    # wsd, decay_ratio 0.2: stable to step 80, then 1e-4 + 9e-4 * (1 - sqrt((step - 80) / 20))
    ("wsd", 50, 1e-3), ("wsd", 80, 1e-3), ("wsd", 81, 1e-4 + 9e-4 * (1 - 0.05 ** 0.5)),
    ("wsd", 85, 5.5e-4), ("wsd", 100, 1e-4),
])
def test_schedule_values(schedule, step, lr):
    assert lr_at(step, optim(schedule), 100) == pytest.approx(lr, rel=1e-12)


def test_schedules_stay_at_their_end_past_max_steps():
    for schedule, end in (("cosine", 1e-4), ("linear", 1e-4), ("constant", 1e-3), ("wsd", 1e-4)):
        assert lr_at(150, optim(schedule), 100) == pytest.approx(end)


def test_wsd_decay_window_is_a_fraction_of_max_steps():
    # decay_ratio 0.36 of 100: from step 64; 73 is a quarter in, sqrt = 0.5.
    assert lr_at(64, optim("wsd", 0.36), 100) == pytest.approx(1e-3)
    assert lr_at(73, optim("wsd", 0.36), 100) == pytest.approx(5.5e-4)
    # A resume with more steps moves the decay to the new end: step 85 is stable again.
    assert lr_at(85, optim("wsd"), 200) == pytest.approx(1e-3)
    assert lr_at(170, optim("wsd"), 200) == pytest.approx(5.5e-4)  # 160 + 10 of 40


def test_linear_and_wsd_decrease_monotonically_to_the_floor():
    for schedule in ("linear", "wsd"):
        after = [lr_at(s, optim(schedule), 100) for s in range(10, 101)]
        assert all(a >= b for a, b in zip(after, after[1:]))
        assert after[-1] == pytest.approx(1e-4)


def _model():
    return build_model(compose("launcher.device=cpu", "model.n_layers=1").model, 0)


@pytest.mark.parametrize("name, cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                       ("sgd", torch.optim.SGD)])
def test_build_optimizer_follows_the_name(name, cls):
    cfg = compose("launcher.device=cpu", f"optim.name={name}", "optim.weight_decay=0.05")
    built = build_optimizer(_model(), cfg.optim)
    assert type(built) is cls
    # Weight decay on matrices only, whatever the optimizer (torch's L2 term for Adam and SGD).
    assert [g["weight_decay"] for g in built.param_groups] == [0.05, 0.0]
    if name == "sgd":
        assert (built.defaults["momentum"], built.defaults["nesterov"]) == (0.9, False)
    else:
        assert built.defaults["betas"] == (0.9, 0.95)


def test_sgd_momentum_and_nesterov_reach_torch():
    cfg = compose("launcher.device=cpu", "optim.name=sgd", "optim.momentum=0.5",
                  "optim.nesterov=true")
    built = build_optimizer(_model(), cfg.optim)
    assert (built.defaults["momentum"], built.defaults["nesterov"]) == (0.5, True)


def _ds(*overrides):
    cfg, _, _ = validated("parallel.zero_stage=1", *overrides)
    return deepspeed_config(cfg)


def test_deepspeed_builds_the_same_optimizer():
    adamw = _ds()["optimizer"]
    assert adamw["type"] == "AdamW" and "adam_w_mode" not in adamw["params"]
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    adam = _ds("optim.name=adam")["optimizer"]
    assert adam["type"] == "Adam" and adam["params"]["adam_w_mode"] is False
    assert adam["params"]["torch_adam"] is True
    # ZeRO-Offload: DeepSpeed's CPU Adam, in the same mode.
    off = _ds("optim.name=adam", "parallel.offload_optimizer=cpu")["optimizer"]["params"]
    assert off["adam_w_mode"] is False and off["torch_adam"] is False
    # SGD: a torch.optim type DeepSpeed builds by name, which ZeRO must be allowed to run.
    sgd = _ds("optim.name=sgd", "optim.momentum=0.8", "optim.nesterov=true",
              "optim.weight_decay=0.0")
    assert sgd["optimizer"] == {"type": "SGD", "params": {
        "lr": 3e-3, "momentum": 0.8, "nesterov": True, "weight_decay": 0.0}}
    assert sgd["zero_allow_untested_optimizer"] is True


def test_raw_deepspeed_keys_may_not_change_the_optimizer():
    from partrain.errors import ConfigError

    with pytest.raises(ConfigError, match="optimizer.params.momentum=0.5 contradicts .* "
                                          "optim.momentum"):
        _ds("optim.name=sgd", "+parallel.deepspeed.optimizer.params.momentum=0.5")
    with pytest.raises(ConfigError, match="optimizer.params.adam_w_mode=True contradicts"):
        _ds("optim.name=adam", "+parallel.deepspeed.optimizer.params.adam_w_mode=true")


@pytest.mark.parametrize("overrides, moments", [
    ((), 8), (("optim.name=adam",), 8), (("optim.name=sgd",), 4),
    (("optim.name=sgd", "optim.momentum=0"), 0)])
def test_optimizer_state_bytes(overrides, moments):
    assert optimizer_state_bytes(compose(*overrides).optim) == moments


@pytest.mark.parametrize("stage, engine, adamw, sgd", [
    # fp32: DDP 4 + 4 + state; DeepSpeed 4 + 4 + (master 4 + state) over the stages; FSDP
    # (4 + 4 + state) / Nd.
    (0, "deepspeed", 16, 12), (1, "deepspeed", 8 + 12 / 4, 8 + 8 / 4),
    (2, "deepspeed", 4 + 16 / 4, 4 + 12 / 4), (3, "deepspeed", 20 / 4, 16 / 4),
    (3, "fsdp", 16 / 4, 12 / 4)])
def test_sgd_keeps_half_of_adamw_state(stage, engine, adamw, sgd):
    assert zero_memory(stage, 1000, 4, "fp32", engine)["total"] == pytest.approx(1000 * adamw)
    memory = zero_memory(stage, 1000, 4, "fp32", engine, moments=4)
    assert memory["total"] == pytest.approx(1000 * sgd)
    assert memory["total"] == memory["param_bytes"] + memory["grad_bytes"] + memory["optim_bytes"]


def test_plan_counts_the_optimizer_it_runs():
    def plan(*overrides):
        cfg, world, _ = resolved("launcher.device=cpu", "train.global_batch_size=16",
                                 "parallel.dp=1", "launcher.nproc_per_node=1", *overrides)
        return build_plan(cfg, world, [])

    adamw, sgd = plan(), plan("optim.name=sgd")
    psi = adamw["memory"]["params_per_rank"]
    assert adamw["memory"]["optim_bytes"] == 8 * psi and sgd["memory"]["optim_bytes"] == 4 * psi
    assert sgd["memory"]["formula"] == "12Ψ"
    assert (adamw["memory_per_stage"][0]["optim_bytes"]
            - sgd["memory_per_stage"][0]["optim_bytes"]) == 4 * psi


def _trained(name, steps, *overrides):
    """A one-block model and its optimizer after `steps` steps on a fixed batch."""
    cfg = compose("launcher.device=cpu", "model.n_layers=1", f"optim.name={name}", *overrides)
    model = build_model(cfg.model, 0)
    opt = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, tokens


@pytest.mark.parametrize("name, overrides, keys", [
    ("sgd", (), {"momentum_buffer"}), ("sgd", ("optim.momentum=0",), {"momentum_buffer"}),
    ("adam", (), {"exp_avg", "exp_avg_sq", "step"})])
def test_checkpoint_holds_the_optimizers_state_and_resumes_it_exactly(tmp_path, name, overrides,
                                                                      keys):
    """Saved after 2 steps, loaded into a fresh model and optimizer, the third step is the
    uninterrupted run's, bit for bit (SGD's momentum buffer under its torch name, no step count;
    zeros at momentum 0, which keeps none)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from partrain.checkpoint.state import build_state, load_optimizer, load_weights

    model, opt, tokens = _trained(name, 2, *overrides)
    state = build_state(model, opt, None, zero=False)
    assert {k.rsplit(".", 1)[1] for k in state if k.startswith("optim.")} == keys
    if overrides:
        assert all(not v.any() for k, v in state.items() if k.startswith("optim."))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=tmp_path)
        fresh, fresh_opt, _ = _trained(name, 0, *overrides)
        load_weights(fresh, tmp_path, None)
        load_optimizer(fresh, fresh_opt, tmp_path, None, zero=False)
    for model_, opt_ in ((model, opt), (fresh, fresh_opt)):
        model_(tokens).float().pow(2).mean().backward()
        opt_.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)

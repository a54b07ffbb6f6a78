"""parallel.deepspeed_config: a DeepSpeed JSON file as HF Accelerate and the HF Trainer take one.
Its ZeRO, batch, precision and optimizer keys become partrain's, "auto" takes partrain's value,
the rest goes on as raw DeepSpeed keys, and every conflict is reported at once."""

import json
from pathlib import Path

import pytest

from partrain.config.deepspeed import deepspeed_config
from partrain.errors import ConfigError
from tests.unit.helpers import compose, resolved

HF_ZERO2 = Path(__file__).parents[2] / "data" / "ds_config_zero2.json"


def _write(tmp_path, data, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_an_hf_style_file_with_auto_values_runs_as_partrain_derives_it():
    base, _, _ = resolved("launcher.device=cpu")
    cfg, _, _ = resolved("launcher.device=cpu", f"parallel.deepspeed_config={HF_ZERO2}")
    p = cfg.parallel
    assert (p.zero_stage, p.offload_optimizer) == (2, "cpu")
    # "auto" left partrain's own keys as the recipe has them.
    for key in ("global_batch_size", "micro_batch_size", "micro_batches"):
        assert cfg.train[key] == base.train[key], key
    assert (cfg.optim.lr, cfg.optim.grad_clip) == (base.optim.lr, base.optim.grad_clip)
    merged = deepspeed_config(cfg)
    # DeepSpeed's tuning "auto"s filled as Accelerate does (hidden size squared).
    zero = merged["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == cfg.model.dim ** 2
    # The file's own keys go on as raw keys, over the derived ones.
    assert zero["reduce_scatter"] is True and merged["steps_per_print"] == 2000
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert merged["train_micro_batch_size_per_gpu"] == cfg.train.micro_batch_size
    assert "auto" not in json.dumps(merged)


def test_explicit_values_set_partrains_keys(tmp_path):
    path = _write(tmp_path, {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.8, 0.99],
                                                  "eps": 1e-6, "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 7, "total_num_steps": 50,
                                 "cos_min_ratio": 0.2, "warmup_min_ratio": 0}},
        "zero_optimization": {"stage": 1}})
    cfg, _, _ = resolved("launcher.device=cpu", f"parallel.deepspeed_config={path}")
    t, o = cfg.train, cfg.optim
    # The recipe's micro-batches gave way: the file fixes two of the batch triple.
    assert (t.global_batch_size, t.micro_batch_size, t.micro_batches) == (32, 2, 8)
    assert (t.dtype, t.max_steps, cfg.parallel.zero_stage) == ("bf16", 50, 1)
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip, o.warmup_steps,
            o.min_lr_ratio) == (1e-4, 0.8, 0.99, 1e-6, 0.05, 0.5, 7, 0.2)


def test_every_conflict_is_reported_at_once(tmp_path, run_main):
    path = _write(tmp_path, {
        "zero_optimization": {"stage": 2, "stage3_max_live_parameters": "auto"},
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "scheduler": {"type": "OneCycle", "params": {}}})
    res = run_main("show", f"parallel.deepspeed_config={path}", "parallel.zero_stage=1",
                   "train.micro_batch_size=2", "optim.grad_clip=1.0")
    assert res.code == 2, res.stderr
    message = res.stderr
    assert "4 problems" in message, message
    assert "zero_optimization.stage=2 in the file contradicts parallel.zero_stage=1" in message
    assert "train_micro_batch_size_per_gpu=4 in the file contradicts " \
           "train.micro_batch_size=2" in message
    assert "scheduler.type='OneCycle'" in message
    assert 'zero_optimization.stage3_max_live_parameters="auto"' in message
    # gradient_clipping agrees with the command line: no conflict.
    assert "gradient_clipping" not in message
    assert "Traceback" not in message


def test_an_auto_nothing_fills_is_named(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}})
    with pytest.raises(ConfigError, match="zero_optimization.sub_group_size=\"auto\": partrain "
                                          "has no value to fill it with"):
        compose("launcher.device=cpu", f"parallel.deepspeed_config={path}")


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ('{"zero_optimization": {"stage": }}', "is not valid JSON at line 1, column "),
    ("[1, 2]", "holds a JSON list"),
])
def test_a_broken_file_is_one_clear_message(tmp_path, run_main, content, fragment):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    res = run_main("show", f"parallel.deepspeed_config={path}")
    assert res.code == 2 and fragment in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("content, fragment", [
    # Both were passed on and never read: the run trained another batch than the file said.
    ({"zero_optimization": {"stage": 2}, "gradient_accumulation_step": 8,
      "train_micro_batch_size_per_gpus": 1},
     "DeepSpeed has no key gradient_accumulation_step (did you mean "
     "gradient_accumulation_steps?), train_micro_batch_size_per_gpus (did you mean "
     "train_micro_batch_size_per_gpu?)"),
    # DeepSpeed's own Adam takes it; the torch AdamW it builds here failed in every rank.
    ({"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {
        "lr": 0.001, "bias_correction": False}}},
     "optimizer.params: bias_correction is not a keyword of torch.optim.adamw.AdamW"),
])
def test_a_key_deepspeed_would_ignore_or_fail_on_is_refused(tmp_path, run_main, content,
                                                             fragment):
    res = run_main("show", f"parallel.deepspeed_config={_write(tmp_path, content)}")
    assert res.code == 2 and fragment in res.stderr, res.stderr
    # Known keys, amsgrad (torch's) among them, pass.
    content = {"zero_optimization": {"stage": 1}, "steps_per_print": 10,
               "optimizer": {"type": "Adam", "params": {"lr": 0.001, "amsgrad": True}}}
    assert run_main("show", f"parallel.deepspeed_config={_write(tmp_path, content)}").code == 0


def test_a_file_given_to_the_raw_section_says_where_it_goes(run_main):
    res = run_main("show", "parallel.deepspeed=ds_config.json")
    assert res.code == 2
    assert "use parallel.deepspeed_config=ds_config.json" in res.stderr, res.stderr


@pytest.mark.parametrize("overrides, fragment", [
    (("parallel.zero_backend=fsdp", "parallel.zero_stage=3"),
     "parallel.zero_backend=fsdp does not run DeepSpeed"),
])
def test_the_file_needs_deepspeed(tmp_path, overrides, fragment):
    path = _write(tmp_path, {"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match=fragment):
        resolved("launcher.device=cpu", f"parallel.deepspeed_config={path}", *overrides)


def test_a_stage_0_file_is_refused(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 0}})
    with pytest.raises(ConfigError, match="parallel.zero_stage=0 runs DDP"):
        resolved("launcher.device=cpu", f"parallel.deepspeed_config={path}")


@pytest.mark.parametrize("scheduler, schedule, min_ratio", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}, "constant", None),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 40}}, "linear", 0.0),
    ({"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.05}}, "cosine", 0.05),
])
def test_deepspeeds_schedulers_are_partrains(tmp_path, scheduler, schedule, min_ratio):
    path = _write(tmp_path, {"zero_optimization": {"stage": 1}, "scheduler": scheduler})
    cfg = compose("launcher.device=cpu", f"parallel.deepspeed_config={path}")
    assert cfg.optim.schedule == schedule
    if min_ratio is not None:
        assert cfg.optim.min_lr_ratio == min_ratio


@pytest.mark.parametrize("optimizer, name", [
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "adam"),
    ({"type": "Adam"}, "adamw"),  # DeepSpeed's Adam decouples weight decay by default
    ({"type": "SGD", "params": {"momentum": 0.8}}, "sgd"),
])
def test_deepspeeds_optimizer_types(tmp_path, optimizer, name):
    path = _write(tmp_path, {"zero_optimization": {"stage": 1}, "optimizer": optimizer})
    cfg = compose("launcher.device=cpu", f"parallel.deepspeed_config={path}")
    assert cfg.optim.name == name
    if name == "sgd":
        assert cfg.optim.momentum == 0.8


def test_what_partrain_cannot_run_is_named(tmp_path):
    path = _write(tmp_path, {"optimizer": {"type": "Lamb"},
                             "scheduler": {"type": "WarmupLR",
                                           "params": {"warmup_type": "log"}}})
    with pytest.raises(ConfigError) as info:
        compose("launcher.device=cpu", f"parallel.deepspeed_config={path}")
    assert "optimizer.type='Lamb' has no partrain optimizer" in str(info.value)
    assert "warmup_type='log': partrain's warmup is linear" in str(info.value)

"""train.float8's layer swap (torchao's Float8Linear, emulated on CPU) and its refusals."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from partrain.config.schema import Config
from partrain.config.validate import ConfigError
from partrain.models.llama import build_model
from partrain.parallel.float8 import Float8Unavailable, apply_float8, check_float8
from tests.unit.config.test_validate import validated

pytest.importorskip("torchao", reason="the test extra installs torchao")


def tiny(**moe_keys):
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len, cfg.model.dim = 2, 64, 64
    cfg.model.n_heads, cfg.model.n_kv_heads = 4, 2
    for key, value in moe_keys.items():
        cfg.model.moe[key] = value
    return build_model(cfg.model, seed=3)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_blocks_linears_become_fp8_and_the_head_stays(recipe):
    model = tiny()
    x = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(x).float()
    swapped = apply_float8(model, recipe, emulate=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}
    # 2 blocks x (wq, wk, wv, wo, w1, w2, w3); the vocabulary head stays a plain Linear.
    assert swapped == 14 and kinds["output"] == "Linear"
    assert {k for k, v in kinds.items() if v == "Float8Linear"} == \
        {f"layers.{i}.{part}" for i in range(2) for part in
         ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
          "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = model(x).float()
    after.sum().backward()
    gap = ((after - before).abs().max() / before.abs().max()).item()
    # FP8 (3 mantissa bits) moves the logits, but not far: the same model, rounded.
    assert 0 < gap < 0.1, gap
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad)


def test_routers_and_sizes_fp8_cannot_take_stay():
    # 16 experts: the router's sizes would suit FP8; it stays by name, as torchtitan keeps it.
    model = tiny(n_experts=16, top_k=2, n_shared_experts=1, expert_ffn_dim=72)
    apply_float8(model, "tensorwise", emulate=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}
    assert kinds["layers.0.feed_forward.router"] == "Linear"
    # 72 is no multiple of 16: the shared expert's layers stay; the attention's are swapped.
    assert all(v == "Linear" for k, v in kinds.items() if "shared" in k), kinds
    assert kinds["layers.0.attention.wq"] == "Float8Linear"


def test_no_fp8_hardware_is_refused_clearly():
    check_float8("cpu", emulate=True)  # emulation runs anywhere
    with pytest.raises(Float8Unavailable, match="compute capability 8.9.*device is cpu"):
        check_float8("cpu", emulate=False)


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_gpu_without_fp8_is_refused_by_its_capability(monkeypatch, capability, refused):
    """A CUDA GPU older than Ada/Hopper (an A100 is 8.0) is refused with its name and capability.
    Mocked: this machine has no GPU, so torch.cuda's capability and name queries are test
    doubles (the H200 in docs/performance.md ran the 9.0 path for real)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    if refused:
        with pytest.raises(Float8Unavailable, match=r"A100-SXM4-80GB has 8\.0\. Train in bf16"):
            check_float8("cuda", emulate=False)
    else:
        check_float8("cuda", emulate=False)


@pytest.mark.parametrize("overrides, rule", [
    (["train.float8=true", "launcher.device=cpu"], "launcher.device=cpu: FP8 matmuls need"),
    (["train.float8=true", "train.float8_emulate=true", "parallel.tp=2"], "parallel.tp=2"),
    (["train.float8=true", "train.float8_emulate=true", "parallel.dp=2",
      "parallel.zero_stage=2"], "zero_backend=fsdp"),
    (["train.float8_recipe=blockwise"], "train.float8_recipe"),
    (["train.float8=true", "train.float8_emulate=true", "train.seq_len=100",
      "train.micro_batch_size=2"], "200 tokens on a rank, but FP8 matmuls need a multiple of 16"),
])
def test_float8_settings_it_cannot_run_are_config_errors(overrides, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        validated(*overrides)
    assert "\n" not in str(info.value)

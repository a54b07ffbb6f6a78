"""The Llama-style model: size arithmetic, seeded weights, shapes, causality, the loss at init,
grouped-query attention against a plain reference; flops_per_token; the learning-rate schedule."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from partrain.models.arith import count_params, ffn_dim, flops_per_token
from partrain.models.layers import Attention, apply_rope
from partrain.models.llama import build_model
from partrain.train.optim import lr_at
from tests.unit.helpers import compose, quick


def model_cfg(*overrides):
    return quick(*(f"model.{o}" for o in overrides)).model


SHAPES = {
    "tiny": [],
    "mha": ["n_kv_heads=4"],
    "mqa": ["n_kv_heads=1"],
    "ffn-given": ["ffn_dim=200", "n_layers=2"],
    "ffn-derived-odd": ["dim=96", "n_heads=3", "n_kv_heads=1", "multiple_of=64", "n_layers=1"],
    "small-vocab": ["vocab_size=64", "dim=64", "n_heads=2", "n_kv_heads=2", "n_layers=3"],
    "qkv-bias-qk-norm": ["qkv_bias=true", "qk_norm=true", "n_layers=2"],
    # Qwen3's heads of their own width: 4 x 48 = 192 query rows from dim 128.
    "own-head-dim": ["head_dim=48", "qkv_bias=true", "qk_norm=true", "n_layers=2"],
}


@pytest.mark.parametrize("overrides", SHAPES.values(), ids=SHAPES.keys())
def test_param_count_matches_built_model(overrides):
    cfg = model_cfg(*overrides)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)


def test_params_per_rank_split_the_biases_and_keep_the_head_norms():
    """Under tp the q/k/v biases split with their linears; the q/k norm gains stay whole."""
    from partrain.models.arith import count_params_per_rank

    cfg = model_cfg("qkv_bias=true", "qk_norm=true", "n_layers=2")
    model = build_model(cfg, seed=0)
    split = {f"{module}.{kind}" for module, style in model.tensor_parallel_plan().items()
             if style in ("colwise", "rowwise", "vocab_embedding", "vocab_head")
             for kind in ("weight", "bias")}
    assert "layers.0.attention.wq.bias" in split
    want = sum(p.numel() // 2 if name in split else p.numel()
               for name, p in model.named_parameters())
    assert count_params_per_rank(cfg, tp=2) == want


def test_tiny_is_the_quickstarts_0_8m_parameters():
    assert count_params(model_cfg()) == 803_968


@pytest.mark.parametrize("model, params", [
    ("llama-7b", 6_738_415_616),  # Llama-2-7B
    ("llama-1b", 1_235_814_400 + 128256 * 2048),  # Llama-3.2-1B plus its untied output head
    ("llama-70b", 70_553_706_496),  # Llama-3-70B
])
def test_param_count_of_published_shapes(model, params):
    assert count_params(compose(f"model={model}").model) == params


def test_param_count_of_qwen3_0_6b():
    """Qwen3-0.6B's config.json: 16 heads of 128 over hidden size 1024, tied; 596,049,920
    parameters in its safetensors."""
    cfg = model_cfg("n_layers=28", "dim=1024", "n_heads=16", "n_kv_heads=8", "head_dim=128",
                    "ffn_dim=3072", "vocab_size=151936", "tie_embeddings=true", "qk_norm=true")
    assert count_params(cfg) == 596_049_920


@pytest.mark.parametrize("dim, multiple_of, expected", [
    (128, 32, 352),  # 8/3 * 128 = 341.3 -> 352
    (96, 64, 256),  # 256 -> 256
    (4096, 256, 11008),  # Llama-2-7B's ffn size
    (120, 1, 320),
])
def test_ffn_dim_derived(dim, multiple_of, expected):
    assert ffn_dim(SimpleNamespace(ffn_dim=None, dim=dim, multiple_of=multiple_of)) == expected


def test_ffn_dim_given_wins():
    assert ffn_dim(SimpleNamespace(ffn_dim=200, dim=128, multiple_of=32)) == 200
    model = build_model(model_cfg("ffn_dim=200", "n_layers=1"), seed=0)
    assert model.layers["0"].feed_forward.w1.weight.shape == (200, 128)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_same_seed_same_weights_different_seed_different():
    cfg = model_cfg("n_layers=2")
    a, b, c = (_weights(build_model(cfg, seed=s)) for s in (3, 3, 4))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    matrices = [k for k in a if a[k].dim() == 2]
    assert matrices
    for name in matrices:
        assert not torch.equal(a[name], c[name]), name


@pytest.mark.parametrize("overrides", [
    ["n_layers=2"], ["n_layers=2", "tie_embeddings=true", "qkv_bias=true", "qk_norm=true"],
    ["n_layers=2", "moe.n_experts=4", "moe.n_shared_experts=1", "moe.balance=bias"],
], ids=["dense", "tied-bias-qknorm", "moe-bias"])
def test_meta_build_is_the_eager_build(overrides):
    """build_model builds on the meta device and skips the layers' default initialisation: the
    model must equal one built the plain way and then initialised, every weight and buffer (the
    rotary tables, an MoE's balancing bias) bit for bit, the head tied, nothing left on meta."""
    from partrain.models.llama import Transformer, init_weights
    from partrain.models.moe import MoE

    cfg = model_cfg(*overrides)
    eager = Transformer(cfg)
    init_weights(eager, cfg.init_std, seed=5)
    built = build_model(cfg, seed=5)
    assert built.state_dict().keys() == eager.state_dict().keys()
    for name, value in eager.state_dict().items():
        assert torch.equal(built.state_dict()[name], value), name
    for name in ("rope_cos", "rope_sin"):
        assert torch.equal(getattr(built, name), getattr(eager, name)), name
    assert (built.output.weight is built.tok_embeddings.weight) == cfg.tie_embeddings
    assert not any(t.is_meta for t in [*built.parameters(), *built.buffers()])
    moes = [m for m in built.modules() if isinstance(m, MoE)]
    assert bool(moes) == ("moe.n_experts=4" in overrides)
    for moe in moes:
        assert not moe.load.is_meta and not moe.load.any() and moe.aux_sum.item() == 0


def test_init_scales_and_norms():
    cfg = model_cfg("n_layers=4", "dim=256", "n_heads=4", "n_kv_heads=4")
    model = build_model(cfg, seed=0)
    weights = dict(model.named_parameters())
    assert torch.equal(weights["norm.weight"], torch.ones(256))
    assert torch.equal(weights["layers.0.attention_norm.weight"], torch.ones(256))
    assert abs(weights["layers.0.attention.wq.weight"].std().item() - 0.02) < 0.002
    # Residual output projections are scaled by 1 / sqrt(2 * n_layers).
    expected = 0.02 / math.sqrt(8)
    assert abs(weights["layers.0.attention.wo.weight"].std().item() - expected) < 0.1 * expected
    assert abs(weights["layers.0.feed_forward.w2.weight"].std().item() - expected) < 0.1 * expected


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model(model_cfg(), seed=0).eval()


def test_output_shape(tiny):
    tokens = torch.randint(0, 256, (3, 17))
    with torch.no_grad():
        logits = tiny(tokens)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("t", [0, 5, 15])
def test_causal(tiny, t):
    gen = torch.Generator().manual_seed(t)
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = tiny(tokens), tiny(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4  # position t and later do change


def test_batch_rows_are_independent(tiny):
    tokens = torch.randint(0, 256, (4, 12))
    with torch.no_grad():
        whole = tiny(tokens)
        alone = tiny(tokens[2:3])
    torch.testing.assert_close(whole[2:3], alone, rtol=1e-5, atol=1e-5)


def test_loss_at_init_is_near_uniform(tiny):
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = tiny(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(256)) < 0.05


@pytest.mark.parametrize("overrides", [[], ["head_dim=48", "qk_norm=true"]],
                         ids=["tiny", "own-head-dim"])
def test_backward_reaches_every_parameter(overrides):
    model = build_model(model_cfg("n_layers=2", *overrides), seed=0)
    tokens = torch.randint(0, 256, (2, 9))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def reference_attention(attn, x, cos, sin):
    """Plain causal attention with k/v heads repeated for their query groups."""
    bsz, seq, _ = x.shape
    q = attn.wq(x).view(bsz, seq, attn.n_heads, attn.head_dim)
    k = attn.wk(x).view(bsz, seq, attn.n_kv_heads, attn.head_dim)
    v = attn.wv(x).view(bsz, seq, attn.n_kv_heads, attn.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(attn.head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return attn.wo(out.reshape(bsz, seq, -1))


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [
    (4, 4, None), (4, 2, None), (4, 1, None), (8, 2, None), (4, 2, 48)])
def test_attention_matches_reference(n_heads, n_kv_heads, head_dim):
    cfg = model_cfg(f"n_heads={n_heads}", f"n_kv_heads={n_kv_heads}", "n_layers=1",
                    f"head_dim={'null' if head_dim is None else head_dim}")
    model = build_model(cfg, seed=0)
    attn = model.layers["0"].attention
    assert isinstance(attn, Attention)
    width = head_dim or 128 // n_heads
    assert attn.wk.weight.shape == (n_kv_heads * width, 128)
    assert attn.wo.weight.shape == (128, n_heads * width)
    assert model.rope_cos.shape[-1] == width // 2
    x = torch.randn(2, 10, 128, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, cos, sin),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_gqa_and_mha_models_run_forward_and_backward(n_kv_heads):
    model = build_model(model_cfg(f"n_kv_heads={n_kv_heads}", "n_layers=2"), seed=0)
    tokens = torch.randint(0, 256, (2, 8))
    logits = model(tokens)
    logits.sum().backward()
    assert logits.shape == (2, 8, 256)
    assert model.layers["0"].attention.wk.weight.grad is not None


def test_rope_keeps_norms_and_position_zero():
    x = torch.randn(1, 6, 2, 16)
    from partrain.models.layers import rope_tables

    cos, sin = rope_tables(16, 6, 10000.0)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[:, 0], x[:, 0])  # angle 0 at position 0
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y[:, 1:], x[:, 1:])


def test_flops_per_token():
    cfg = model_cfg()
    n, dense = count_params(cfg), count_params(cfg) - cfg.vocab_size * cfg.dim
    f128, f256 = flops_per_token(cfg, 128), flops_per_token(cfg, 256)
    assert 0 < f128 < f256
    assert f128 == 6 * dense + 6 * cfg.n_layers * 128 * cfg.dim
    assert f256 - f128 == 6 * cfg.n_layers * 128 * cfg.dim  # linear in seq_len
    assert f128 > 6 * dense and dense < n


def test_flops_per_token_counts_attention_over_the_heads_width():
    """With model.head_dim the scores and weighted sum run over n_heads x head_dim, not dim."""
    cfg = model_cfg("head_dim=48")
    dense = count_params(cfg) - cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, 128) == 6 * dense + 6 * cfg.n_layers * 128 * 4 * 48


def test_flops_per_token_is_about_6n_for_a_big_model():
    big = compose("model=llama-7b").model
    ratio = flops_per_token(big, 4096) / (6 * count_params(big))
    # Attention adds ~8% at 4096 tokens, the embedding lookup (~2%) is free: about 6N.
    assert 1.03 < ratio < 1.1


# The learning-rate schedule (partrain/train/optim.py).

OPTIM = SimpleNamespace(lr=1.0e-3, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")


def test_lr_warmup_is_linear():
    for step in range(1, 11):
        assert lr_at(step, OPTIM, 100) == pytest.approx(1e-3 * step / 10)
    assert lr_at(1, OPTIM, 100) == pytest.approx(1e-3 / 10)


def test_lr_peaks_at_end_of_warmup():
    lrs = [lr_at(s, OPTIM, 100) for s in range(1, 101)]
    assert lr_at(10, OPTIM, 100) == pytest.approx(1e-3)
    assert max(lrs) == pytest.approx(1e-3)
    assert lrs.index(max(lrs)) == 9  # step 10


def test_lr_cosine_down_to_floor():
    assert lr_at(100, OPTIM, 100) == pytest.approx(1e-4)
    assert lr_at(55, OPTIM, 100) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # halfway
    after = [lr_at(s, OPTIM, 100) for s in range(10, 101)]
    assert all(a > b for a, b in zip(after, after[1:]))  # strictly decreasing after the peak
    assert lr_at(150, OPTIM, 100) == pytest.approx(1e-4)  # stays at the floor past max_steps


def test_lr_with_composed_config():
    cfg = quick()
    assert lr_at(cfg.optim.warmup_steps, cfg.optim, cfg.train.max_steps) == pytest.approx(cfg.optim.lr)
    assert lr_at(cfg.train.max_steps, cfg.optim, cfg.train.max_steps) == pytest.approx(
        cfg.optim.lr * cfg.optim.min_lr_ratio)


# Tied embeddings (model.tie_embeddings): the head's weight is the embedding's.

def test_tied_model_has_one_vocab_matrix_and_sums_both_gradients():
    tied, untied = model_cfg("tie_embeddings=true"), model_cfg()
    model = build_model(tied, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == count_params(tied) \
        == count_params(untied) - untied.vocab_size * untied.dim
    # The same function as an untied model whose head holds the embedding's values; the tied
    # weight's gradient is the lookup's plus the head's.
    reference = build_model(untied, seed=0)
    reference.load_state_dict({**model.state_dict(), "output.weight": model.output.weight})
    x = torch.randint(0, tied.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (model, reference):
        F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    want = reference.tok_embeddings.weight.grad + reference.output.weight.grad
    torch.testing.assert_close(model.tok_embeddings.weight.grad, want, rtol=1e-6, atol=1e-7)
    assert reference.tok_embeddings.weight.grad.norm() > 0
    assert reference.output.weight.grad.norm() > 0


def test_tied_llama_1b_is_llama_3_2_1b():
    model = compose("model=llama-1b", "model.tie_embeddings=true").model
    assert count_params(model) == 1_235_814_400


def test_flops_per_token_of_a_tied_model_counts_the_head():
    cfg = model_cfg("tie_embeddings=true")
    assert flops_per_token(cfg, 128) == 6 * count_params(cfg) + 6 * cfg.n_layers * 128 * cfg.dim
    assert flops_per_token(cfg, 128) == flops_per_token(model_cfg(), 128)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)])
def test_mfu_peak_by_gpu_name(name, peak):
    """MFU divides by the card's dense bf16 peak; the PCIe and NVL H100s are slower than SXM."""
    from partrain.observe.metrics import peak_flops

    assert peak_flops(name) == peak


def test_adamw_is_fused_on_cuda():
    """Without ZeRO, AdamW is torch's fused kernel on CUDA (its for-each one on CPU)."""
    from partrain.train.optim import build_optimizer

    cfg = compose("launcher.device=cpu", "model.n_layers=1")
    model = build_model(cfg.model, 0)
    assert build_optimizer(model, cfg.optim).defaults["fused"] in (None, False)
    fused = build_optimizer(model, cfg.optim, torch.device("cuda"))  # built only, never stepped
    assert fused.defaults["fused"] is True
    assert [len(g["params"]) for g in fused.param_groups] == [
        len(g["params"]) for g in build_optimizer(model, cfg.optim).param_groups]

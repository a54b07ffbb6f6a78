"""`partrain sample`'s KV cache against the full forward it replaces: the same tokens, greedy and
seeded, from `generate` with and without the cache (both real paths), for the dense model, an MoE,
tied embeddings and each kind of head sharing (MHA, GQA, MQA), past max_seq_len too; and the
cached logits against the forward's at every position."""

import copy

import pytest
import torch

from partrain.data.tokenizer import TextTokenizer
from partrain.interop.sample import generate
from partrain.models.llama import build_model
from tests.unit.helpers import compose

# The quickstart's shapes (4 heads of 32, 2 kv heads) with 2 layers and a short context, so that
# a generation passes max_seq_len in a few dozen tokens.
SHORT = ("model.n_layers=2", "model.max_seq_len=24")
MODELS = {
    "gqa": SHORT,
    "mha": (*SHORT, "model.n_kv_heads=4"),
    "mqa": (*SHORT, "model.n_kv_heads=1"),
    "tied": (*SHORT, "model.tie_embeddings=true"),
    "moe": ("model=tiny-moe", *SHORT),
}


def _model(*overrides: str):
    """A model of the composed config whose weights are perturbed (no two rows alike, and the
    logits far from uniform, so that greedy text does not settle on one token)."""
    model = build_model(compose(*overrides).model, seed=3).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return _model(*MODELS[request.param])


def _forward_calls(model):
    """A counter of the model's full forward calls (`decode` is not one)."""
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    return calls, handle


def _generate(model, prompt: list[int], new: int, kv_cache: bool, temperature=0.0, top_k=0,
              seed=0) -> tuple[list[int], str, int]:
    """(new tokens, the text emitted, full forwards run)."""
    text = []
    calls, handle = _forward_calls(model)
    try:
        tokens = generate(model, TextTokenizer(None), prompt, new, temperature, top_k, seed,
                          model.cfg.max_seq_len, text.append, kv_cache=kv_cache)
    finally:
        handle.remove()
    return tokens, "".join(text), len(calls)


PROMPT = list(b"def main(")


@pytest.mark.parametrize("temperature, top_k, seed", [(0.0, 0, 0), (0.8, 50, 1), (1.0, 0, 2)],
                         ids=["greedy", "top-k", "all-tokens"])
def test_cached_generation_gives_the_recomputed_tokens(model, temperature, top_k, seed):
    # 9 prompt tokens + 40 new ones: twice past max_seq_len=24, where the window moves.
    args = (PROMPT, 40, temperature, top_k, seed)
    cached, cached_text, cached_forwards = _generate(model, *args[:2], True, *args[2:])
    full, full_text, full_forwards = _generate(model, *args[:2], False, *args[2:])
    assert cached == full
    assert cached_text == full_text
    assert len(set(full)) > 5  # varied text: a comparison of one repeated token would prove little
    # The cached path never runs `forward` (past the window it runs the window through `decode`).
    assert (cached_forwards, full_forwards) == (0, 40)


def test_a_prompt_longer_than_max_seq_len():
    model = _model(*MODELS["gqa"])
    prompt = list(range(30, 60))  # 30 tokens: only the newest 24 are seen
    assert _generate(model, prompt, 10, True)[0] == _generate(model, prompt, 10, False)[0]


def test_cached_logits_equal_the_forward_at_every_position(model):
    """A prompt of 5 (the prefill), a chunk of 3 after it (attention masked from position 5), then
    one token at a time to the end of the context, for a batch of two.

    Not bit for bit: the same float32 products in other shapes (a matmul over one row or 24,
    attention over 5 keys or 24) sum in another order. The bound is the forward's own rounding,
    its distance from the same model run in float64: the cache may differ from the forward by no
    more than twice that (seen: 0.7 to 1.2 times, ~1e-4 on logits of ~15). A position off by one,
    a key not cached or a wrong mask moves the logits by 0.01 and far more."""
    tokens = torch.randint(0, 256, (2, model.cfg.max_seq_len),
                           generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(tokens)
        exact = copy.deepcopy(model).double()(tokens)
        cache = model.kv_cache(batch=2)
        parts = [model.decode(tokens[:, :5], cache), model.decode(tokens[:, 5:8], cache)]
        parts += [model.decode(tokens[:, i:i + 1], cache) for i in range(8, tokens.shape[1])]
    cached = torch.cat(parts, dim=1)
    assert cache.length == model.cfg.max_seq_len
    rounding = (full.double() - exact).abs().max().item()
    assert 0 < rounding < 1e-3
    assert (cached - full).abs().max().item() <= 2 * rounding


def test_the_cache_keeps_the_kv_heads():
    model = _model(*MODELS["gqa"])
    cache = model.kv_cache()
    # (layers, batch, kv heads, positions, head_dim): 2 kv heads of 32, not the 4 query heads.
    assert cache.k.shape == cache.v.shape == (2, 1, 2, 24, 32)
    with torch.no_grad():
        model.decode(torch.tensor([PROMPT]), cache)
    written = len(PROMPT)
    assert cache.length == written
    assert (cache.k[:, :, :, :written] != 0).all() and (cache.k[:, :, :, written:] == 0).all()
    assert (cache.v[:, :, :, :written] != 0).all() and (cache.v[:, :, :, written:] == 0).all()
    with pytest.raises(ValueError, match="model.max_seq_len=24"):
        model.decode(torch.zeros(1, 24 - written + 1, dtype=torch.long), cache)


def test_an_moe_with_a_capacity_is_sampled_without_the_cache():
    """A capacity drops tokens by their place in the whole sequence, so the cache cannot give the
    forward's logits (checked here, so that the fallback stays needed) and `generate` runs the
    full forward for it."""
    model = _model("model=tiny-moe", *SHORT, "model.moe.capacity_factor=1.0")
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = model.kv_cache()
        model.decode(tokens[:, :-1], cache)
        cached = model.decode(tokens[:, -1:], cache)[0, -1]
        assert (cached - model(tokens)[0, -1]).abs().max() > 0.01
    cached_tokens, _, forwards = _generate(model, PROMPT, 20, True)
    assert forwards == 20
    assert cached_tokens == _generate(model, PROMPT, 20, False)[0]

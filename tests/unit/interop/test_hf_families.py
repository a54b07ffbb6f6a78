"""The Hugging Face families beyond Llama (Mistral, Qwen2/2.5, Qwen3) in-process: a tiny random
model that transformers itself builds and saves is imported with `model.init_from=hf:DIR` alone
(its keys read from config.json), computes transformers' logits, saves as a partrain checkpoint,
exports to the family's own model_type (which transformers loads back to the same logits, files
readable as the umask allows) and samples what transformers would. Then what is refused: a
checkpoint relabelled as another family, and what partrain cannot compute."""

import json
import os

import pytest
import torch

from partrain.config.compose import compose_config
from partrain.errors import ConfigError
from tests.unit.helpers import save_checkpoint

# partrain's tiny shape with 2 layers (4 heads of 32, 2 kv heads), as transformers' config.
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=50000.0)
# Qwen3's heads have a width of their own, as in its real sizes (Qwen3-0.6B: 16 x 128 over
# hidden size 1024): here 4 x 48 over 128, read into model.head_dim.
FAMILIES = {"mistral": {"head_dim": 32, "sliding_window": None},
            "qwen2": {},
            "qwen3": {"head_dim": 48}}
# What each family sets among partrain's keys.
KEYS = {"mistral": (False, False), "qwen2": (True, False), "qwen3": (False, True)}


def hf_family(family: str, path, **overrides):
    """A random transformers model of the family in partrain's tiny shape, saved into `path`;
    its biases and norm gains drawn away from zeros and ones, so that each one matters."""
    import transformers

    config_class = transformers.AutoConfig.for_model(family).__class__
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    torch.manual_seed(0)
    model = model_class(config_class(**{**TINY, **FAMILIES[family], **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return model


def _imported(path, *overrides):
    """The config composed from `model.init_from=hf:PATH` (and overrides), and its model with
    the weights read."""
    from partrain.interop.hf import check_hf_init, load_hf_weights
    from partrain.models.llama import Transformer

    cfg = compose_config(None, [f"model.init_from=hf:{path}", *overrides])
    check_hf_init(cfg.model)
    model = Transformer(cfg.model).eval()
    load_hf_weights(model, path, cfg.model, None)
    return cfg, model


def _batch(seq=64):
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_imports_exports_and_samples_as_transformers(run_main, tmp_path, family):
    from transformers import AutoModelForCausalLM

    hf = hf_family(family, tmp_path / "hf")
    cfg, model = _imported(tmp_path / "hf")
    m = cfg.model
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len) == \
        (2, 128, 4, 2, 352, 256)
    assert (m.rope_theta, m.norm_eps, m.hf_model_type) == (50000.0, 1e-5, family)
    assert (m.qkv_bias, m.qk_norm) == KEYS[family]
    assert m.head_dim == FAMILIES[family].get("head_dim", 32)
    assert model.layers["0"].attention.wq.weight.shape == (4 * m.head_dim, 128)
    x = _batch()
    with torch.no_grad():
        want = hf(x).logits
        gap = (model(x) - want).abs().max().item()
    print(f"{family} import: max abs logit difference {gap:.2e}")
    assert gap <= 1e-5

    save_checkpoint(model, cfg, tmp_path / "run")
    old = os.umask(0o027)  # group-readable, not world-readable
    try:
        res = run_main("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"))
    finally:
        os.umask(old)
    assert res.code == 0, res.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {0o640} and "model.safetensors" in modes, modes
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["head_dim"]) == (family, m.head_dim)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(again).__name__ == type(hf).__name__
    with torch.no_grad():
        gap = (again(x).logits - want).abs().max().item()
    print(f"{family} export: max abs logit difference {gap:.2e}")
    assert gap <= 1e-5

    # Greedy sampling (the KV-cache path) picks transformers' argmax, byte by byte.
    res = run_main("sample", str(tmp_path / "run"), "--prompt", "def f(", "--temperature", "0",
                   "--max-new-tokens", "16")
    assert res.code == 0, res.stderr
    ids = list(b"def f(")
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert res.stdout == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_a_qwen2_relabelled_as_llama_is_refused_naming_its_biases(tmp_path):
    from partrain.interop.hf import check_hf_init

    hf_family("qwen2", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    cfg = compose_config(None, [f"model.init_from=hf:{tmp_path / 'hf'}"])
    assert not cfg.model.qkv_bias
    with pytest.raises(ConfigError) as e:
        check_hf_init(cfg.model)
    message = str(e.value)
    assert "6 tensor(s) that partrain's model would not use" in message, message
    assert "model.layers.0.self_attn.k_proj.bias" in message and "never" not in message


def test_head_dim_is_read_and_defaults_to_the_hidden_size_split():
    from partrain.models.llama_hf import model_keys

    qwen3 = {**TINY, "model_type": "qwen3"}
    assert model_keys({**qwen3, "head_dim": 128}, "config.json")["head_dim"] == 128
    assert model_keys(qwen3, "config.json")["head_dim"] == 32  # transformers' default
    assert model_keys({**qwen3, "head_dim": None}, "config.json")["head_dim"] == 32


@pytest.mark.parametrize("changes, sliding", [
    ({"use_sliding_window": True, "max_window_layers": 2}, False),  # from layer 2: none of 2
    ({"use_sliding_window": True, "max_window_layers": 1}, True),
    ({"use_sliding_window": True}, False),  # transformers' default max_window_layers is 28
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 2}, False),
    ({"use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"]}, True),
])
def test_qwen2s_sliding_layers_are_the_ones_transformers_makes(changes, sliding):
    """Refused where transformers' Qwen2 would slide in some layer, taken where it slides in
    none (a window that starts past the last layer was refused though every layer is full)."""
    from transformers import Qwen2Config

    from partrain.models.llama_hf import model_keys

    hf = {**TINY, "model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 64, **changes}
    assert ("sliding_attention" in Qwen2Config(**hf).layer_types) == sliding
    if sliding:
        with pytest.raises(ConfigError, match="no sliding-window layers"):
            model_keys(hf, "config.json")
    else:
        model_keys(hf, "config.json")


@pytest.mark.parametrize("family, changes, fragments", [
    ("qwen3", {"head_dim": 0}, ["head_dim=0 must be a whole number >= 1"]),
    ("qwen3", {"attention_bias": True}, ["attention_bias=True", "qwen3 has attention_bias=False"]),
    ("qwen2", {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 2},
     ["use_sliding_window=True", "no sliding-window layers"]),
    ("qwen2", {"model_type": "gemma"}, ["model_type='gemma'", "llama, mistral, qwen2, qwen3"]),
])
def test_what_partrain_cannot_compute_is_refused(tmp_path, family, changes, fragments):
    hf_family(family, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(changes)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        compose_config(None, [f"model.init_from=hf:{tmp_path / 'hf'}"])
    assert all(f in str(e.value) for f in fragments), str(e.value)


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    """A Mistral with a 64-token sliding window (max_position_embeddings 256)."""
    path = tmp_path_factory.mktemp("mistral") / "hf"
    hf_family("mistral", path, sliding_window=64)
    return path


def test_keys_given_must_agree_with_config_json(run_main, mistral_window):
    init = f"model.init_from=hf:{mistral_window}"
    res = run_main("show", init, "model.n_layers=3", "model.qkv_bias=true", "model.head_dim=64",
                   "train.seq_len=64")
    assert res.code == 2, res.stderr
    assert "model.n_layers=3 but config.json says 2" in res.stderr
    assert "model.qkv_bias=true but config.json says false" in res.stderr
    assert "model.head_dim=64 but config.json says 32" in res.stderr
    # Agreeing keys, and a shorter context than the window, are the user's to give.
    res = run_main("show", init, "model.n_layers=2", "model.head_dim=32", "model.max_seq_len=32",
                   "train.seq_len=32")
    assert res.code == 0, res.stderr
    assert "max_seq_len: 32" in res.stdout and "sliding_window: 64" in res.stdout
    res = run_main("show", init, "model.max_seq_len=128", "train.seq_len=64")
    assert res.code == 2 and "model.max_seq_len=128 but config.json says at most 64" in res.stderr


def test_a_sliding_window_shorter_than_the_sequence_is_refused(run_main, mistral_window):
    res = run_main("show", f"model.init_from=hf:{mistral_window}", "train.seq_len=128")
    assert res.code == 2, res.stderr
    assert "model.sliding_window=64 < train.seq_len=128" in res.stderr
    assert "set train.seq_len <= 64" in res.stderr
    res = run_main("show", f"model.init_from=hf:{mistral_window}", "train.seq_len=64")
    assert res.code == 0, res.stderr
    assert "hf_model_type: mistral" in res.stdout and "max_seq_len: 64" in res.stdout


def test_a_mistral_config_without_sliding_window_has_transformers_default_window():
    """transformers' MistralConfig gives a config.json without the key a 4096-token window (an
    explicit null is none): partrain reads the same, so a sequence past 4096 is refused rather
    than computed with attention transformers' model would not have."""
    from transformers import MistralConfig

    from partrain.models.llama_hf import model_keys

    mistral = {**TINY, "model_type": "mistral", "max_position_embeddings": 32768}
    keys = model_keys(mistral, "config.json")
    assert keys["sliding_window"] == MistralConfig(**mistral).sliding_window == 4096
    assert keys["max_seq_len"] == 4096  # no longer than the window
    explicit = model_keys({**mistral, "sliding_window": None}, "config.json")
    assert explicit["sliding_window"] is MistralConfig(**{**mistral, "sliding_window": None}) \
        .sliding_window is None
    assert explicit["max_seq_len"] == 32768
    assert model_keys({**mistral, "sliding_window": 512}, "config.json")["sliding_window"] == 512


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_config_without_max_position_embeddings_has_transformers_default(family):
    """Each family's config class has its own default (Mistral's was read as Llama's 2048)."""
    import transformers

    from partrain.models.llama_hf import ARCHITECTURES, model_keys

    hf = {**TINY, "model_type": family, "sliding_window": None}
    hf.pop("max_position_embeddings", None)
    config = getattr(transformers, ARCHITECTURES[family].replace("ForCausalLM", "Config"))(**hf)
    assert model_keys(hf, "config.json")["max_seq_len"] == config.max_position_embeddings

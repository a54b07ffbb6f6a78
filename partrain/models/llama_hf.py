"""The built-in family's Hugging Face adapter (partrain.models.family.HfAdapter), torch-free:
which config.json model_types it reads (Llama 2/3, Mistral, Qwen2/2.5, Qwen3: each partrain's
decoder with a few model keys set), those keys from a config.json and back, the name map
partrain parameter <-> transformers tensor, and the one per-weight conversion.

    model_type   what differs from Llama                 partrain's keys
    llama        (rope scaling: rope_type=llama3)        -
    mistral      sliding_window (4096 if absent)         model.sliding_window (>= max_seq_len)
    qwen2        a bias on q/k/v (never on o)            model.qkv_bias=true
    qwen3        RMSNorm of each head's q and k          model.qk_norm=true

Every family's head_dim is read into model.head_dim (written out on export): real Qwen3 sizes
set their own (Qwen3-0.6B: hidden_size 1024, 16 heads of 128).

What partrain cannot compute is refused naming the field: a bias on the output projection or
the MLP (Llama's attention_bias, Qwen3's attention_bias), layers with sliding-window attention
(Qwen's use_sliding_window), other activations and rope types.

The conversion: rotary embeddings rotate consecutive pairs (2i, 2i+1) of each head here (Meta's
layout), and pairs (i, i + head_dim/2) in transformers (`rotate_half`): the rows of wq and wk are
permuted per head, as transformers' own Llama conversion script does, and so are the q/k biases
(Qwen2) and the entries of the per-head q/k norm gains (Qwen3). Everything else is a renaming.
The tensor functions use only a tensor's own methods, so this module imports no torch (the
launcher and `plan` import it through the family registry).
"""

import math
import re

from partrain.errors import ConfigError
from partrain.models.arith import ffn_dim, head_dim, tied

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)
CONFIG_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
MISTRAL_WINDOW = 4096  # transformers' MistralConfig.sliding_window default (see model_keys)
# transformers' max_position_embeddings where config.json has none (its config classes, 5.24)
MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}

TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
IN_BLOCK = {"attention_norm.weight": "input_layernorm.weight",
            "attention.wq.weight": "self_attn.q_proj.weight",
            "attention.wk.weight": "self_attn.k_proj.weight",
            "attention.wv.weight": "self_attn.v_proj.weight",
            "attention.wo.weight": "self_attn.o_proj.weight",
            "attention.wq.bias": "self_attn.q_proj.bias",
            "attention.wk.bias": "self_attn.k_proj.bias",
            "attention.wv.bias": "self_attn.v_proj.bias",
            "attention.q_norm.weight": "self_attn.q_norm.weight",
            "attention.k_norm.weight": "self_attn.k_norm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "feed_forward.w1.weight": "mlp.gate_proj.weight",
            "feed_forward.w3.weight": "mlp.up_proj.weight",
            "feed_forward.w2.weight": "mlp.down_proj.weight"}
BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
# What rotate_half's layout reorders: q and k rows (weights and biases), per head, and the
# entries of the q/k norm gains (one head's width).
ROTATED = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
           "attention.q_norm.weight", "attention.k_norm.weight")


def hf_name(name: str) -> str:
    """A parameter's name in the single-process model -> its name in LlamaForCausalLM."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    match = BLOCK.fullmatch(name)
    if not match or match.group(2) not in IN_BLOCK:
        raise ValueError(f"no Hugging Face name for {name!r}")
    return f"model.layers.{match.group(1)}.{IN_BLOCK[match.group(2)]}"


def to_rotate_half(weight, n_heads: int):
    """Rows of wq or wk (or entries of a bias or head norm gain) from interleaved rotary pairs to
    rotate_half's halves, per head: within a head, row 2i + j moves to j * head_dim/2 + i."""
    rows, cols = weight.shape[0], weight[0].numel()
    width = rows // n_heads
    return weight.reshape(n_heads, width // 2, 2, cols).transpose(1, 2).reshape(weight.shape)


def from_rotate_half(weight, n_heads: int):
    """The inverse of to_rotate_half (a Hugging Face checkpoint's wq or wk, for partrain)."""
    rows, cols = weight.shape[0], weight[0].numel()
    width = rows // n_heads
    return weight.reshape(n_heads, 2, width // 2, cols).transpose(1, 2).reshape(weight.shape)


def to_hf(name: str, weight, model_cfg):
    """Parameter `name`'s weight (whole, or its rows of a tp shard: whole heads) as transformers
    holds it."""
    if name.endswith(ROTATED):
        return to_rotate_half(weight, weight.shape[0] // head_dim(model_cfg))
    return weight


def from_hf(name: str, weight, model_cfg):
    """The inverse of to_hf: a transformers tensor (or its rows for this rank) for `name`."""
    if name.endswith(ROTATED):
        return from_rotate_half(weight, weight.shape[0] // head_dim(model_cfg))
    return weight


def _whole(hf: dict, key: str, where: str, default=None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key}={value!r} must be a whole number >= 1")
    return value


def _real(table: dict, key: str, where: str, default=None) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{where}: {key}={value!r} must be a finite number > 0")
    return float(value)


def _refuse_sliding_layers(hf: dict, family: str, where: str) -> None:
    """Qwen's sliding-window layers (use_sliding_window, or layer_types naming them): partrain
    has none. sliding_window alone is only the size they would have."""
    layer_types = hf.get("layer_types") or []
    if not layer_types and hf.get("use_sliding_window"):
        # transformers' rule where layer_types is not written (Qwen2Config): layer i slides when
        # i >= max_window_layers (28 by default); a window past the last layer leaves all full.
        layers, start = hf.get("num_hidden_layers"), hf.get("max_window_layers", 28)
        layer_types = (["sliding_attention" if i >= start else "full_attention"
                        for i in range(layers)]
                       if isinstance(layers, int) and isinstance(start, int)
                       else ["sliding_attention"])
    if "sliding_attention" in layer_types:
        raise ConfigError(f"{where}: use_sliding_window={hf.get('use_sliding_window')!r} "
                          f"(layer_types {sorted(set(layer_types))}); partrain's {family} "
                          "attends to every earlier position in every layer (no sliding-window "
                          "layers)")


def model_keys(hf: dict, where: str) -> dict:
    """partrain's model keys for a transformers config of a family partrain has (refusing what
    partrain lacks)."""
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type={family!r}; partrain imports "
                          f"{', '.join(ARCHITECTURES)} models")
    fixed = [("hidden_act", "silu"), ("mlp_bias", False)]
    if family in ("llama", "qwen3"):  # a bias on q, k, v and o: partrain has none on o
        fixed.append(("attention_bias", False))
    for key, want in fixed:
        if hf.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={hf[key]!r}; partrain's {family} has "
                              f"{key}={want!r}")
    tie = hf.get("tie_word_embeddings", False)  # the default of these configs
    if not isinstance(tie, bool):
        raise ConfigError(f"{where}: tie_word_embeddings={tie!r} must be true or false")
    dim, heads = _whole(hf, "hidden_size", where), _whole(hf, "num_attention_heads", where)
    # transformers' default when config.json has none (or null): hidden_size / heads
    width = _whole(hf, "head_dim", where) if hf.get("head_dim") is not None else dim // heads
    # transformers 5 reads rope_scaling first (convert_rope_params_to_dict: `rope_scaling or
    # rope_parameters`): a YaRN or linear rope_scaling beside a default rope_parameters (a v5
    # config edited after a model card) is the model's rope, not to be dropped.
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: {key}={rope!r} must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{where}: rope_type={rope_type!r}; partrain has default and llama3")
    max_seq_len = _whole(hf, "max_position_embeddings", where, MAX_POSITIONS[family])
    window = None
    # A Mistral config.json without the key gets transformers' default window, not none:
    # MistralConfig's `sliding_window: int | None = 4096` (transformers 5.24,
    # models/mistral/configuration_mistral.py; 4.x: `sliding_window=4096` in __init__). Only an
    # explicit null is no window.
    if family == "mistral" and hf.get("sliding_window", MISTRAL_WINDOW) is not None:
        window = _whole(hf, "sliding_window", where, MISTRAL_WINDOW)
        max_seq_len = min(max_seq_len, window)  # partrain's window: no sequence longer
    if family in ("qwen2", "qwen3"):
        _refuse_sliding_layers(hf, family, where)
    keys = {"n_layers": _whole(hf, "num_hidden_layers", where), "n_heads": heads,
            # null, as absent, is transformers' "as many as num_attention_heads"
            "n_kv_heads": _whole(hf, "num_key_value_heads", where, heads)
            if hf.get("num_key_value_heads") is not None else heads, "dim": dim,
            "head_dim": width,
            "ffn_dim": _whole(hf, "intermediate_size", where),
            "vocab_size": _whole(hf, "vocab_size", where),
            "norm_eps": _real(hf, "rms_norm_eps", where, 1e-6),
            "rope_theta": _real(rope, "rope_theta", where, hf.get("rope_theta", 10000.0)),
            "rope_type": rope_type, "tie_embeddings": tie, "max_seq_len": max_seq_len,
            "qkv_bias": family == "qwen2", "qk_norm": family == "qwen3",
            "sliding_window": window, "hf_model_type": family}
    if rope_type == "llama3":
        keys.update(rope_factor=_real(rope, "factor", where),
                    rope_low_freq_factor=_real(rope, "low_freq_factor", where),
                    rope_high_freq_factor=_real(rope, "high_freq_factor", where),
                    rope_original_max_seq_len=_whole(rope, "original_max_position_embeddings",
                                                     where))
    return keys


def export_family(model_cfg) -> str:
    """The model_type an export writes: model.hf_model_type, else the one the keys make."""
    if model_cfg.hf_model_type:
        return model_cfg.hf_model_type
    if model_cfg.qk_norm and model_cfg.qkv_bias:
        raise ConfigError("model.qk_norm=true and model.qkv_bias=true: no Hugging Face family "
                          "has both (Qwen3's attention_bias adds a bias on o_proj too, which "
                          "partrain's model lacks); --format hf cannot write it")
    return "qwen3" if model_cfg.qk_norm else "qwen2" if model_cfg.qkv_bias else "llama"


def rope_parameters(model_cfg) -> dict:
    """The rotary embedding as transformers describes it (`rope_parameters`, since 5.0)."""
    m = model_cfg
    llama3 = {"factor": float(m.rope_factor), "low_freq_factor": float(m.rope_low_freq_factor),
              "high_freq_factor": float(m.rope_high_freq_factor),
              "original_max_position_embeddings": int(m.rope_original_max_seq_len)}
    return {"rope_type": m.rope_type, "rope_theta": float(m.rope_theta),
            **(llama3 if m.rope_type == "llama3" else {})}


def hf_config(model_cfg, dtype: str) -> dict:
    """config.json of the transformers model of the family (export_family) that computes what
    partrain's model computes. The rotary base is written both ways transformers has read it
    (rope_theta before 5.0, rope_parameters since)."""
    m, family = model_cfg, export_family(model_cfg)
    config = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": ffn_dim(m),
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": head_dim(m),
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "rope_parameters": rope_parameters(m),
        # transformers before 5.0 reads Llama-3's scaling here.
        "rope_scaling": rope_parameters(m) if m.rope_type == "llama3" else None,
        "tie_word_embeddings": tied(m),
        "attention_dropout": 0.0,
        "initializer_range": float(m.init_std),
        # No BOS: partrain's data has none before a document, nor its prompts in `sample`, and
        # the export's tokenizer adds none (data.tokenizer.write_as_trained). eos_token_id is the
        # run's end-of-text token where it has a tokenizer (interop.hf.export_hf).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": CONFIG_DTYPE[dtype],
    }
    if family in ("llama", "qwen3"):
        config["attention_bias"] = False
    if family == "llama":
        config["mlp_bias"] = False
    if family == "mistral":
        config["sliding_window"] = m.sliding_window
    if family in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=m.n_layers)
    return config

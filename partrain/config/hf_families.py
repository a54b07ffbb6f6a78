"""The Hugging Face families partrain reads and writes, as config.json describes them: Llama 2/3,
Mistral, Qwen2/2.5 and Qwen3, each partrain's decoder with a few model keys set (no torch: the
launcher reads these while composing the config).

    model_type   what differs from Llama                 partrain's keys
    llama        (rope scaling: rope_type=llama3)        -
    mistral      sliding_window                          model.sliding_window (>= max_seq_len)
    qwen2        a bias on q/k/v (never on o)            model.qkv_bias=true
    qwen3        RMSNorm of each head's q and k          model.qk_norm=true

Every family's head_dim is read into model.head_dim (written out on export): real Qwen3 sizes
set their own (Qwen3-0.6B: hidden_size 1024, 16 heads of 128).

What partrain cannot compute is refused naming the field: a bias on the output projection or
the MLP (Llama's attention_bias, Qwen3's attention_bias), layers with sliding-window attention
(Qwen's use_sliding_window), other activations and rope types.

`model.init_from=hf:DIR` alone is enough: `apply_hf_keys` sets the model keys from config.json
when the config is composed; a key also given on the command line must agree (a shorter
model.max_seq_len is allowed: the weights do not depend on it).
"""

import json
import math
from pathlib import Path

from partrain.errors import ConfigError

HF_PREFIX = "hf:"
HF_CONFIG_MAX_BYTES = 1 << 20
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONFIG_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def is_hf(init_from) -> bool:
    return isinstance(init_from, str) and init_from.startswith(HF_PREFIX)


def hf_dir(init_from: str) -> Path:
    return Path(init_from[len(HF_PREFIX):])


def read_hf_config(path: Path) -> dict:
    """config.json of a Hugging Face model directory (ConfigError naming model.init_from)."""
    where = f"model.init_from={HF_PREFIX}{path}"
    config = path / "config.json"
    if not path.is_dir():
        raise ConfigError(f"{where}: {path} is not a directory (a Hugging Face model directory "
                          "with config.json and safetensors weights)")
    if not config.is_file():
        raise ConfigError(f"{where}: {config} does not exist")
    if config.stat().st_size > HF_CONFIG_MAX_BYTES:
        raise ConfigError(f"{where}: {config} is over 1 MiB; not a model config")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {config} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {config} holds {type(data).__name__}, not an object")
    return data


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
    if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
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
    head_dim = _whole(hf, "head_dim", where) if hf.get("head_dim") is not None else dim // heads
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters={rope!r} must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{where}: rope_type={rope_type!r}; partrain has default and llama3")
    max_seq_len = _whole(hf, "max_position_embeddings", where, 2048)
    window = None
    if family == "mistral" and hf.get("sliding_window") is not None:
        window = _whole(hf, "sliding_window", where)
        max_seq_len = min(max_seq_len, window)  # partrain's window: no sequence longer
    if family in ("qwen2", "qwen3"):
        _refuse_sliding_layers(hf, family, where)
    keys = {"n_layers": _whole(hf, "num_hidden_layers", where), "n_heads": heads,
            "n_kv_heads": _whole(hf, "num_key_value_heads", where, heads), "dim": dim,
            "head_dim": head_dim,
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


# Keys whose value in a run may differ from config.json's in one direction: a shorter context.
AT_MOST = ("max_seq_len",)


def disagreements(mine: dict, wanted: dict) -> list[str]:
    """The keys of `wanted` that `mine` contradicts."""
    return [key for key in wanted
            if not (_same(mine[key], wanted[key])
                    or key in AT_MOST and mine[key] is not None and mine[key] <= wanted[key])]


def refuse_disagreements(where: str, mine: dict, wanted: dict, advice: str) -> None:
    wrong = disagreements(mine, wanted)
    if wrong:
        raise ConfigError(
            f"{where}: " + ", ".join(
                f"model.{k}={shown(mine[k])} but config.json says "
                f"{'at most ' if k in AT_MOST else ''}{shown(wanted[k])}" for k in wrong)
            + advice.format(keys=" ".join(f"model.{k}={shown(wanted[k])}" for k in wrong)))


def apply_hf_keys(cfg, given: set[str]) -> None:
    """model.init_from=hf:DIR: set the model keys from DIR/config.json, in place. `given`: the
    model keys (without "model.") the command line set; each must agree with config.json."""
    from omegaconf import open_dict

    where = f"model.init_from={cfg.model.init_from}"
    wanted = model_keys(read_hf_config(hf_dir(cfg.model.init_from)), f"{where} (config.json)")
    mine = {key: cfg.model[key] for key in wanted if key in given}
    refuse_disagreements(where, mine, {k: wanted[k] for k in mine},
                         "; config.json gives the model's shape: leave these keys out, or give "
                         "{keys}")
    with open_dict(cfg):
        for key, value in wanted.items():
            if key not in given:
                cfg.model[key] = value


def shown(value) -> str:
    """A value as an override writes it (booleans as true/false, None as null)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _same(mine, theirs) -> bool:
    if isinstance(mine, float) or isinstance(theirs, float):
        if mine is None or theirs is None:
            return False
        return abs(float(mine) - float(theirs)) <= 1e-12 * max(abs(float(theirs)), 1.0)
    return mine == theirs


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
    from partrain.models.arith import ffn_dim, head_dim, tied

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
        # The byte-level corpora have no special tokens.
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

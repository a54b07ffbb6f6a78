"""Hugging Face directories as the weights a run starts from (`model.init_from=hf:DIR`), as far
as composing the config needs them (no torch): DIR's config.json, read into the model keys by the
family's adapter (partrain.models.family.HfAdapter; the built-in family's, for Llama 2/3,
Mistral, Qwen2/2.5 and Qwen3, is partrain.models.llama_hf, which says which keys make which).

`model.init_from=hf:DIR` alone is enough: `apply_hf_keys` sets the model keys from config.json
when the config is composed; a key also given on the command line must agree (a shorter
model.max_seq_len is allowed: the weights do not depend on it). A family without an adapter is
refused here, naming it.
"""

import json
from pathlib import Path

from partrain.errors import ConfigError
from partrain.models.family import hf_adapter, is_user_model
from partrain.models.llama_hf import model_keys

HF_PREFIX = "hf:"
HF_CONFIG_MAX_BYTES = 1 << 20


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
    # A user's model is refused by validation, which names everything it lacks at once.
    keys = model_keys if is_user_model(cfg.model) else hf_adapter(cfg.model, where).keys
    wanted = keys(read_hf_config(hf_dir(cfg.model.init_from)), f"{where} (config.json)")
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

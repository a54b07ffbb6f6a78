"""Every check before a start, in one order."""

from pathlib import Path

from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.resume import NOT_SHAPE, _flat, saved_config
from partrain.config.keys import shown
from partrain.errors import ConfigError


def check_init_from(cfg) -> store.Checkpoint | None:
    """model.init_from names a committed checkpoint whose weights fit model.*: the checkpoint
    (None for none, and for a Hugging Face directory, `hf:DIR`, which is checked here too)."""
    from partrain.interop.hf import check_hf_init, is_hf

    if not cfg.model.init_from:
        return None
    if is_hf(cfg.model.init_from):
        check_hf_init(cfg.model)
        return None
    checkpoint = store.find(Path(cfg.model.init_from), "model.init_from")
    saved = _flat(saved_config(checkpoint).get("model", {}), "model.")
    new = _flat(OmegaConf.to_container(cfg.model, resolve=True), "model.")
    for key in sorted(new):
        if key not in NOT_SHAPE and key in saved and saved[key] != new[key]:
            raise ConfigError(
                f"{key}={shown(new[key])} does not match {shown(saved[key])} of the checkpoint "
                f"model.init_from={checkpoint.path}: its weights have that model's shape")
    return checkpoint

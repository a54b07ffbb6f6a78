"""A run dir's frozen config.yaml: recognised, and loaded typed against today's schema, never
re-composed with Hydra. The one loader for the launcher (`launch RUN_DIR/config.yaml`), a resume
(checkpoint/resume) and a checkpoint's saved config."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from partrain.errors import ConfigError

CONFIG = "config.yaml"


def is_frozen_config(config: str | None) -> bool:
    """A run dir's config.yaml: a resolved config (every section, no defaults list)."""
    from partrain.config.compose import read_yaml

    if not config or not config.endswith((".yaml", ".yml")):
        return False
    try:
        raw = read_yaml(Path(config))
    except ConfigError:  # compose_config reads it again and says what is wrong
        return False
    return (isinstance(raw, dict) and "defaults" not in raw
            and {"model", "parallel", "train", "launcher"} <= raw.keys())


def load_frozen_config(config: str, overrides: list[str]) -> DictConfig:
    """Run a frozen config again as it is: typed against the schema, never re-composed. It takes
    no overrides: what the workers run must be exactly what the file says."""
    from partrain.config.compose import explain, read_yaml
    from partrain.config.keys import SECTIONS, check_no_interpolation, check_tree
    from partrain.config.schema import Config

    if overrides:
        raise ConfigError(
            f"{config} is a run dir's frozen config and takes no overrides (got "
            f"{' '.join(overrides)}); compose from the recipe instead, e.g. "
            f"`partrain launch RECIPE {' '.join(overrides)}`")
    raw = read_yaml(Path(config), "frozen config")
    if not isinstance(raw, dict):  # empty (a write a power cut lost), or a list, a scalar
        raise ConfigError(f"frozen config {config} is {'empty' if raw is None else 'not a mapping'}"
                          ": a run dir's config.yaml holds every section, exactly as the workers "
                          "ran it")
    where = f"in the frozen config {config}"
    check_tree(raw, where)
    missing = sorted(SECTIONS - raw.keys())
    if missing:
        raise ConfigError(f"frozen config {config} lacks the section(s) {', '.join(missing)}: a "
                          "run dir's config.yaml holds every section, exactly as the workers ran "
                          "it; compose from a recipe instead")
    check_no_interpolation(raw, where)
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(raw))
    except OmegaConfBaseException as e:
        raise ConfigError(f"frozen config {config} does not match partrain's schema: "
                          f"{explain(e)}") from None

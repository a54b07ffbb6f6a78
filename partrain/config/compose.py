"""Compose a recipe (or YAML file) with Hydra overrides into one typed config, once, in the launcher.

Recipes are Hydra primary configs whose defaults list starts with `config` (configs/config.yaml),
so a recipe is a small diff over the defaults and `override model: llama-7b` works as in any Hydra
app. Workers never call this: they load the frozen config.yaml that the launcher wrote.
"""

import shutil
import tempfile
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from partrain.config.schema import register
from partrain.errors import ConfigError
from partrain.paths import configs_dir, recipes_dir

DEFAULT_RECIPE = "quickstart"


def known_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def find_recipe(config: str | None) -> Path:
    """A recipe name (`quickstart`) or a path to a YAML file; none means the quickstart recipe."""
    config = config or DEFAULT_RECIPE
    as_path = Path(config)
    if as_path.suffix in (".yaml", ".yml") or as_path.exists():
        if not as_path.is_file():
            raise ConfigError(
                f"config file {config} does not exist; give a YAML path or one of the recipes: "
                f"{', '.join(known_recipes())}"
            )
        return as_path.resolve()
    recipe = recipes_dir() / f"{config}.yaml"
    if not recipe.is_file():
        raise ConfigError(
            f"unknown recipe '{config}'; known recipes: {', '.join(known_recipes())} "
            "(or give a path to a YAML file)"
        )
    return recipe


def _check_has_defaults(path: Path) -> None:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} is not readable YAML: {e}") from None
    if not isinstance(raw, dict) or "defaults" not in raw:
        raise ConfigError(
            f"config file {path} has no defaults list; start it like the recipes do with\n"
            "defaults:\n  - config\n  - _self_\n"
            "so that it is a diff over partrain's defaults"
        )


def _explain(e: Exception) -> str:
    # Hydra wraps the useful OmegaConf message (key, value, type) as the cause; show both, once.
    parts = [str(e).strip()]
    cause = e.__cause__
    while cause is not None:
        # Drop OmegaConf's trailing "full_key: / reference_type= / object_type=" lines.
        text = "\n".join(line for line in str(cause).strip().splitlines()
                         if not line.strip().startswith(("full_key:", "reference_type=",
                                                         "object_type=")))
        if text and text not in parts[-1]:
            parts.append(text)
        cause = cause.__cause__
    return "\n".join(parts)


def _compose(path: Path, overrides: list[str]) -> DictConfig:
    search = f"hydra.searchpath=[file://{configs_dir()}]"
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            return compose(config_name=path.stem, overrides=[search, *overrides])
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"invalid config or override: {_explain(e)}") from None


def compose_config(config: str | None, overrides: list[str]) -> DictConfig:
    """The resolved, typed config for a recipe or YAML file plus Hydra-grammar overrides."""
    path = find_recipe(config)
    _check_has_defaults(path)
    register()
    # A user's file is composed from a private copy under a neutral name: Hydra finds a primary
    # config only as <name>.yaml, and a config.yaml beside it (or the file itself, if so named)
    # would shadow the configs/config.yaml its defaults list asks for and recurse without end.
    if path.parent != recipes_dir().resolve():
        with tempfile.TemporaryDirectory(prefix="partrain-recipe-") as tmp:
            copy = Path(tmp) / "user_recipe.yaml"
            shutil.copyfile(path, copy)
            cfg = _compose(copy, overrides)
    else:
        cfg = _compose(path, overrides)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {_explain(e)}") from None
    return cfg

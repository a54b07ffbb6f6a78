"""Compose a recipe (or YAML file) with Hydra overrides into one typed config, once, in the launcher.

Recipes are Hydra primary configs whose defaults list starts with `config` (configs/config.yaml),
so a recipe is a small diff over the defaults and `override model: llama-7b` works as in any Hydra
app. Workers never call this: they load the frozen config.yaml that the launcher wrote.
"""

import copy
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from partrain.config.keys import (
    check_defaults_list,
    check_no_interpolation,
    check_overrides,
    check_tree,
    groups,
)
from partrain.config.ds_file import apply_deepspeed_file
from partrain.config.paths import configs_dir, known_recipes, recipes_dir
from partrain.config.schema import register
from partrain.errors import ConfigError
from partrain.config.hf_families import apply_hf_keys, is_hf

DEFAULT_RECIPE = "quickstart"
MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; anything larger is the wrong file
# YAML aliases let a small file expand to any size (an "alias bomb"), and Hydra copies what they
# expand to: bound the values and the depth that a config may hold once expanded.
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 32


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; OmegaConf (inside Hydra) refuses
    them with a traceback. Refuse them here, naming the key and both lines."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key (a list or mapping): not a config key
                raise yaml.constructor.ConstructorError(
                    None, None, "a key that is a list or mapping", key_node.start_mark) from None
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first})",
                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, what: str = "config file"):
    """A YAML file that partrain reads, parsed; or a ConfigError naming the file and what is
    wrong: not a regular file, unreadable, too large, not UTF-8, not YAML, a key given twice."""
    try:
        if path.is_dir():
            inside = path / "config.yaml"  # a run dir: its frozen config is meant
            raise ConfigError(f"{what} {path} is a directory; give a YAML file"
                              + (f" (the run dir's config: {inside})" if inside.is_file() else ""))
        if not path.exists() and not path.is_symlink():
            raise ConfigError(f"{what} {path} does not exist")
        if not path.is_file():
            raise ConfigError(f"{what} {path} is not a regular file"
                              + (" (a broken or looping symbolic link)" if path.is_symlink()
                                 else ""))
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{what} {path} has {size:,} bytes; a config is at most "
                              f"{MAX_CONFIG_BYTES:,} bytes of YAML (is it the right file?)")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                          f"offset {e.start}); save it as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply to be a config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}") from None
    _check_expanded_size(raw, f"{what} {path}")
    return raw


def _check_expanded_size(raw, where: str) -> None:
    """Count the values as Hydra will see them (an alias counts each time it is used), stopping
    at the bound, so the check itself costs little for any file."""
    count, stack = 0, [(raw, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where} expands to more than {MAX_CONFIG_VALUES:,} values (YAML "
                              "aliases?); a config is much smaller")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where} nests values more than {MAX_CONFIG_DEPTH} levels deep; "
                              "a config is much flatter")
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        elif node is None or isinstance(node, (str, int, float, bool)):
            children = ()
        else:  # !!binary, a date, a timestamp, a set: YAML types a config value cannot be
            raise ConfigError(f"{where} holds a {type(node).__name__} value ({str(node)[:40]!r});"
                              " a config value is a string, number, boolean, list or mapping: "
                              "quote it to make it a string")
        stack.extend((child, depth + 1) for child in children)


def find_recipe(config: str | None) -> Path:
    """A recipe name (`quickstart`) or a path to a YAML file; none means the quickstart recipe."""
    if config is None:
        config = DEFAULT_RECIPE
    if not config.strip():
        raise ConfigError(f"CONFIG {config!r} is empty (an unset shell variable?); give a recipe "
                          f"name ({', '.join(known_recipes())}) or a YAML path, or leave it out "
                          "for the quickstart")
    as_path = Path(config)
    # A bare name is a recipe, never a file of that name in the current directory; a path has a
    # directory part or a YAML suffix (`./myrecipe` for a file without one).
    if as_path.suffix in (".yaml", ".yml") or "/" in config:
        try:
            exists = as_path.exists() or as_path.is_symlink()
        except OSError as e:
            raise ConfigError(f"config file {config[:200]} cannot be used: {e.strerror}") from None
        if not exists:
            raise ConfigError(
                f"config file {config} does not exist; give a YAML path or one of the recipes: "
                f"{', '.join(known_recipes())}"
            )
        return as_path.absolute()
    recipe = recipes_dir() / f"{config}.yaml"
    if not recipe.is_file():
        raise ConfigError(
            f"unknown recipe '{config}'; known recipes: {', '.join(known_recipes())} "
            "(or give a path to a YAML file)"
        )
    return recipe


def _check_recipe_file(path: Path) -> None:
    """Readable YAML, a defaults list over partrain's defaults, and only the schema's keys."""
    raw = read_yaml(path)
    if not isinstance(raw, dict) or "defaults" not in raw:
        raise ConfigError(
            f"config file {path} has no defaults list; start it like the recipes do with\n"
            "defaults:\n  - config\n  - _self_\n"
            "so that it is a diff over partrain's defaults"
        )
    check_defaults_list(raw["defaults"], f"config file {path}")
    check_tree(raw, f"in the config file {path}")


def explain(e: Exception) -> str:
    """Hydra wraps the useful OmegaConf message (key, value, type) as the cause: show each
    message once, with OmegaConf's `full_key:` put in front, its type lines and Hydra's dump of
    its search path dropped."""
    parts, key = [], None
    while e is not None:
        for line in str(e).strip().splitlines():
            line = line.strip()
            if line.startswith("Config search path"):
                break
            if line.startswith("full_key:"):
                key = key or line.removeprefix("full_key:").strip()
            elif line and not line.startswith(("reference_type=", "object_type=")) and \
                    not any(line in part for part in parts):
                parts.append(line)
        e = e.__cause__
    return (f"{key}: " if key else "") + " ".join(parts)


# Hydra composes in two parts: the defaults list (the recipe, partrain's defaults and the group
# options, 20 YAML files loaded and merged: about 0.2 s), then the value overrides applied to it
# (`ConfigLoaderImpl._apply_overrides_to_config`). The first part depends only on the recipe's
# text and the group overrides (`model=llama-7b`): it is kept per process, for the last
# COMPOSED_KEPT of them, and a later compose with other values (`plan --search` of several
# shapes, the in-process CLI of the tests) applies its values to a copy with Hydra's own code.
COMPOSED_KEPT = 16
_composed: "OrderedDict[tuple, DictConfig]" = OrderedDict()


def _defaults_composed(path: Path, chosen: list[str]) -> DictConfig:
    """Hydra's composition of the recipe at `path` with the group overrides `chosen` only."""
    # A user's recipe is a private copy alone in its folder: its text names all of it.
    place = str(path.parent) if path.parent == recipes_dir().resolve() else None
    key = (place, path.stem, path.read_bytes(), tuple(chosen))
    if key not in _composed:
        search = f"hydra.searchpath=[file://{configs_dir()}]"
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            _composed[key] = compose(config_name=path.stem, overrides=[search, *chosen])
        while len(_composed) > COMPOSED_KEPT:
            _composed.popitem(last=False)
    _composed.move_to_end(key)
    return copy.deepcopy(_composed[key])


def _compose(path: Path, overrides: list[str], shown_as: Path) -> DictConfig:
    """Hydra's composition of the recipe with the (checked) overrides: the group options first,
    then every value, as Hydra orders them whatever their order on the command line."""
    known = groups()
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        cfg = _defaults_composed(path, [o.input_line for o in parsed if o.key_or_group in known])
        ConfigLoaderImpl._apply_overrides_to_config(
            [o for o in parsed if o.key_or_group not in known], cfg)
        return cfg
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        # Name the user's file, never the private copy it was composed from.
        text = explain(e).replace(str(path), str(shown_as)).replace(f"'{path.stem}'",
                                                                       f"'{shown_as}'")
        raise ConfigError(f"invalid config or override: {text}") from None


def _failing_key(cfg: DictConfig) -> str:
    """'KEY: ' for the first key whose interpolation (${...}) cannot be resolved, '' if none."""
    from partrain.config.keys import SCHEMA_KEYS

    for key in SCHEMA_KEYS:
        try:
            OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except OmegaConfBaseException:
            return f"{key}: "
    return ""


def _check_deepspeed_override(overrides: list[str]) -> None:
    """`parallel.deepspeed=ds_config.json` is what a DeepSpeed user types first: that section
    holds raw keys, a file goes to parallel.deepspeed_config."""
    for text in overrides:
        key, _, value = text.lstrip("+").partition("=")
        if key == "parallel.deepspeed" and value.strip("'\"").endswith((".json", ".yaml")):
            raise ConfigError(
                f"parallel.deepspeed={value} holds raw DeepSpeed keys ({{...}} or "
                f"parallel.deepspeed.KEY=VALUE); to read a DeepSpeed JSON file use "
                f"parallel.deepspeed_config={value}")


def compose_config(config: str | None, overrides: list[str]) -> DictConfig:
    """The resolved, typed config for a recipe or YAML file plus Hydra-grammar overrides."""
    path = find_recipe(config)
    _check_recipe_file(path)
    _check_deepspeed_override(overrides)
    overrides = check_overrides(overrides)
    register()
    # A user's file is composed from a private copy under a neutral name: Hydra finds a primary
    # config only as <name>.yaml, and a config.yaml beside it (or the file itself, if so named)
    # would shadow the configs/config.yaml its defaults list asks for and recurse without end.
    if path.parent != recipes_dir().resolve():
        with tempfile.TemporaryDirectory(prefix="partrain-recipe-") as tmp:
            copy = Path(tmp) / "user_recipe.yaml"
            shutil.copyfile(path, copy)
            cfg = _compose(copy, overrides, path)
    else:
        cfg = _compose(path, overrides, path)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        text, key = explain(e), _failing_key(cfg)
        raise ConfigError(f"invalid config (composed from {path} and the overrides): "
                          f"{'' if text.startswith(key) else key}{text}") from None
    # Hydra opens the config for `+key=value`; what it added must still be in the schema. An
    # escaped `\${x}` resolves to the text `${x}`, which OmegaConf would read again later.
    resolved = OmegaConf.to_container(cfg)
    check_tree(resolved, "in the composed config")
    check_no_interpolation(resolved, "in the composed config")
    # A user's DeepSpeed JSON sets partrain's keys and raw DeepSpeed keys, once, here.
    apply_deepspeed_file(cfg, overrides)
    if is_hf(cfg.model.init_from):  # the model's shape is config.json's
        apply_hf_keys(cfg, _model_keys_given(overrides))
    _check_blend_source(cfg, overrides)
    return cfg


def _check_blend_source(cfg: DictConfig, overrides: list[str]) -> None:
    """A blend reads token dirs whatever `data=` chose (validation sets data.source=tokens), so
    only an override that asks for another source says something the blend would overrule."""
    if cfg.data.get("blend") is None:
        return
    parser = OverridesParser.create()
    for text in overrides:
        override = parser.parse_override(text)
        if override.key_or_group in ("data", "data.source"):
            value = override.value()
            if value != "tokens":
                raise ConfigError(
                    f"{override.key_or_group}={value} and data.blend both choose the training "
                    "data; a blend reads the token dirs it names (data.source=tokens): drop "
                    f"{override.key_or_group}={value}, or data.blend for {value}")


def _model_keys_given(overrides: list[str]) -> set[str]:
    """The model.* keys (without "model.") that the overrides set."""
    parser = OverridesParser.create()
    keys = (parser.parse_override(text).key_or_group for text in overrides)
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}

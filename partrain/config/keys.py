"""Which keys and group options exist, what each key means, and the nearest real one to a typo.

Hydra lets `+key=value` add any key (it opens the config for it), and its own messages for a
misspelt key advise exactly that. partrain's config is closed: every key is declared in the
schema, and only `parallel.deepspeed` and `model.args` take free keys. So overrides, a user's YAML and the composed
result are all checked here against the schema, and a wrong key is named with a suggestion.

The key table (`key_table`, `render_markdown`) is read from the schema's field docstrings, so
`partrain show --keys` and docs/config-keys.md cannot drift from it. Regenerate the docs with
`python -m partrain.config.keys > docs/config-keys.md`.
"""

import ast
import dataclasses
import difflib
import inspect
import re
import sys
import typing
from typing import Any, NamedTuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from partrain.config.paths import configs_dir, known_recipes
from partrain.config.schema import Config
from partrain.errors import ConfigError

# Raw DeepSpeed keys and a user model's own keys: free by design.
OPEN_KEYS = ("parallel.deepspeed", "model.args")


def _fields(cls, prefix: str = ""):
    """(dotted name, field, the dataclass declaring it) for every field of a schema dataclass,
    sections included, depth first in declaration order."""
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f, cls
        if dataclasses.is_dataclass(f.type):
            yield from _fields(f.type, f"{prefix}{f.name}.")


def _leaves(cls) -> dict[str, object]:
    """Every key of a schema dataclass, by its dotted name, with its declared type."""
    return {key: f.type for key, f, _ in _fields(cls) if not dataclasses.is_dataclass(f.type)}


SCHEMA_KEYS = _leaves(Config)
SECTIONS = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)}
# Every section at any depth, by dotted name ("model", "model.moe").
ALL_SECTIONS = {key.rsplit(".", i)[0] for key in SCHEMA_KEYS for i in range(1, key.count(".") + 1)}


def _is_switch(t) -> bool:
    """A key declared bool (or bool or null)."""
    return t is bool or (typing.get_origin(t) is typing.Union and bool in typing.get_args(t))


def float_keys() -> list[str]:
    """Keys declared as (optional) floats: each must be a finite number."""
    def is_float(t) -> bool:
        return t is float or float in typing.get_args(t)
    return [key for key, t in SCHEMA_KEYS.items() if is_float(t)]


def groups() -> dict[str, list[str]]:
    """Config groups (configs/<group>/) and their options (<option>.yaml)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(configs_dir().iterdir()) if d.is_dir()}


MAX_DIVISOR_SHOWN = 4096  # divisor hints ("try tp in {...}") search no further


def divisors(n: int) -> str:
    """The divisors of n that a degree could be (up to MAX_DIVISOR_SHOWN, so any n costs the
    same); a long list is cut."""
    found = [d for d in range(1, min(n, MAX_DIVISOR_SHOWN) + 1) if n % d == 0]
    cut = found if len(found) <= 12 else found[:9] + ["..."] + found[-2:]
    return "{" + ", ".join(map(str, cut)) + ("" if n <= MAX_DIVISOR_SHOWN else ", ...") + "}"


def shown(value) -> str:
    """A value as the user wrote it in YAML or an override (null, true), not Python's None/True."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _is_open(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in OPEN_KEYS)


# Other tools' names for partrain's keys (Megatron-LM, DeepSpeed, Hugging Face, nanoGPT,
# torchtitan), by their last part: the nearest key by spelling can mean something else
# (`parallel.zero` is next to `parallel.ep`, `tensor_parallel` to `sequence_parallel`). Looked up
# before the spelling, in any section; a key the schema does not have is never suggested.
SYNONYMS = {
    "zero": "parallel.zero_stage", "zero_optimization": "parallel.zero_stage",
    "stage": "parallel.zero_stage",
    "tensor_parallel": "parallel.tp", "tensor_parallel_size": "parallel.tp",
    "tensor_model_parallel_size": "parallel.tp", "tp_size": "parallel.tp",
    "tp_degree": "parallel.tp",
    "pipeline_parallel": "parallel.pp", "pipeline_parallel_size": "parallel.pp",
    "pipeline_model_parallel_size": "parallel.pp", "pp_size": "parallel.pp",
    "pp_degree": "parallel.pp",
    "data_parallel": "parallel.dp", "data_parallel_size": "parallel.dp", "dp_size": "parallel.dp",
    "dp_degree": "parallel.dp", "data_parallel_shard_degree": "parallel.dp",
    "data_parallel_replicate_degree": "parallel.dp_replicate",
    "context_parallel": "parallel.cp", "context_parallel_size": "parallel.cp",
    "context_parallel_degree": "parallel.cp", "cp_size": "parallel.cp",
    "expert_parallel": "parallel.ep", "expert_model_parallel_size": "parallel.ep",
    "expert_parallel_degree": "parallel.ep", "ep_size": "parallel.ep",
    "grad_accum": "train.micro_batches", "grad_accum_steps": "train.micro_batches",
    "gradient_accumulation_steps": "train.micro_batches",
    "gradient_accumulation": "train.micro_batches",
    "accumulate_grad_batches": "train.micro_batches",
    "train_batch_size": "train.global_batch_size", "batch_size": "train.global_batch_size",
    "global_batch": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "per_device_train_batch_size": "train.micro_batch_size",
    "micro_batch": "train.micro_batch_size",
    "lr": "optim.lr", "learning_rate": "optim.lr", "max_lr": "optim.lr",
    "warmup": "optim.warmup_steps", "warmup_iters": "optim.warmup_steps",
    "lr_warmup_steps": "optim.warmup_steps",
    "grad_clip": "optim.grad_clip", "gradient_clipping": "optim.grad_clip",
    "max_grad_norm": "optim.grad_clip", "clip_grad": "optim.grad_clip",
    "max_norm": "optim.grad_clip",
    "weight_decay": "optim.weight_decay", "optimizer": "optim.name",
    "lr_scheduler": "optim.schedule", "scheduler": "optim.schedule",
    "lr_schedule": "optim.schedule",
    "max_iters": "train.max_steps", "train_iters": "train.max_steps", "steps": "train.max_steps",
    "total_steps": "train.max_steps", "training_steps": "train.max_steps",
    "seq_length": "train.seq_len", "block_size": "train.seq_len", "seq_len": "train.seq_len",
    "context_length": "train.seq_len", "max_seq_length": "train.seq_len",
    "seed": "train.seed", "precision": "train.dtype", "mixed_precision": "train.dtype",
    "dtype": "train.dtype",
    "gradient_checkpointing": "train.activation_checkpointing",
    "activation_checkpoint": "train.activation_checkpointing",
    "recompute": "train.activation_checkpointing",
    "recompute_granularity": "train.activation_checkpointing",
    "eval_interval": "train.eval_every", "eval_steps": "train.eval_every",
    "eval_iters": "train.eval_batches", "log_interval": "train.log_every",
    "logging_steps": "train.log_every",
    "save_interval": "checkpoint.every", "save_steps": "checkpoint.every",
    "save_every": "checkpoint.every", "checkpoint_every": "checkpoint.every",
    "interval": "checkpoint.every", "save_total_limit": "checkpoint.keep",
    "keep_latest_k": "checkpoint.keep",
    "num_layers": "model.n_layers", "n_layer": "model.n_layers",
    "num_hidden_layers": "model.n_layers",
    "hidden_size": "model.dim", "d_model": "model.dim", "n_embd": "model.dim",
    "num_attention_heads": "model.n_heads", "n_head": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads", "num_query_groups": "model.n_kv_heads",
    "intermediate_size": "model.ffn_dim", "ffn_hidden_size": "model.ffn_dim",
    "vocab": "model.vocab_size", "padded_vocab_size": "model.vocab_size",
    "rms_norm_eps": "model.norm_eps", "layernorm_epsilon": "model.norm_eps",
    "tie_word_embeddings": "model.tie_embeddings",
    "num_experts": "model.moe.n_experts", "num_local_experts": "model.moe.n_experts",
    "num_experts_per_tok": "model.moe.top_k", "moe_router_topk": "model.moe.top_k",
    "nproc": "launcher.nproc_per_node", "num_gpus": "launcher.nproc_per_node",
    "num_nodes": "launcher.nnodes", "nodes": "launcher.nnodes",
}


def suggest(key: str, candidates) -> str:
    """' (did you mean X?)' for the key it means (SYNONYMS), else the nearest candidate by
    spelling, or '' when none is near."""
    candidates = list(candidates)
    meant = SYNONYMS.get(key.rsplit(".", 1)[-1].lower().replace("-", "_"))
    if meant in candidates and meant != key:
        return f" (did you mean {meant}?)"
    # The same words in another order (model=moe-tiny for tiny-moe: spelling said `tiny`)
    words = sorted(re.split(r"[-_.]", key.lower()))
    shuffled = [c for c in candidates if sorted(re.split(r"[-_.]", c.lower())) == words]
    if shuffled and shuffled[0] != key:
        return f" (did you mean {shuffled[0]}?)"
    best = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not best:  # a right key in the wrong section, or no section: match the last part alone
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        best = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)]
    return f" (did you mean {best[0]}?)" if best else ""


def _unknown_key(key: str, where: str) -> ConfigError:
    return ConfigError(
        f"unknown config key {key} {where}"
        f"{suggest(key, SCHEMA_KEYS if '.' in key else [*SCHEMA_KEYS, *groups()])}; "
        f"partrain's keys are declared in partrain/config/schema.py, and only "
        f"{' and '.join(OPEN_KEYS)} take keys of your own")


def check_overrides(overrides: list[str]) -> list[str]:
    """Each override is Hydra grammar, names a real key or group option, and is no sweep. Returns
    them as Hydra takes them: a key under parallel.deepspeed is added (`++`) when it is new."""
    parser = OverridesParser.create()
    known_groups = groups()
    accepted = []
    for text in overrides:
        if "=" not in text and (text.endswith((".yaml", ".yml")) or text in known_recipes()):
            raise ConfigError(f"{text} is a CONFIG (a recipe or a YAML file), given after "
                              f"overrides: it comes first (`partrain COMMAND {text} "
                              "KEY=VALUE ...`)")
        try:
            override = parser.parse_override(text)
        except HydraException as e:
            raise ConfigError(
                f"override {text} is not understood ({e}); write key=value, and quote a value "
                "with special characters inside the argument, e.g. \"data.path='/x/[run1]'\"") \
                from None
        key = override.key_or_group
        if not key:
            raise ConfigError(f"override {text} names no key; write key=value")
        if override.is_delete() and not _is_open(key):
            raise ConfigError(f"override {text} deletes {key}; partrain's keys cannot be "
                              "removed (every key has a default): set a value instead")
        if override.is_sweep_override():
            raise ConfigError(f"override {text} is a sweep (several values); partrain runs one "
                              "config at a time: quote a value that holds commas, key='a,b'")
        if override.package is not None:
            raise ConfigError(f"override {text} places a config group at a package (@); "
                              "partrain's groups have fixed places: write GROUP=OPTION")
        if key in known_groups:
            value = override.value()
            options = known_groups[key]
            if value not in options:
                raise ConfigError(
                    f"{key}={shown(value)} is not an option of the config group {key}"
                    f"{suggest(str(value), options)} (options: {', '.join(options)})")
            if override.is_add() or override.is_force_add():
                raise ConfigError(f"override {text} adds the group {key} a second time; "
                                  f"choose its option with {key}={value}")
            accepted.append(text)
        elif key in SCHEMA_KEYS:
            if _is_switch(SCHEMA_KEYS[key]) and not override.is_delete():
                value = override.value()
                # OmegaConf takes any number for a bool: sequence_parallel=2 was true, compile=0
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    raise ConfigError(f"{key}={value} is not a switch value: {key} is true or "
                                      "false")
            accepted.append(text)
        elif _is_open(key):
            accepted.append(text if text.startswith(("+", "~")) else "++" + text)
        else:
            raise _unknown_key(key, f"in the override {text}")
    return accepted


def check_no_interpolation(tree, where: str, prefix: str = "") -> None:
    """No value still holds `${...}` once resolved: OmegaConf would read it as an
    interpolation on every access (a frozen config is never resolved again)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else ()
    for name, value in items:
        key = f"{prefix}{name}" if isinstance(name, str) else f"{prefix.rstrip('.')}[{name}]"
        if isinstance(value, str) and "${" in value:
            raise ConfigError(f"{key}={value[:200]} {where} holds `${{`, which partrain would "
                              "read as an interpolation; a config value cannot contain it")
        check_no_interpolation(value, where, f"{key}.")


def check_tree(tree: dict, where: str, prefix: str = "") -> None:
    """Every key of a nested mapping (a YAML file, a composed config) is in the schema."""
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if key in SCHEMA_KEYS or _is_open(key) or (not prefix and name == "defaults"):
            continue
        if key in ALL_SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: {shown(value)} {where}: {key} is a section, a mapping "
                                  f"of its keys (e.g. {key}: {{{next(_keys_of(key))}: ...}})")
            check_tree(value, where, f"{key}.")
            continue
        raise _unknown_key(key, where)


def _keys_of(section: str):
    return (k.split(".", 1)[1] for k in SCHEMA_KEYS if k.startswith(section + "."))


def check_defaults_list(defaults, where: str) -> None:
    """`override GROUP: OPTION` entries of a YAML's defaults list name real options."""
    known_groups = groups()
    if not isinstance(defaults, list) or "config" not in defaults or (
            "_self_" in defaults and defaults.index("_self_") < defaults.index("config")):
        raise ConfigError(f"{where}: defaults must be a list that starts from partrain's "
                          "`config` and then applies the file itself (`_self_`), like "
                          "`defaults: [config, _self_]`")
    for entry in defaults:
        if entry in ("config", "_self_"):
            continue
        if not isinstance(entry, dict) or len(entry) != 1:
            raise ConfigError(
                f"{where}: defaults list entry {shown(entry)!r} is not one partrain knows: use "
                "`config`, `_self_` and `override GROUP: OPTION` (groups: "
                f"{', '.join(known_groups)})")
        (head, option), = entry.items()
        group = str(head).removeprefix("override ").strip()
        if group not in known_groups:
            raise ConfigError(
                f"{where}: defaults list entry `{head}: {shown(option)}`: {group} is not a config "
                f"group{suggest(group, known_groups)} (groups: {', '.join(known_groups)})")
        if not isinstance(option, str):
            raise ConfigError(f"{where}: defaults list entry `{head}: {shown(option)}`: an "
                              f"option is one name (options: {', '.join(known_groups[group])})")
        if option not in known_groups[group]:
            raise ConfigError(
                f"{where}: defaults list entry `{head}: {shown(option)}`: {shown(option)} is not an option of "
                f"the config group {group}{suggest(option, known_groups[group])} (options: "
                f"{', '.join(known_groups[group])})")


class Key(NamedTuple):
    """One row of the key table."""

    key: str  # dotted name, as an override writes it
    type: str  # in YAML's words: int, float, str, bool, list of int, mapping, any; "or null"
    default: Any  # the schema's default (a config group or recipe may set another)
    help: str  # the field's docstring on one line: meaning, unit, choices


def field_docs(cls) -> dict[str, str]:
    """Each field's docstring in a schema dataclass (the string on the line after the field), on
    one line; '' for a field without one."""
    module = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    body = next(node.body for node in module.body
                if isinstance(node, ast.ClassDef) and node.name == cls.__name__)
    docs = {f.name: "" for f in dataclasses.fields(cls)}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(t) -> str:
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) is typing.Union and len(args) == 1:
        return f"{_type_name(args[0])} or null"
    if typing.get_origin(t) is list:
        return f"list of {_type_name(args[0])}"
    if typing.get_origin(t) is dict:
        return "mapping"
    return "any" if t is Any else t.__name__


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def key_table() -> list[Key]:
    """Every key of the schema, in declaration order, with its type, default and help."""
    docs = {cls: field_docs(cls) for cls in {cls for _, _, cls in _fields(Config)}}
    return [Key(key, _type_name(f.type), _default(f), docs[cls][f.name])
            for key, f, cls in _fields(Config) if not dataclasses.is_dataclass(f.type)]


def sections() -> dict[str, str]:
    """Each section's dotted name and its help (the docstring of its field)."""
    return {key: field_docs(cls)[f.name]
            for key, f, cls in _fields(Config) if dataclasses.is_dataclass(f.type)}


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a `|` would end the cell, a `<` open an HTML tag."""
    return text.replace("|", "\\|").replace("<", "\\<")


def render_markdown() -> str:
    """docs/config-keys.md: one table per section, in the schema's order."""
    helps = sections()
    lines = ["# Config keys", "",
             f"Generated from the field docstrings of partrain/config/schema.py by "
             f"`{REGENERATE}`; do not edit by hand.", "",
             "Defaults are the schema's. The config groups under configs/ and a recipe set some "
             "keys to other values (configs/train/default.yaml sets the batch, for one); "
             "`partrain show [RECIPE]` prints a recipe's resolved values. Set a key with an "
             "override, `partrain launch RECIPE section.key=value`, or in a recipe's YAML."]
    current = None
    for row in key_table():
        section = row.key.rpartition(".")[0]
        if section != current:
            current = section
            title = f"`{section}`" if section else "Top level"
            lines += ["", f"## {title}", ""]
            if section:
                lines += [_cell(helps[section]), ""]
            lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines.append(f"| `{row.key}` | {row.type} | `{shown(row.default)}` | {_cell(row.help)} |")
    return "\n".join(lines) + "\n"


REGENERATE = "python -m partrain.config.keys > docs/config-keys.md"

if __name__ == "__main__":
    sys.stdout.write(render_markdown())

"""A DeepSpeed JSON file the user already has (`parallel.deepspeed_config=ds_config.json`), read
once when the config is composed, as HF Accelerate and the HF Trainer take one.

What the file says about things partrain's own keys decide (the ZeRO stage, offload, the batch,
precision, clipping, the optimizer and its schedule) becomes those keys (`FROM_FILE`): the file wins
over the recipe and the defaults; a key also given on the command line must agree, or it is a
conflict. `"auto"` means "partrain's value", as in Accelerate: for partrain's keys the value is
left to the config, for DeepSpeed's own tuning keys it is filled by the derived config
(partrain.config.deepspeed: bucket sizes by the hidden size, DeepSpeed's defaults for a
user's model). Everything else in the file goes on as
raw DeepSpeed keys (`parallel.deepspeed`, whose inline keys win over the file's), checked by the
same rules as inline ones. Every conflict is reported at once, each naming the key in the file and
in partrain's config.

The file is read as DeepSpeed reads a config path: Hjson (JSON with comments and trailing commas)
with a key given twice in one object refused. Each value partrain takes must be of its kind as
given: a whole number for counts (2.5 and true are not 2 and 1), true or false for a switch.

The run dir's config.yaml holds the result (the keys set, the raw section): workers and resumes
never read the file again, so it may live on the login node only.
"""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from partrain.config.deepspeed import FORBIDDEN, flatten_keys, harmless, merge_keys
from partrain.config.json_keys import KeyGivenTwice, once_each
from partrain.errors import ConfigError

AUTO = "auto"
MAX_BYTES = 1 << 20

# DeepSpeed's scheduler types (deepspeed.runtime.lr_schedules) and the partrain schedule each is.
SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def _optimizer_name(value, section: dict) -> str:
    """DeepSpeed's optimizer type as optim.name: its "Adam" is AdamW unless adam_w_mode is false
    (DeepSpeed's default is the decoupled weight decay)."""
    name = str(value).lower()
    if name == "adam" and (section.get("params") or {}).get("adam_w_mode", True) is not False:
        return "adamw"
    return name


def whole(value) -> int:
    """A count as the file gives it: an integer (4, or 4.0), not 2.5 and not true."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(value)
    return int(value)


def number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(value)
    return float(value)


def switch(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


def text(value) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


def offloaded(value) -> str:
    """ZeRO's old `cpu_offload: true` (DeepSpeed reads it as offload_optimizer.device=cpu)."""
    return "cpu" if switch(value) else "none"


# The file's key -> (partrain's key, the file's value as partrain's: a ValueError names the kind).
KINDS = {whole: "a whole number", number: "a number", switch: "true or false", text: "a string",
         offloaded: "true or false"}
FROM_FILE = {
    "zero_optimization.stage": ("parallel.zero_stage", whole),
    "zero_optimization.offload_optimizer.device": ("parallel.offload_optimizer", text),
    "zero_optimization.offload_param.device": ("parallel.offload_params", text),
    "zero_optimization.offload_optimizer.nvme_path": ("parallel.offload_nvme_path", text),
    "zero_optimization.offload_param.nvme_path": ("parallel.offload_nvme_path", text),
    "train_micro_batch_size_per_gpu": ("train.micro_batch_size", whole),
    "gradient_accumulation_steps": ("train.micro_batches", whole),
    "train_batch_size": ("train.global_batch_size", whole),
    "gradient_clipping": ("optim.grad_clip", number),
    "optimizer.params.lr": ("optim.lr", number),
    "optimizer.params.eps": ("optim.eps", number),
    "optimizer.params.weight_decay": ("optim.weight_decay", number),
    "optimizer.params.momentum": ("optim.momentum", number),
    "optimizer.params.nesterov": ("optim.nesterov", switch),
    "scheduler.params.warmup_max_lr": ("optim.lr", number),
    "scheduler.params.warmup_num_steps": ("optim.warmup_steps", whole),
    "scheduler.params.total_num_steps": ("train.max_steps", whole),
    "scheduler.params.cos_min_ratio": ("optim.min_lr_ratio", number),
    "zero_optimization.cpu_offload": ("parallel.offload_optimizer", offloaded),
}
# Sections that must be objects where partrain reads inside them.
OBJECTS = ("optimizer", "optimizer.params", "scheduler", "scheduler.params", "zero_optimization")


def read_deepspeed_json(path: Path) -> dict:
    """The file's JSON object, or a ConfigError naming the file and what is wrong."""
    shown = f"parallel.deepspeed_config={path}"
    try:
        if not path.is_file():
            from partrain.config.paths import what_is

            found = what_is(path)
            raise ConfigError(f"{shown}: " + ("no such file" if found == "does not exist" else
                                              f"it {found}, not a file")
                              + " (give the path of a DeepSpeed JSON config)")
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(f"{shown}: more than {MAX_BYTES:,} bytes, not a DeepSpeed config")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{shown} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{shown} is not UTF-8 text") from None
    import hjson

    if not text.strip():
        raise ConfigError(f"{shown} is empty; a DeepSpeed config is a JSON object ({{...}})")
    try:
        data = hjson.loads(text, object_pairs_hook=once_each)
    except (OverflowError, RecursionError) as e:  # 1e400 in its number parser; deep nesting
        raise ConfigError(f"{shown} cannot be read as JSON: "
                          + ("a number too large for any value" if isinstance(e, OverflowError)
                             else "nested too deep")) from None
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"{shown} is not valid JSON at line {e.lineno}, column {e.colno}: "
                          f"{e.msg}") from None
    except KeyGivenTwice as e:
        raise ConfigError(f"{shown} gives the key {e.args[0]!r} twice in one object (JSON keeps "
                          "the last silently; DeepSpeed refuses it): give it once") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{shown} holds a JSON {type(data).__name__}; a DeepSpeed config is an "
                          "object ({...})")
    return data


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def given_keys(overrides: list[str]) -> dict[str, str]:
    """The keys the command line sets, with the value text as given."""
    given = {}
    for text in overrides:
        key, sep, value = text.lstrip("+~").partition("=")
        if sep:
            given[key] = value
    return given


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return str(a) == str(b)


def _partrain_values(data: dict, flat: dict, cp: int) -> tuple[dict, list[str]]:
    """{partrain key: (value, the file's key)} for what the file fixes, and the problems of
    values that no partrain key can take."""
    found, problems = {}, []
    for section in OBJECTS:
        value = _at(data, section)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{section}={value!r} is not an object ({{...}})")
            data = _without(data, section)
            flat = {k: v for k, v in flat.items() if k != section}
    for section in ("optimizer", "scheduler"):
        kind = _at(data, f"{section}.type")
        if kind is not None and not isinstance(kind, str):
            problems.append(f"{section}.type={kind!r} is not a name (a string)")
            data = _without(data, f"{section}.type")

    def put(key, value, where):
        if key in found and not _same(found[key][0], value):
            problems.append(f"{where}={value!r} and {found[key][1]}={found[key][0]!r} both set "
                            f"{key}: make them agree")
        else:
            found.setdefault(key, (value, where))

    for where, value in flat.items():
        if value == AUTO or where not in FROM_FILE:
            continue
        key, kind = FROM_FILE[where]
        try:
            converted = kind(value)
        except ValueError:
            problems.append(f"{where}={value!r} is not {KINDS[kind]} (for {key})")
            continue
        if where == "train_batch_size" and cp > 1:
            # DeepSpeed counts a sequence once per rank of its dp x cp group.
            converted //= cp
        put(key, converted, where)
    optimizer = data.get("optimizer") or {}
    if "type" in optimizer and optimizer["type"] != AUTO:
        from partrain.config.validate_keys import OPTIMIZERS

        name = _optimizer_name(optimizer["type"], optimizer)
        if name in OPTIMIZERS:
            put("optim.name", name, "optimizer.type")
        else:
            problems.append(f"optimizer.type={optimizer['type']!r} has no partrain optimizer "
                            "(partrain runs AdamW, Adam and SGD, the same on every layout)")
    betas = flat.get("optimizer.params.betas")
    if betas not in (None, AUTO):
        try:
            if not (isinstance(betas, list) and len(betas) == 2):
                raise ValueError(betas)
            beta1, beta2 = number(betas[0]), number(betas[1])
        except ValueError:
            problems.append(f"optimizer.params.betas={betas!r} is not two numbers")
        else:
            put("optim.beta1", beta1, "optimizer.params.betas[0]")
            put("optim.beta2", beta2, "optimizer.params.betas[1]")
    for precision in ("bf16", "fp16"):
        enabled = flat.get(f"{precision}.enabled")
        if enabled is True:
            put("train.dtype", precision, f"{precision}.enabled")
    if (flat.get("bf16.enabled") is False and flat.get("fp16.enabled") is False
            and "train.dtype" not in found):
        put("train.dtype", "fp32", "bf16.enabled / fp16.enabled")
    scheduler = data.get("scheduler") or {}
    kind = scheduler.get("type")
    if kind not in (None, AUTO):
        if kind not in SCHEDULES:
            problems.append(f"scheduler.type={kind!r} has no partrain schedule (partrain reads "
                            f"{', '.join(SCHEDULES)}); drop the scheduler section to use "
                            "partrain's")
        else:
            put("optim.schedule", SCHEDULES[kind], "scheduler.type")
            if kind == "WarmupDecayLR":  # DeepSpeed's decays to warmup_min_lr, 0
                put("optim.min_lr_ratio", 0.0, "scheduler.type=WarmupDecayLR")
    if (scheduler.get("params") or {}).get("warmup_type") not in (None, AUTO, "linear"):
        problems.append(f"scheduler.params.warmup_type="
                        f"{scheduler['params']['warmup_type']!r}: partrain's warmup is linear; "
                        "set it to \"linear\" or drop it")
    for start in ("warmup_min_lr", "warmup_min_ratio"):
        low = (scheduler.get("params") or {}).get(start)
        if low not in (None, AUTO, 0, 0.0):
            problems.append(f"scheduler.params.{start}={low!r}: partrain's warmup starts at "
                            "optim.lr / optim.warmup_steps; set it to 0 or \"auto\"")
    return found, problems


def _at(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _without(data: dict, dotted: str) -> dict:
    """`data` less the section at `dotted` (one not of its kind, said once as a problem)."""
    *parents, leaf = dotted.split(".")
    out = dict(data)
    node = out
    for part in parents:
        node[part] = dict(node[part])
        node = node[part]
    node.pop(leaf, None)
    return out


def _raw_keys(flat: dict, derived: dict) -> tuple[dict, list[str]]:
    """The file's keys that stay DeepSpeed's own (what partrain's keys do not take), "auto"
    filled from the derived config, and the "auto"s nothing fills."""
    consumed = set(FROM_FILE) | {"optimizer.type", "optimizer.params.betas",
                                 "optimizer.params.adam_w_mode", "bf16.enabled", "fp16.enabled"}
    raw, problems = {}, []
    for where, value in flat.items():
        if where in consumed or where.startswith("scheduler") or (
                where == "optimizer.params" and value is None):  # null: no parameters given
            continue
        if value == AUTO:
            if where in derived:
                value = derived[where]
            else:
                problems.append(f"{where}=\"auto\": partrain has no value to fill it with; "
                                "give a value or drop the key")
                continue
        raw[where] = value
    return raw, problems


def apply_deepspeed_file(cfg: DictConfig, overrides: list[str]) -> None:
    """Read `parallel.deepspeed_config` into `cfg` in place (see the module docstring); nothing
    when it is unset. Raises one ConfigError listing every conflict."""
    path = cfg.parallel.get("deepspeed_config")
    if not path:
        return
    data = read_deepspeed_json(Path(path))
    flat = flatten_keys(data)
    found, problems = _partrain_values(data, flat, cfg.parallel.cp)
    given = given_keys(overrides)
    for key, (value, where) in found.items():
        if key in given and not _same(OmegaConf.select(cfg, key), value):
            problems.append(f"{where}={value!r} in the file contradicts {key}={given[key]} on "
                            "the command line: drop one, or make them agree")
    # "auto" tuning keys take the values the config without the file derives.
    stage = found.get("parallel.zero_stage", (cfg.parallel.zero_stage, None))[0]
    raw, unfilled = _raw_keys(flat, flatten_keys(_derivable(cfg, stage)))
    problems += unfilled
    nested = _nest(raw)
    problems += [f"{key}={nested[key]!r}: not allowed, {why}" for key, why in FORBIDDEN.items()
                 if key in nested and not harmless(key, nested[key])]
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"parallel.deepspeed_config={path}: {len(problems)} "
                          f"problem{'s' if len(problems) > 1 else ''} with partrain's config:\n"
                          f"{listed}")
    with open_dict(cfg):
        for key, (value, _) in found.items():
            OmegaConf.update(cfg, key, value, merge=False)
        _settle_batch(cfg.train, {k for k in found if k.startswith("train.")}, given)
        inline = OmegaConf.to_container(cfg.parallel.deepspeed) if cfg.parallel.deepspeed else {}
        cfg.parallel.deepspeed = merge_keys(_nest(raw), inline)


BATCH = ("global_batch_size", "micro_batch_size", "micro_batches")


def _settle_batch(train: DictConfig, from_file: set[str], given: dict) -> None:
    """Any two of the batch triple fix the third: where the file fixes some, a recipe's value
    that would over-determine the triple gives way (the file's and the command line's stay)."""
    if not any(f"train.{k}" in from_file for k in BATCH):
        return
    for key in BATCH:
        if sum(train[k] is not None for k in BATCH) <= 2:
            return
        if f"train.{key}" not in from_file and f"train.{key}" not in given:
            train[key] = None


def _derivable(cfg: DictConfig, stage: int) -> dict:
    """The derived DeepSpeed config at the file's ZeRO stage, as far as it does not need the
    resolved batch (the tuning keys "auto" fills: bucket sizes, ZeRO-3 thresholds)."""
    from partrain.config.deepspeed import derived_config

    probe = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(probe):
        for key in BATCH:
            probe.train[key] = probe.train[key] or 1
        probe.parallel.zero_stage = stage
    derived = derived_config(probe)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps"):
        derived.pop(key)
    return derived

"""The rules of each key on its own (its range, its choices) and of the sections whose keys are
checked among themselves only (data, optim, launcher), with the bounds and choices they hold to.
partrain.config.validate calls them in its fixed order, among the rules between sections.
"""

import math
import os
import re

from omegaconf import DictConfig, OmegaConf

from partrain.config.keys import SCHEMA_KEYS, float_keys, shown
from partrain.config.validate_layout import choice
from partrain.errors import ConfigError
from partrain.models.arith import RECOMPUTE_MODES, head_dim

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
DTYPES = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("auto", "spawn", "forkserver")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # train.float8_recipe (torchao's recipe names)
DATA_SOURCES = ("stdlib", "tokens")
DATA_SAMPLING = ("random", "epochs")
OPTIMIZERS = ("adamw", "adam", "sgd")
# Architectures a model.name may name that the built-in family is not (the label picks nothing).
OTHER_ARCHITECTURES = ("gpt2", "gpt-2", "gptj", "gpt-j", "gpt_neox", "gpt-neox", "bert", "t5",
                       "falcon", "bloom", "opt", "phi", "gemma", "mamba", "olmo", "deepseek")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
WANDB_MODES = ("off", "offline", "online")
ROPE_TYPES = ("default", "llama3")
# Bounds on what can exist, so that validation and `plan` cost the same for any input (the world
# size's, MAX_WORLD_SIZE, is resolve's): a node holds at most a few dozen GPUs.
MAX_NPROC_PER_NODE = 1024
INT64_MAX = (1 << 63) - 1  # every whole number of the config fits torch's and numpy's integers
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_LAYERS = 4096  # the largest published decoders have a few hundred blocks
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# Keys whose unset value is null: an empty one is a mistake, mostly an unset shell variable
# (`model.init_from=$CKPT`). Read as unset, it trained from scratch, the built-in model, or
# without the DeepSpeed file, and said nothing. (data.path's own check names it.)
NOT_EMPTY = {"model.init_from": "start from random weights", "model.target": "the built-in "
             "model.family", "parallel.deepspeed_config": "no DeepSpeed file",
             "parallel.offload_nvme_path": "no nvme path"}


def check_not_empty(cfg: DictConfig) -> None:
    for key, unset in NOT_EMPTY.items():
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{key}={value!r} is empty (an unset shell variable?): give a value, "
                              f"or leave the key out ({unset})")


def _value(cfg: DictConfig, key: str):
    section, name = key.split(".")
    return cfg[section][name]


def _positive(cfg: DictConfig, keys: list[str]) -> None:
    for key in keys:
        value = _value(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")


def _at_least_zero(cfg: DictConfig, keys: list[str]) -> None:
    # Written as `not value >= 0` so that NaN (a float key) fails too; every comparison below is.
    for key in keys:
        value = _value(cfg, key)
        if not value >= 0:
            raise ConfigError(f"{key}={value} must be >= 0")


def _in_range(cfg: DictConfig, key: str, low: float, high: float, shown: str) -> None:
    value = _value(cfg, key)
    if not low <= value < high:
        raise ConfigError(f"{key}={value} must be in {shown}")


def _finite(cfg: DictConfig) -> None:
    """Every float key is a finite number (NaN passes any `x <= 0` check, inf trains to NaN), and
    every whole number fits in 64 bits (torch's and numpy's integers)."""
    for key in float_keys():
        value = OmegaConf.select(cfg, key)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
    for key in SCHEMA_KEYS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise ConfigError(f"{key}={value} does not fit in 64 bits (at most {INT64_MAX})")


def check_name(name) -> None:
    """The run's name, which names its run dir and SLURM job."""
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
        raise ConfigError(
            f"name={name!r} must be a plain name of letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit): it names the run dir under runs/ "
            "and the SLURM job")


def check_each_key(cfg: DictConfig) -> None:
    """Each key on its own, across the sections: finite and whole, in its range, one of its
    choices (and the rope factors in order)."""
    _finite(cfg)
    _positive(cfg, ["parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
                    "parallel.pp_virtual_stages",
                    "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.dim",
                    "model.head_dim",
                    "model.vocab_size", "model.max_seq_len", "train.seq_len", "train.max_steps",
                    "train.global_batch_size", "train.micro_batch_size", "train.micro_batches",
                    "train.log_every", "train.eval_batches", "train.max_skipped_steps",
                    "train.profile_steps",
                    "model.multiple_of",
                    "model.ffn_dim", "data.stdlib_max_bytes", "checkpoint.keep",
                    "model.rope_original_max_seq_len"])
    if cfg.model.n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers={cfg.model.n_layers} exceeds {MAX_LAYERS}, the most "
                          "partrain builds or plans (published decoders have a few hundred)")
    _at_least_zero(cfg, ["train.seed", "train.eval_every", "train.profile_start",
                         "optim.warmup_steps",
                         "optim.weight_decay", "checkpoint.every"])
    _in_range(cfg, "optim.beta1", 0.0, 1.0, "[0, 1)")
    _in_range(cfg, "optim.beta2", 0.0, 1.0, "[0, 1)")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    for key in ("model.rope_theta", "model.norm_eps", "optim.eps", "model.init_std",
                "model.rope_factor", "model.rope_low_freq_factor"):
        if not _value(cfg, key) > 0:
            raise ConfigError(f"{key}={_value(cfg, key)} must be positive")
    choice("parallel.pp_schedule", cfg.parallel.pp_schedule, PP_SCHEDULES)
    choice("train.dtype", cfg.train.dtype, DTYPES)
    choice("train.activation_checkpointing", cfg.train.activation_checkpointing,
            RECOMPUTE_MODES)
    choice("launcher.device", cfg.launcher.device, DEVICES)
    if cfg.launcher.start_method == "fork":
        raise ConfigError("launcher.start_method=fork is not offered: the launcher runs the "
                          "elastic agent's threads, and a fork of a threaded process can hang; "
                          "forkserver forks the ranks from a clean single-threaded process "
                          "(launcher.start_method=forkserver)")
    choice("launcher.start_method", cfg.launcher.start_method, START_METHODS)
    choice("data.source", cfg.data.source, DATA_SOURCES)
    choice("optim.name", cfg.optim.name, OPTIMIZERS)
    choice("optim.schedule", cfg.optim.schedule, LR_SCHEDULES)
    choice("train.wandb", cfg.train.wandb, WANDB_MODES)
    choice("train.float8_recipe", cfg.train.float8_recipe, FLOAT8_RECIPES)
    choice("model.rope_type", cfg.model.rope_type, ROPE_TYPES)
    t = cfg.train
    if t.profile_start and t.profile_start + t.profile_steps - 1 > t.max_steps:
        raise ConfigError(
            f"train.profile_start={t.profile_start} with train.profile_steps={t.profile_steps} "
            f"ends after train.max_steps={t.max_steps}: the profiled steps must all be run")
    m = cfg.model
    if not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be "
                          f"above model.rope_low_freq_factor={m.rope_low_freq_factor}")


def check_model_shape(m: DictConfig) -> None:
    """The attention heads fit the hidden size: kv heads group the query heads, and each head's
    width (model.head_dim, or dim / n_heads) is even for the rotary embeddings, which turn pairs
    of a head's elements."""
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    # With model.head_dim the heads have their own width (q/k/v project dim to heads x head_dim).
    if m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} (or set "
                          "model.head_dim)")
    width = head_dim(m)
    if width % 2:
        key = "model.head_dim=" if m.head_dim is not None else "model.dim / model.n_heads = "
        raise ConfigError(f"{key}{width} must be even (rotary embeddings)")


def check_data(d: DictConfig) -> None:
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be between 0 and 1")
    choice("data.sampling", d.sampling, DATA_SAMPLING)
    if d.blend is None:
        return
    # The dirs themselves (they exist, are token dirs, share a tokenizer) are checked with the
    # data, before a start (partrain/data/sampler.py check_sources); `plan` needs none.
    if len(d.blend) == 0:
        raise ConfigError("data.blend=[] names no source; give at least one {path: DIR, weight: "
                          "W}, or leave data.blend null for data.path alone")
    if d.path:
        raise ConfigError(f"data.path={d.path} and data.blend both name the training data; give "
                          "one: the blend's dirs (add this dir to it), or data.path alone")
    for i, entry in enumerate(d.blend):
        if not entry.path:
            raise ConfigError(f"data.blend[{i}].path={shown(entry.path)} names no token dir; each "
                              "source is {path: DIR, weight: W}")
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            raise ConfigError(f"data.blend[{i}].weight={entry.weight} must be a positive finite "
                              f"number (the share of samples from {entry.path}, relative to the "
                              "other sources' weights)")
    seen = {}
    for i, entry in enumerate(d.blend):
        # The same dir twice (as typed, or through `..` or a link): one source counted as two
        # (data prepare refuses an input given twice).
        where = os.path.realpath(entry.path)
        if where in seen:
            j = seen[where]
            raise ConfigError(f"data.blend[{j}].path={shown(d.blend[j].path)} and data.blend[{i}]"
                              f".path={shown(entry.path)} are one token dir: give it once, with "
                              "the sum of its weights")
        seen[where] = i
    if not math.isfinite(sum(entry.weight for entry in d.blend)):
        raise ConfigError(f"data.blend's weights sum to infinity "
                          f"({', '.join(str(e.weight) for e in d.blend)}); they are relative "
                          "shares: scale them down")


def check_optim(o: DictConfig, max_steps: int) -> None:
    if not o.lr > 0:
        raise ConfigError(f"optim.lr={o.lr} must be positive")
    if not o.grad_clip >= 0:
        raise ConfigError(f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables it)")
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError(f"optim.momentum={o.momentum} must be in [0, 1) (0: plain SGD)")
    if o.nesterov and not (o.name == "sgd" and o.momentum > 0):
        raise ConfigError(f"optim.nesterov=true needs optim.name=sgd with optim.momentum > 0 "
                          f"(got optim.name={o.name}, optim.momentum={o.momentum})")
    if not 0.0 < o.decay_ratio <= 1.0:
        raise ConfigError(f"optim.decay_ratio={o.decay_ratio} must be in (0, 1] (the fraction of "
                          "train.max_steps the wsd schedule decays over; optim.schedule=constant "
                          "has no decay)")
    decay = o.decay_ratio * max_steps
    if o.schedule == "wsd" and o.warmup_steps + decay > max_steps:
        raise ConfigError(
            f"optim.schedule=wsd decays over the last optim.decay_ratio({o.decay_ratio}) * "
            f"train.max_steps({max_steps}) = {decay:g} steps, which reach into the "
            f"optim.warmup_steps={o.warmup_steps}: warmup + decay must be at most max_steps "
            "(lower optim.warmup_steps or optim.decay_ratio, or raise train.max_steps)")


MAX_RESTARTS = 1000


def check_launcher(launcher: DictConfig) -> None:
    if not 0 <= launcher.max_restarts <= MAX_RESTARTS:
        raise ConfigError(f"launcher.max_restarts={launcher.max_restarts} must be in "
                          f"0..{MAX_RESTARTS}")
    for key in ("collective_timeout_s", "rdzv_timeout_s"):
        if launcher[key] < 1:
            raise ConfigError(f"launcher.{key}={launcher[key]} must be at least 1")
        if launcher[key] > MAX_TIMEOUT_S:
            raise ConfigError(f"launcher.{key}={launcher[key]} must be at most {MAX_TIMEOUT_S} "
                              "seconds (a week)")
    hang = launcher.hang_timeout_s
    if hang is not None:
        if hang < 0:
            raise ConfigError(f"launcher.hang_timeout_s={hang} must be >= 0 (0 turns the hang "
                              "watch off; null = a third of launcher.collective_timeout_s)")
        if hang and 2 * hang >= launcher.collective_timeout_s:
            raise ConfigError(
                f"launcher.hang_timeout_s={hang} must be below half of "
                f"launcher.collective_timeout_s={launcher.collective_timeout_s}: the first step "
                f"may take 2 x {hang} s, and a collective that times out first ends the ranks "
                "with an error that names no one; raise launcher.collective_timeout_s, or leave "
                "hang_timeout_s null (a third of it)")
    for line in launcher.setup:
        if not isinstance(line, str) or not line.strip():
            raise ConfigError(f"launcher.setup has {line!r}: each entry must be a shell line, "
                              "e.g. 'module load cuda/12.4'")
        if any(ord(c) < 32 or ord(c) == 127 for c in line):
            raise ConfigError(f"launcher.setup has {line!r}, which contains a control character "
                              "(newline, tab, ...): give one shell line per entry")

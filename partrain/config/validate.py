"""Every rule a config must meet, checked before any process starts.

`resolve_and_validate` fills in what the config leaves open (dp=auto, the third of the batch
triple: partrain.config.resolve) and raises ConfigError with a message naming the keys, the values
and the rule. Warnings (allowed but probably not what the user wants) come back as strings.

The rules run in one fixed order, one function per part of the config, and the first broken one
is the one reported: each key alone first (ranges, choices), then the rules between keys, section
by section, as they become decidable (the world's product once dp is known, the pipeline's
micro-batch rules once the batch is). The layout's rules are validate_layout.py's, a mixture of
experts' validate_moe.py's.
"""

import math
import os
import re

from omegaconf import DictConfig, OmegaConf, open_dict

from partrain.config.keys import SCHEMA_KEYS, float_keys, shown
from partrain.config.resolve import World, resolve_batch, resolve_dp
from partrain.config.validate_layout import (
    check_cp,
    check_fsdp_shards,
    check_hsdp,
    check_micro_batches,
    check_pipeline,
    check_seq_len,
    check_tp,
    check_world,
    check_zero,
    choice,
)
from partrain.config.validate_moe import check_moe
from partrain.errors import ConfigError
from partrain.models.arith import RECOMPUTE_MODES, head_dim
from partrain.models.family import check_user_model
from partrain.models.llama_hf import MODEL_TYPES as HF_MODEL_TYPES

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


def check_startable(world: World) -> None:
    """What `launch` and `slurm` start on one node (`plan` and `show` may go larger)."""
    if world.nproc_per_node > MAX_NPROC_PER_NODE:
        raise ConfigError(
            f"{world.nproc_per_node:,} ranks per node (from {world.nproc_from}) exceed "
            f"{MAX_NPROC_PER_NODE}, the most partrain starts on one node; use more nodes "
            "(--nnodes) or smaller degrees")


# Keys whose unset value is null: an empty one is a mistake, mostly an unset shell variable
# (`model.init_from=$CKPT`). Read as unset, it trained from scratch, the built-in model, or
# without the DeepSpeed file, and said nothing. (data.path's own check names it.)
NOT_EMPTY = {"model.init_from": "start from random weights", "model.target": "the built-in "
             "model.family", "parallel.deepspeed_config": "no DeepSpeed file",
             "parallel.offload_nvme_path": "no nvme path"}


def _check_not_empty(cfg: DictConfig) -> None:
    for key, unset in NOT_EMPTY.items():
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{key}={value!r} is empty (an unset shell variable?): give a value, "
                              f"or leave the key out ({unset})")


def resolve_and_validate(cfg: DictConfig, world: World, resplit: bool = False) -> list[str]:
    """Fill in dp and the batch triple in place; raise ConfigError on the first broken rule.
    `resplit`: a resume's micro-batch split is derived again (resolve_batch)."""
    p, t = cfg.parallel, cfg.train
    _check_name(cfg.name)
    _check_not_empty(cfg)
    _check_each_key(cfg)
    check_zero(cfg)
    # A user's own model (model.target) declares what it can do; the shape rules are Llama's.
    user = check_user_model(cfg)
    if user is None:
        _check_model_shape(cfg.model)
        _check_model_family(cfg)
        check_tp(p, cfg.model)
    check_pipeline(p, cfg.model if user is None else OmegaConf.create({"n_layers": user.blocks}))
    dp = resolve_dp(p, world)
    check_world(p, dp, world)
    check_hsdp(p, dp)
    check_fsdp_shards(cfg, dp)
    g, b, mb = resolve_batch(t, dp, resplit)
    check_micro_batches(p, mb)
    if user is None:
        check_cp(cfg)
        check_moe(cfg, dp)
    check_seq_len(cfg)
    _check_float8(cfg, b)
    # Single-key rules that have always come last: moving them up would change which error a
    # config with two faults reports.
    _check_data(cfg.data)
    _check_optim(cfg.optim, t.max_steps)
    _check_launcher(cfg.launcher)

    with open_dict(cfg):
        p.dp = dp
        t.global_batch_size, t.micro_batch_size, t.micro_batches = g, b, mb
        if cfg.data.blend is not None:  # a blend reads token dirs, whatever data= chose
            cfg.data.source = "tokens"
        cfg.launcher.nnodes, cfg.launcher.nproc_per_node = world.nnodes, world.nproc_per_node
    if p.zero_stage > 0 and p.zero_backend == "deepspeed":
        from partrain.config.deepspeed import deepspeed_config

        derived = deepspeed_config(cfg)  # raises on a raw key that contradicts a derived one
        if p.get("deepspeed"):
            from partrain.config.ds_keys import check_optimizer_params, check_top_level

            check_top_level(derived)
            check_optimizer_params(derived)
            check_raw_deepspeed(derived)
    return _warnings(cfg, world)


# DeepSpeed's config models, by the section of its JSON each reads (their errors name fields
# inside the section).
DS_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
               "DeepSpeedFP16Config": "fp16", "DeepSpeedActivationCheckpointingConfig":
               "activation_checkpointing", "DeepSpeedFlopsProfilerConfig": "flops_profiler",
               "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
               "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
               "DeepSpeedMonitorConfig": "monitor", "CommsConfig": "comms_logger"}


def check_raw_deepspeed(derived: dict) -> None:
    """The whole DeepSpeed JSON, raw keys (parallel.deepspeed, a deepspeed_config file's
    section) included, read by DeepSpeed's own config models before anything starts: a value of
    the wrong type or an unknown key inside a section (`reduce_bucket_size=abc`) passed every
    check and failed inside the ranks with exit 1. Only with raw keys given: DeepSpeed's import
    costs about a second."""
    import contextlib
    import io
    import logging
    import sys

    import pydantic

    # Its batch check counts this process's world (one): the batch keys are partrain's, checked
    # by its own rules, so they are left to DeepSpeed's defaults here.
    batchless = {k: v for k, v in derived.items()
                 if k not in ("train_batch_size", "gradient_accumulation_steps")}
    # DeepSpeed's logger writes to stdout (its accelerator, as it is imported): not in the
    # output of `partrain show`, or anywhere a check says nothing
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet):
            from deepspeed.runtime.config import DeepSpeedConfig

            DeepSpeedConfig(batchless)
    except pydantic.ValidationError as e:
        section = DS_SECTIONS.get(e.title)
        found = []
        for error in e.errors():
            key = ".".join(str(part) for part in (section, *error["loc"]) if part is not None)
            found.append(f"{key}={error.get('input')!r}: {error['msg']}")
        raise ConfigError(f"parallel.deepspeed: DeepSpeed's config refuses "
                          f"{'; '.join(found)} (parallel.deepspeed.KEY sets DeepSpeed's "
                          "own keys, as DeepSpeed reads them)") from None
    finally:
        from deepspeed.utils.logging import logger as ds_logger

        for handler in ds_logger.handlers:  # made during the import: give it the process's
            if isinstance(handler, logging.StreamHandler) and handler.stream is quiet:
                handler.setStream(sys.__stdout__)


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


def _check_name(name) -> None:
    """The run's name, which names its run dir and SLURM job."""
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
        raise ConfigError(
            f"name={name!r} must be a plain name of letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit): it names the run dir under runs/ "
            "and the SLURM job")


def _check_each_key(cfg: DictConfig) -> None:
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


def _check_model_shape(m: DictConfig) -> None:
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


def _check_model_family(cfg: DictConfig) -> None:
    """What a Hugging Face family needs: its q/k/v bias and q/k norm keys, and a sliding window
    that never cuts (partrain's attention sees every earlier position: a window is honoured
    only where no sequence is longer than it)."""
    m, p = cfg.model, cfg.parallel
    if m.hf_model_type is not None:
        choice("model.hf_model_type", m.hf_model_type, HF_MODEL_TYPES)
        want = {"qwen2": (True, False), "qwen3": (False, True)}.get(m.hf_model_type,
                                                                     (False, False))
        if (m.qkv_bias, m.qk_norm) != want:
            raise ConfigError(
                f"model.hf_model_type={m.hf_model_type} has model.qkv_bias={shown(want[0])} and "
                f"model.qk_norm={shown(want[1])}, not {shown(m.qkv_bias)} and {shown(m.qk_norm)}")
    if m.sliding_window is not None:
        if m.sliding_window < 1:
            raise ConfigError(f"model.sliding_window={m.sliding_window} must be at least 1 "
                              "(or null: no window)")
        for key, value in (("train.seq_len", cfg.train.seq_len),
                           ("model.max_seq_len", m.max_seq_len)):
            if value > m.sliding_window:
                raise ConfigError(
                    f"model.sliding_window={m.sliding_window} < {key}={value}: partrain attends "
                    "to every earlier position, which is the sliding window's result only where "
                    f"no sequence is longer than the window; set {key} <= {m.sliding_window}"
                    + (" (sample generates up to model.max_seq_len)"
                       if key == "model.max_seq_len" else ""))
    if m.qkv_bias and p.tp > 1 and p.zero_backend == "fsdp" and p.zero_stage > 0:
        raise ConfigError(
            f"model.qkv_bias=true with parallel.tp={p.tp} and parallel.zero_backend=fsdp: FSDP2 "
            "cannot split the tp-split q/k/v biases (1-D) again; use parallel.zero_backend="
            "deepspeed, or parallel.tp=1")


def _check_float8(cfg: DictConfig, micro_batch_size: int) -> None:
    """train.float8: refused up front where it cannot run (a CPU run without emulation), on the
    layouts it is not wired into (partrain's own tp linears; DeepSpeed's ZeRO), and where the
    FP8 weight-gradient matmul cannot take the tokens (its inner size, the tokens of a
    micro-batch on a rank, must be a multiple of 16)."""
    t, p = cfg.train, cfg.parallel
    if not t.float8:
        return
    tokens = micro_batch_size * t.seq_len // p.cp
    if tokens % 16:
        raise ConfigError(
            f"train.float8=true with {micro_batch_size} x {t.seq_len} tokens per micro-batch"
            f"{f' over parallel.cp={p.cp}' if p.cp > 1 else ''}: {tokens} tokens on a rank, "
            "but FP8 matmuls need a multiple of 16 (change train.micro_batch_size or "
            "train.seq_len)")
    if cfg.launcher.device == "cpu" and not t.float8_emulate:
        raise ConfigError(
            "train.float8=true with launcher.device=cpu: FP8 matmuls need GPUs of compute "
            "capability 8.9+ (H100, H200, L40S); train.float8_emulate=true emulates them, for "
            "tests only")
    if p.tp > 1:
        raise ConfigError(
            f"train.float8=true with parallel.tp={p.tp}: FP8 is not wired into partrain's "
            "tensor-parallel linears yet; use tp=1 (dp, FSDP2, pp, cp)")
    if p.zero_stage > 0 and p.zero_backend == "deepspeed":
        raise ConfigError(
            f"train.float8=true with parallel.zero_stage={p.zero_stage} on DeepSpeed: its engine "
            "does not take torchao's FP8 layers; use parallel.zero_backend=fsdp")


def _check_data(d: DictConfig) -> None:
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


def _check_optim(o: DictConfig, max_steps: int) -> None:
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


def _check_launcher(launcher: DictConfig) -> None:
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


def _warnings(cfg: DictConfig, world: World) -> list[str]:
    """What is allowed but probably not meant, on the resolved config."""
    p = cfg.parallel
    warnings = []
    if p.zero_stage > 0 and p.dp == 1:
        warnings.append(f"parallel.zero_stage={p.zero_stage} with dp=1 shards over one rank: "
                        "nothing is saved")
    if cfg.model.target is None and cfg.model.name in OTHER_ARCHITECTURES:
        warnings.append(
            f"model.name={cfg.model.name} is a label only: the model trained is "
            f"model.family={cfg.model.family}; to train your own {cfg.model.name} give its "
            "builder as model.target=package.module:function (docs/models.md)")
    if cfg.train.float8_emulate and not cfg.train.float8:
        warnings.append("train.float8_emulate=true has no effect without train.float8=true")
    if p.sequence_parallel and p.tp == 1:
        warnings.append("parallel.sequence_parallel=true has no effect with parallel.tp=1")
    if cfg.launcher.device != "cpu" and p.tp > world.nproc_per_node:
        warnings.append(
            f"parallel.tp={p.tp} is larger than the {world.nproc_per_node} GPUs per node: "
            "tensor-parallel all-reduces will cross nodes, which is slow"
        )
    o, t = cfg.optim, cfg.train
    if o.warmup_steps > t.max_steps:  # a short test run of a recipe, most often: allowed
        warnings.append(f"optim.warmup_steps={o.warmup_steps} > train.max_steps={t.max_steps}: "
                        f"the learning rate never reaches optim.lr={o.lr:g} (it ends at "
                        f"{o.lr * t.max_steps / o.warmup_steps:.3g})")
    if p.offload_nvme_path and "nvme" not in (p.offload_optimizer, p.offload_params):
        warnings.append(f"parallel.offload_nvme_path={p.offload_nvme_path} has no effect: "
                        "nothing is offloaded to nvme (parallel.offload_optimizer / "
                        "offload_params=nvme)")
    return warnings

"""Every rule a config must meet, checked before any process starts.

`resolve_and_validate` fills in what the config leaves open (dp=auto, the third of the batch
triple: partrain.config.resolve) and raises ConfigError with a message naming the keys, the values
and the rule. Warnings (allowed but probably not what the user wants) come back as strings.

The rules run in one fixed order, one function per part of the config, and the first broken one
is the one reported: each key alone first (ranges, choices), then the rules between keys, section
by section, as they become decidable (the world's product once dp is known, the pipeline's
micro-batch rules once the batch is). Each key's own rules, and the data, optim and launcher
sections', are validate_keys.py's; the layout's validate_layout.py's, a mixture of experts'
validate_moe.py's.
"""

from omegaconf import DictConfig, OmegaConf, open_dict

from partrain.config.keys import shown
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
from partrain.config.validate_keys import (
    MAX_NPROC_PER_NODE,
    OTHER_ARCHITECTURES,
    check_data,
    check_each_key,
    check_launcher,
    check_model_shape,
    check_name,
    check_not_empty,
    check_optim,
)
from partrain.config.validate_moe import check_moe
from partrain.errors import ConfigError
from partrain.models.family import check_user_model
from partrain.models.llama_hf import MODEL_TYPES as HF_MODEL_TYPES


def check_startable(world: World) -> None:
    """What `launch` and `slurm` start on one node (`plan` and `show` may go larger)."""
    if world.nproc_per_node > MAX_NPROC_PER_NODE:
        raise ConfigError(
            f"{world.nproc_per_node:,} ranks per node (from {world.nproc_from}) exceed "
            f"{MAX_NPROC_PER_NODE}, the most partrain starts on one node; use more nodes "
            "(--nnodes) or smaller degrees")


def resolve_and_validate(cfg: DictConfig, world: World, resplit: bool = False) -> list[str]:
    """Fill in dp and the batch triple in place; raise ConfigError on the first broken rule.
    `resplit`: a resume's micro-batch split is derived again (resolve_batch)."""
    p, t = cfg.parallel, cfg.train
    check_name(cfg.name)
    check_not_empty(cfg)
    check_each_key(cfg)
    check_zero(cfg)
    # A user's own model (model.target) declares what it can do; the shape rules are Llama's.
    user = check_user_model(cfg)
    if user is None:
        check_model_shape(cfg.model)
        _check_model_family(cfg)
        check_tp(p, cfg.model)
    check_pipeline(p, cfg.model if user is None else OmegaConf.create({"n_layers": user.blocks}))
    dp = resolve_dp(p, world)
    check_world(p, dp, world)
    check_hsdp(p, dp)
    check_fsdp_shards(cfg, dp, user)
    try:
        g, b, mb = resolve_batch(t, dp, resplit)
    except ConfigError as e:
        # A resume reads no file: its recorded keys are partrain's now (the message as it is)
        raise (None if resplit else _batch_of_the_file(cfg, dp)) or e from None
    check_micro_batches(p, mb)
    if user is None:
        check_cp(cfg)
        check_moe(cfg, dp)
    check_seq_len(cfg)
    _check_float8(cfg, b)
    # Single-key rules that have always come last: moving them up would change which error a
    # config with two faults reports.
    check_data(cfg.data)
    check_optim(cfg.optim, t.max_steps)
    check_launcher(cfg.launcher)

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


# A DeepSpeed file's batch keys, and the partrain key each sets (config/ds_file.py FROM_FILE)
FILE_BATCH = {"train_batch_size": "global_batch_size",
              "train_micro_batch_size_per_gpu": "micro_batch_size",
              "gradient_accumulation_steps": "micro_batches"}


def _batch_of_the_file(cfg: DictConfig, dp: int) -> ConfigError | None:
    """A batch that does not add up because of a DeepSpeed file's own three batch keys, said in
    the file's names ("set one of the three to null" cannot be followed: the file's value wins
    over a null on the command line); None where the file leaves one to partrain ("auto", or
    not given) or cannot be read again."""
    path = cfg.parallel.get("deepspeed_config")
    if not path:
        return None
    from pathlib import Path

    from partrain.config.ds_file import read_deepspeed_json

    try:
        data = read_deepspeed_json(Path(path))
    except ConfigError:
        return None
    given = {k: v for k, v in data.items() if k in FILE_BATCH and v != "auto"}
    if len(given) < len(FILE_BATCH):  # a value of the command line or the recipe takes part:
        return None  # partrain's message names it
    cp = cfg.parallel.cp
    values = ", ".join(f"{k}={v}" for k, v in given.items())
    return ConfigError(
        f"parallel.deepspeed_config={path}: its batch does not add up at dp={dp}"
        + (f" x cp={cp}" if cp > 1 else "") + f" ({values}): DeepSpeed's rule is "
        "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp"
        + (" x cp" if cp > 1 else "") + "; fix the file, or set one of its three to \"auto\" "
        "(partrain derives it)")


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
    except Exception as e:  # noqa: BLE001 - its own error, and asserts on removed keys
        # (DeepSpeedConfigError for a section it has removed, `amp`, `elasticity`; an
        # AssertionError for a deprecated key beside its replacement; a TypeError or ValueError
        # for a value its parsers cannot take): said as it says it, as a refusal of the config
        said = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"parallel.deepspeed: DeepSpeed's config refuses it: {said} "
                          "(parallel.deepspeed.KEY and a deepspeed_config file's keys are "
                          "DeepSpeed's own, read as DeepSpeed reads them)") from None
    finally:
        from deepspeed.utils.logging import logger as ds_logger

        for handler in ds_logger.handlers:  # made during the import: give it the process's
            if isinstance(handler, logging.StreamHandler) and handler.stream is quiet:
                handler.setStream(sys.__stdout__)


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

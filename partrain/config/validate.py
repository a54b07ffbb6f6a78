"""Every rule a config must meet, checked before any process starts.

`resolve_and_validate` fills in what the config leaves open (dp=auto, the third of the batch
triple: partrain.config.resolve) and raises ConfigError with a message naming the keys, the values
and the rule. Warnings (allowed but probably not what the user wants) come back as strings.

The rules run in one fixed order, one function per part of the config, and the first broken one
is the one reported: each key alone first (ranges, choices), then the rules between keys, section
by section, as they become decidable (the world's product once dp is known, the pipeline's
micro-batch rules once the batch is).
"""

import math
import re

from omegaconf import DictConfig, OmegaConf, open_dict

from partrain.config.keys import SCHEMA_KEYS, divisors, float_keys, shown
from partrain.config.resolve import (
    World,
    degrees_product,
    resolve_batch,
    resolve_dp,
)
from partrain.config.validate_moe import check_moe
from partrain.errors import ConfigError
from partrain.models.arith import RECOMPUTE_MODES, ffn_dim, head_dim
from partrain.models.family import check_user_model
from partrain.models.llama_hf import MODEL_TYPES as HF_MODEL_TYPES

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CP_METHODS = ("ring", "all_to_all")
DTYPES = ("auto", "fp32", "bf16", "fp16")
ZERO_BACKENDS = ("deepspeed", "fsdp")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DEVICES = ("auto", "cpu", "cuda")
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
MAX_PIPELINE_CHUNKS = 1024  # pp * pp_virtual_stages: real pipelines have tens of stages
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


def resolve_and_validate(cfg: DictConfig, world: World) -> list[str]:
    """Fill in dp and the batch triple in place; raise ConfigError on the first broken rule."""
    p, t = cfg.parallel, cfg.train
    _check_name(cfg.name)
    _check_each_key(cfg)
    _check_zero(cfg)
    # A user's own model (model.target) declares what it can do; the shape rules are Llama's.
    user = check_user_model(cfg)
    if user is None:
        _check_model_shape(cfg.model)
        _check_model_family(cfg)
        _check_tp(p, cfg.model)
    _check_pipeline(p, cfg.model if user is None else OmegaConf.create({"n_layers": user.blocks}))
    dp = resolve_dp(p, world)
    _check_world(p, dp, world)
    _check_hsdp(p, dp)
    g, b, mb = resolve_batch(t, dp)
    _check_micro_batches(p, mb)
    if user is None:
        _check_cp(cfg)
        check_moe(cfg, dp)
    _check_seq_len(cfg)
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

        deepspeed_config(cfg)  # raises on a raw key that contradicts a derived one
    return _warnings(cfg, world)


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


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={shown(value)} is not one of: {', '.join(allowed)}")


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
                    "model.multiple_of",
                    "model.ffn_dim", "data.stdlib_max_bytes", "checkpoint.keep",
                    "model.rope_original_max_seq_len"])
    if cfg.model.n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers={cfg.model.n_layers} exceeds {MAX_LAYERS}, the most "
                          "partrain builds or plans (published decoders have a few hundred)")
    _at_least_zero(cfg, ["train.seed", "train.eval_every", "optim.warmup_steps",
                         "optim.weight_decay", "checkpoint.every"])
    _in_range(cfg, "optim.beta1", 0.0, 1.0, "[0, 1)")
    _in_range(cfg, "optim.beta2", 0.0, 1.0, "[0, 1)")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    for key in ("model.rope_theta", "model.norm_eps", "optim.eps", "model.init_std",
                "model.rope_factor", "model.rope_low_freq_factor"):
        if not _value(cfg, key) > 0:
            raise ConfigError(f"{key}={_value(cfg, key)} must be positive")
    _choice("parallel.pp_schedule", cfg.parallel.pp_schedule, PP_SCHEDULES)
    _choice("train.dtype", cfg.train.dtype, DTYPES)
    _choice("train.activation_checkpointing", cfg.train.activation_checkpointing,
            RECOMPUTE_MODES)
    _choice("launcher.device", cfg.launcher.device, DEVICES)
    _choice("data.source", cfg.data.source, DATA_SOURCES)
    _choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _choice("optim.schedule", cfg.optim.schedule, LR_SCHEDULES)
    _choice("train.wandb", cfg.train.wandb, WANDB_MODES)
    _choice("model.rope_type", cfg.model.rope_type, ROPE_TYPES)
    m = cfg.model
    if not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be "
                          f"above model.rope_low_freq_factor={m.rope_low_freq_factor}")


def _check_zero(cfg: DictConfig) -> None:
    """ZeRO's rules: the stage, which stages compose with what, offload targets, fp16."""
    p, stage = cfg.parallel, cfg.parallel.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={stage} must be 0 (DDP), 1, 2 or 3")
    _choice("parallel.offload_optimizer", p.offload_optimizer, OFFLOAD_DEVICES)
    _choice("parallel.offload_params", p.offload_params, OFFLOAD_DEVICES)
    _choice("parallel.zero_backend", p.zero_backend, ZERO_BACKENDS)
    if p.zero_backend == "fsdp":
        _check_fsdp(cfg)
        return
    if stage >= 2 and p.pp > 1:
        raise ConfigError(
            f"parallel.zero_stage={stage} with parallel.pp={p.pp}: ZeRO-2/3 shard gradients "
            "(and parameters) as each micro-batch's backward runs, which fights the pipeline's "
            "gradient accumulation over micro-batches (DeepSpeed refuses it too); use "
            "parallel.zero_stage=1 with pp, or pp=1")
    if stage >= 2 and p.sequence_parallel and p.tp > 1:
        raise ConfigError(
            f"parallel.zero_stage={stage} with parallel.sequence_parallel=true: the norm "
            "gradients that sequence parallelism sums over tp are sharded away during backward "
            "at stage 2/3; use parallel.zero_stage=1, or sequence_parallel=false")
    if p.offload_optimizer != "none" and stage == 0:
        raise ConfigError(
            f"parallel.offload_optimizer={p.offload_optimizer} needs parallel.zero_stage >= 1 "
            "(ZeRO-Offload moves the sharded optimizer state)")
    if p.offload_params != "none" and stage != 3:
        raise ConfigError(
            f"parallel.offload_params={p.offload_params} needs parallel.zero_stage=3 (only "
            f"stage 3 shards parameters; got zero_stage={stage})")
    if "nvme" in (p.offload_optimizer, p.offload_params) and not p.offload_nvme_path:
        raise ConfigError(
            "offload to nvme needs parallel.offload_nvme_path (a directory on a local NVMe drive)")
    if cfg.train.dtype == "fp16" and stage == 0:
        raise ConfigError(
            "train.dtype=fp16 needs loss scaling, which partrain does through DeepSpeed: use "
            "parallel.zero_stage >= 1, or train.dtype=bf16")
    if stage == 0 and p.get("deepspeed_config"):
        raise ConfigError(
            f"parallel.deepspeed_config={p.deepspeed_config} is a DeepSpeed config, but "
            "parallel.zero_stage=0 runs DDP, not DeepSpeed; set zero_optimization.stage in the "
            "file (or parallel.zero_stage) to 1, 2 or 3")
    if stage == 0 and p.get("deepspeed"):
        raise ConfigError(
            "parallel.deepspeed sets raw DeepSpeed keys, but parallel.zero_stage=0 runs DDP, not "
            "DeepSpeed; set parallel.zero_stage to 1, 2 or 3")


def _check_hsdp(p: DictConfig, dp: int) -> None:
    """parallel.dp_replicate: HSDP's replicas of a sharded copy, FSDP's only."""
    r = p.dp_replicate
    if r < 1:
        raise ConfigError(f"parallel.dp_replicate={r} must be at least 1")
    if r > 1 and not (p.zero_stage >= 2 and p.zero_backend == "fsdp"):
        raise ConfigError(
            f"parallel.dp_replicate={r} is HSDP, FSDP's hybrid of sharding and replicas: it needs "
            "parallel.zero_backend=fsdp and parallel.zero_stage=2 or 3 (got "
            f"zero_backend={p.zero_backend}, zero_stage={p.zero_stage})")
    if dp % r:
        raise ConfigError(
            f"parallel.dp_replicate={r} must divide parallel.dp={dp}: each replica shards over "
            f"dp / dp_replicate ranks (try dp_replicate in {divisors(dp)})")


def _check_fsdp(cfg: DictConfig) -> None:
    """FSDP2's rules (parallel.zero_backend=fsdp): what it shards, and what it composes with
    so far."""
    p, stage = cfg.parallel, cfg.parallel.zero_stage
    if stage == 0:
        raise ConfigError(
            "parallel.zero_backend=fsdp picks the engine of a sharded stage, but "
            "parallel.zero_stage=0 is DDP: set parallel.zero_stage=2 or 3")
    if stage == 1:
        raise ConfigError(
            "parallel.zero_stage=1 with parallel.zero_backend=fsdp: FSDP2 shards the weights "
            "themselves, so its least sharded form is stage 2 (weights kept gathered from forward "
            "to backward); use parallel.zero_stage=2, or zero_backend=deepspeed for stage 1")
    if p.ep > 1 and p.dp_replicate > 1:
        raise ConfigError(
            f"parallel.ep={p.ep} with parallel.dp_replicate={p.dp_replicate}: HSDP with expert "
            "parallelism is not built yet (the experts' shards would need replicas of their "
            "own); use parallel.dp_replicate=1 (FSDP over every dp rank) with ep")
    for key in ("offload_optimizer", "offload_params"):
        if p[key] == "nvme":
            raise ConfigError(
                f"parallel.{key}=nvme with parallel.zero_backend=fsdp: FSDP2 offloads to the host "
                f"only; use parallel.{key}=cpu, or zero_backend=deepspeed for nvme")
    if p.offload_params != "none" and stage != 3:
        raise ConfigError(
            f"parallel.offload_params={p.offload_params} needs parallel.zero_stage=3 (only "
            f"stage 3 keeps the weights sharded between uses; got zero_stage={stage})")
    if cfg.train.dtype == "fp16":
        raise ConfigError(
            "train.dtype=fp16 with parallel.zero_backend=fsdp: partrain's loss scaling is "
            "DeepSpeed's; use train.dtype=bf16, or zero_backend=deepspeed")
    if p.get("deepspeed_config"):
        raise ConfigError(
            f"parallel.deepspeed_config={p.deepspeed_config} is a DeepSpeed config, but "
            "parallel.zero_backend=fsdp does not run DeepSpeed; drop it, or set "
            "parallel.zero_backend=deepspeed")
    if p.get("deepspeed"):
        raise ConfigError(
            "parallel.deepspeed sets raw DeepSpeed keys, but parallel.zero_backend=fsdp does not "
            "run DeepSpeed; remove them, or set parallel.zero_backend=deepspeed")


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
        _choice("model.hf_model_type", m.hf_model_type, HF_MODEL_TYPES)
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


def _check_tp(p: DictConfig, m: DictConfig) -> None:
    """Tensor parallelism splits the heads, the MLP and the vocabulary: tp divides each."""
    for key, value in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads)):
        if value % p.tp:
            raise ConfigError(
                f"parallel.tp={p.tp} must divide model.{key}={value} "
                f"(try tp in {divisors(value)})"
            )
    hidden = ffn_dim(m)
    if hidden % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} must divide the MLP size {hidden} (model.ffn_dim, or 8/3 * "
            f"model.dim rounded up to model.multiple_of={m.multiple_of}); set model.ffn_dim or "
            f"model.multiple_of to a multiple of {p.tp}")
    if m.vocab_size % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} must divide model.vocab_size={m.vocab_size} (the embedding and "
            f"output head are split over the vocabulary); pad the vocabulary to a multiple of "
            f"{p.tp}")


def _check_pipeline(p: DictConfig, m: DictConfig) -> None:
    """The pipeline's chunks (pp * pp_virtual_stages) share out the blocks, and the schedule
    matches the chunks per rank."""
    chunks = p.pp * p.pp_virtual_stages
    if chunks > MAX_PIPELINE_CHUNKS:
        raise ConfigError(
            f"pp({p.pp}) * pp_virtual_stages({p.pp_virtual_stages}) = {chunks:,} pipeline chunks "
            f"exceeds {MAX_PIPELINE_CHUNKS}, the most partrain plans for")
    if p.pp_layers is not None:
        given = list(p.pp_layers)
        shown = "[" + ", ".join(map(str, given)) + "]"
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in given):
            raise ConfigError(f"parallel.pp_layers={shown} must list whole block counts, one "
                              "per stage (e.g. [1, 3])")
        if len(given) != chunks:
            raise ConfigError(
                f"parallel.pp_layers={shown} must list {chunks} stage sizes, one per pp rank and "
                f"virtual stage: pp({p.pp}) * pp_virtual_stages({p.pp_virtual_stages})")
        if min(given) < 1 or sum(given) != m.n_layers:
            raise ConfigError(
                f"parallel.pp_layers={shown} must be positive block counts summing to "
                f"model.n_layers={m.n_layers} (they sum to {sum(given)})")
    elif m.n_layers % chunks:
        raise ConfigError(
            f"model.n_layers={m.n_layers} must be divisible by pp({p.pp}) * "
            f"pp_virtual_stages({p.pp_virtual_stages}) = {chunks}, or give the stage sizes "
            "in parallel.pp_layers"
        )
    if p.pp_virtual_stages > 1 and p.pp_schedule != "interleaved_1f1b":
        raise ConfigError(
            f"parallel.pp_virtual_stages={p.pp_virtual_stages} needs "
            f"parallel.pp_schedule=interleaved_1f1b (got {p.pp_schedule})"
        )
    if p.pp > 1 and p.pp_schedule == "interleaved_1f1b" and p.pp_virtual_stages < 2:
        raise ConfigError(
            "parallel.pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2 "
            f"(got {p.pp_virtual_stages}); with one chunk per rank use 1f1b")


def _check_world(p: DictConfig, dp: int, world: World) -> None:
    """The degrees' product is the world size."""
    product = p.pp * dp * p.cp * p.tp
    if product != world.size:
        raise ConfigError(
            f"{degrees_product(p, dp)} = {product} != world size {world.size} "
            f"(nnodes {world.nnodes} * nproc_per_node {world.nproc_per_node}, from "
            f"{world.nproc_from}); change the degrees, use parallel.dp=auto, or change the "
            "world size"
        )


def _check_micro_batches(p: DictConfig, micro_batches: int) -> None:
    """A pipeline fills with at least pp micro-batches; interleaving runs them in groups of pp."""
    if p.pp > 1 and micro_batches < p.pp:
        raise ConfigError(
            f"train.micro_batches={micro_batches} must be at least parallel.pp={p.pp}, "
            "or the pipeline never fills"
        )
    if p.pp > 1 and p.pp_schedule == "interleaved_1f1b" and micro_batches % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b runs micro-batches in groups of pp: "
            f"train.micro_batches={micro_batches} must be divisible by parallel.pp={p.pp}")


def _check_cp(cfg: DictConfig) -> None:
    """Context parallelism's rules: the zigzag split and the all-to-all's head split."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    _choice("parallel.cp_method", p.cp_method, CP_METHODS)
    if p.cp == 1:
        return
    if t.document_masking:
        raise ConfigError(
            f"train.document_masking=true does not go with parallel.cp={p.cp}: the ring and "
            "all-to-all attention of context parallelism have no per-document mask (each cp "
            "rank holds pieces of documents that may span ranks); use parallel.cp=1, or "
            "train.document_masking=false")
    if t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp={p.cp} cuts each sequence into 2 * cp = {2 * p.cp} chunks (two per "
            f"rank, for load balance under the causal mask): train.seq_len={t.seq_len} must be "
            f"divisible by {2 * p.cp}")
    if p.cp_method == "all_to_all":
        for key, value in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads)):
            if (value // p.tp) % p.cp:
                per_rank = f"model.{key}={value} / parallel.tp={p.tp} = {value // p.tp}" \
                    if p.tp > 1 else f"model.{key}={value}"
                raise ConfigError(
                    f"parallel.cp_method=all_to_all gives each cp rank 1/cp of the heads: "
                    f"parallel.cp={p.cp} must divide {per_rank}; use parallel.cp_method=ring "
                    "(no head rule) or another cp")


def _check_seq_len(cfg: DictConfig) -> None:
    """A sequence splits evenly under sequence parallelism and fits the rotary tables."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.sequence_parallel and t.seq_len % (p.tp * p.cp):
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over tp: train.seq_len="
            f"{t.seq_len} must be divisible by parallel.tp={p.tp}"
            + (f" * parallel.cp={p.cp} (each cp rank's share is split over tp)" if p.cp > 1 else ""))
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")


def _check_data(d: DictConfig) -> None:
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be between 0 and 1")
    _choice("data.sampling", d.sampling, DATA_SAMPLING)
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
    if p.sequence_parallel and p.tp == 1:
        warnings.append("parallel.sequence_parallel=true has no effect with parallel.tp=1")
    if cfg.launcher.device != "cpu" and p.tp > world.nproc_per_node:
        warnings.append(
            f"parallel.tp={p.tp} is larger than the {world.nproc_per_node} GPUs per node: "
            "tensor-parallel all-reduces will cross nodes, which is slow"
        )
    return warnings

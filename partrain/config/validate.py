"""Every rule a config must meet, checked before any process starts.

`resolve_and_validate` fills in what the config leaves open (dp=auto, the third of the batch
triple) and raises ConfigError with a message naming the keys, the values and the rule. Warnings
(allowed but probably not what the user wants) come back as strings.
"""

import math
import re
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf, open_dict

from partrain.config.keys import SCHEMA_KEYS, divisors, float_keys, shown
from partrain.config.validate_moe import check_moe
from partrain.errors import ConfigError
from partrain.models.arith import RECOMPUTE_MODES, ffn_dim

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CP_METHODS = ("ring", "all_to_all")
DTYPES = ("auto", "fp32", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DEVICES = ("auto", "cpu", "cuda")
DATA_SOURCES = ("stdlib", "tokens")
OPTIMIZERS = ("adamw",)
WANDB_MODES = ("off", "offline", "online")
ROPE_TYPES = ("default", "llama3")
# Bounds on what can exist, so that validation and `plan` cost the same for any input: the
# largest training jobs run ~10^5 GPUs, and a node holds at most a few dozen.
MAX_WORLD_SIZE = 1 << 20
MAX_NPROC_PER_NODE = 1024
MAX_PIPELINE_CHUNKS = 1024  # pp * pp_virtual_stages: real pipelines have tens of stages
INT64_MAX = (1 << 63) - 1  # every whole number of the config fits torch's and numpy's integers
MAX_TIMEOUT_S = 7 * 24 * 3600
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class World:
    """How many processes run where: nnodes * nproc_per_node ranks."""

    nnodes: int
    nproc_per_node: int
    # Where nproc_per_node came from, for messages: a flag, a key, or the degrees' product.
    nproc_from: str = field(default="--nproc-per-node", compare=False)

    @property
    def size(self) -> int:
        return self.nnodes * self.nproc_per_node


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


def check_degrees(p: DictConfig) -> None:
    """dp, tp, pp and cp are whole and at least 1 (dp may be auto): checked before anything
    derives a world size from them, so that a bad degree is named as itself."""
    if p.dp != "auto" and (isinstance(p.dp, bool) or not isinstance(p.dp, int)):
        raise ConfigError(f"parallel.dp={shown(p.dp)} must be a positive integer or 'auto'")
    for key in ("dp", "tp", "pp", "cp"):
        value = p[key]
        if value != "auto" and value < 1:
            raise ConfigError(f"parallel.{key}={value} must be at least 1"
                              + (" (or 'auto')" if key == "dp" else ""))
        if value != "auto" and value > MAX_WORLD_SIZE:
            raise ConfigError(f"parallel.{key}={value} exceeds {MAX_WORLD_SIZE:,}, the most ranks "
                              "partrain plans for (no machine has more)")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={shown(value)} is not one of: {', '.join(allowed)}")


def resolve_world(cfg: DictConfig, nnodes: int | None, nproc_per_node: int | None,
                  cuda_devices: int) -> World:
    """CLI flags win over launcher.* keys; nproc_per_node defaults to the GPUs, else the degrees."""
    p = cfg.parallel
    check_degrees(p)
    nodes_from = "--nnodes" if nnodes is not None else "launcher.nnodes"
    nnodes = nnodes if nnodes is not None else cfg.launcher.nnodes
    nproc_from = "--nproc-per-node" if nproc_per_node is not None else "launcher.nproc_per_node"
    nproc = nproc_per_node if nproc_per_node is not None else cfg.launcher.nproc_per_node
    if nnodes < 1:
        raise ConfigError(f"{nodes_from}={nnodes} must be at least 1")
    if nproc is None:
        if cuda_devices > 0 and cfg.launcher.device != "cpu":
            nproc, nproc_from = cuda_devices, "the visible GPUs"
        elif p.dp != "auto":
            # On CPU the degrees say how many processes: spread evenly over the nodes.
            product = p.pp * p.dp * p.cp * p.tp
            if product % nnodes:
                raise ConfigError(
                    f"{_product(p, p.dp)} = {product} ranks cannot be spread evenly over "
                    f"{nodes_from}={nnodes} nodes; change the degrees or the nodes, or give "
                    "--nproc-per-node")
            nproc = product // nnodes
            nproc_from = (_product(p, p.dp, "parallel.")
                          + (f" / nnodes({nnodes})" if nnodes > 1 else ""))
        else:
            raise ConfigError(
                "parallel.dp=auto needs a world size: give --nproc-per-node N (or set "
                "launcher.nproc_per_node), or set parallel.dp to a number")
    if nproc < 1:
        raise ConfigError(f"{nproc_from}={nproc} must be at least 1")
    if nproc > MAX_WORLD_SIZE:
        raise ConfigError(f"{nproc_from}={nproc:,} exceeds {MAX_WORLD_SIZE:,} ranks, the most "
                          "partrain plans for")
    if nnodes * nproc > MAX_WORLD_SIZE:
        raise ConfigError(f"nnodes({nnodes}) * nproc_per_node({nproc}) = {nnodes * nproc:,} "
                          f"ranks exceeds {MAX_WORLD_SIZE:,}, the most partrain plans for")
    return World(nnodes=nnodes, nproc_per_node=nproc, nproc_from=nproc_from)


def check_startable(world: World) -> None:
    """What `launch` and `slurm` start on one node (`plan` and `show` may go larger)."""
    if world.nproc_per_node > MAX_NPROC_PER_NODE:
        raise ConfigError(
            f"{world.nproc_per_node:,} ranks per node (from {world.nproc_from}) exceed "
            f"{MAX_NPROC_PER_NODE}, the most partrain starts on one node; use more nodes "
            "(--nnodes) or smaller degrees")


def _product(p: DictConfig, dp, prefix: str = "") -> str:
    """The degrees' product as a message spells it; cp only where it is used."""
    cp = f" * {prefix}cp({p.cp})" if p.cp > 1 else ""
    return f"{prefix}pp({p.pp}) * {prefix}dp({dp}){cp} * {prefix}tp({p.tp})"


def _resolve_dp(p: DictConfig, world: World) -> int:
    if p.dp == "auto":
        inner = p.tp * p.pp * p.cp
        if world.size % inner:
            cp = f" * cp({p.cp})" if p.cp > 1 else ""
            raise ConfigError(
                f"parallel.dp=auto needs the world size {world.size} to be divisible by "
                f"pp({p.pp}){cp} * tp({p.tp}) = {inner}"
            )
        return world.size // inner
    check_degrees(p)
    return p.dp


def _resolve_batch(t: DictConfig, dp: int) -> tuple[int, int, int]:
    """global_batch_size = micro_batch_size * micro_batches * dp; any two fix the third."""
    g, b, m = t.global_batch_size, t.micro_batch_size, t.micro_batches
    given = sum(v is not None for v in (g, b, m))
    if given < 2:
        raise ConfigError(
            "set two of train.global_batch_size, train.micro_batch_size, train.micro_batches "
            f"(got global_batch_size={g}, micro_batch_size={b}, micro_batches={m}); "
            "global_batch_size = micro_batch_size * micro_batches * dp"
        )
    if g is None:
        return b * m * dp, b, m
    if b is not None and m is not None:
        if b * m * dp != g:
            raise ConfigError(
                f"train.global_batch_size={g} != micro_batch_size({b}) * micro_batches({m}) * "
                f"dp({dp}) = {b * m * dp}; set one of the three to null to derive it"
            )
        return g, b, m
    known_key, known = ("micro_batch_size", b) if b is not None else ("micro_batches", m)
    other_key = "micro_batches" if b is not None else "micro_batch_size"
    if g % (known * dp):
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by {known_key}({known}) * dp({dp}) "
            f"= {known * dp}, so train.{other_key} would not be whole"
        )
    other = g // (known * dp)
    return (g, b, other) if b is not None else (g, other, m)


def resolve_and_validate(cfg: DictConfig, world: World) -> list[str]:
    """Fill in dp and the batch triple in place; raise ConfigError on the first broken rule."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if not isinstance(cfg.name, str) or not NAME_RULE.fullmatch(cfg.name):
        raise ConfigError(
            f"name={cfg.name!r} must be a plain name of letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit): it names the run dir under runs/ "
            "and the SLURM job")
    _finite(cfg)
    _positive(cfg, ["parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
                    "parallel.pp_virtual_stages",
                    "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.dim",
                    "model.vocab_size", "model.max_seq_len", "train.seq_len", "train.max_steps",
                    "train.global_batch_size", "train.micro_batch_size", "train.micro_batches",
                    "train.log_every", "train.eval_batches", "model.multiple_of",
                    "model.ffn_dim", "data.stdlib_max_bytes", "checkpoint.keep",
                    "model.rope_original_max_seq_len"])
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
    _choice("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    _choice("train.dtype", t.dtype, DTYPES)
    _choice("train.activation_checkpointing", t.activation_checkpointing, RECOMPUTE_MODES)
    _choice("launcher.device", cfg.launcher.device, DEVICES)
    _choice("data.source", cfg.data.source, DATA_SOURCES)
    _choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _choice("train.wandb", t.wandb, WANDB_MODES)
    _choice("model.rope_type", cfg.model.rope_type, ROPE_TYPES)
    if not cfg.model.rope_high_freq_factor > cfg.model.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={cfg.model.rope_high_freq_factor} must be "
                          f"above model.rope_low_freq_factor={cfg.model.rope_low_freq_factor}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} must be 0 (DDP), 1, 2 or 3")
    _check_zero(cfg)

    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.dim={m.dim}")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(
            f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even (rotary embeddings)")
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

    dp = _resolve_dp(p, world)
    product = p.pp * dp * p.cp * p.tp
    if product != world.size:
        raise ConfigError(
            f"{_product(p, dp)} = {product} != world size {world.size} "
            f"(nnodes {world.nnodes} * nproc_per_node {world.nproc_per_node}, from "
            f"{world.nproc_from}); change the degrees, use parallel.dp=auto, or change the "
            "world size"
        )

    g, b, mb = _resolve_batch(t, dp)
    if p.pp > 1 and mb < p.pp:
        raise ConfigError(
            f"train.micro_batches={mb} must be at least parallel.pp={p.pp}, "
            "or the pipeline never fills"
        )
    if p.pp > 1 and p.pp_schedule == "interleaved_1f1b" and mb % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b runs micro-batches in groups of pp: "
            f"train.micro_batches={mb} must be divisible by parallel.pp={p.pp}")
    _check_cp(cfg)
    check_moe(cfg, dp)
    if p.sequence_parallel and t.seq_len % (p.tp * p.cp):
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over tp: train.seq_len="
            f"{t.seq_len} must be divisible by parallel.tp={p.tp}"
            + (f" * parallel.cp={p.cp} (each cp rank's share is split over tp)" if p.cp > 1 else ""))
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be between 0 and 1")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive")
    if not cfg.optim.grad_clip >= 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip} must be >= 0 (0 disables it)")
    for key in ("launcher.collective_timeout_s", "launcher.rdzv_timeout_s"):
        if _value(cfg, key) < 1:
            raise ConfigError(f"{key}={_value(cfg, key)} must be at least 1")
        if _value(cfg, key) > MAX_TIMEOUT_S:
            raise ConfigError(f"{key}={_value(cfg, key)} must be at most {MAX_TIMEOUT_S} "
                              "seconds (a week)")

    with open_dict(cfg):
        p.dp = dp
        t.global_batch_size, t.micro_batch_size, t.micro_batches = g, b, mb
        cfg.launcher.nnodes, cfg.launcher.nproc_per_node = world.nnodes, world.nproc_per_node
    if p.zero_stage > 0:
        from partrain.config.deepspeed import deepspeed_config

        deepspeed_config(cfg)  # raises on a raw key that contradicts a derived one

    warnings = []
    if p.zero_stage > 0 and dp == 1:
        warnings.append(f"parallel.zero_stage={p.zero_stage} with dp=1 shards over one rank: "
                        "nothing is saved")
    if p.sequence_parallel and p.tp == 1:
        warnings.append("parallel.sequence_parallel=true has no effect with parallel.tp=1")
    if cfg.launcher.device != "cpu" and p.tp > world.nproc_per_node:
        warnings.append(
            f"parallel.tp={p.tp} is larger than the {world.nproc_per_node} GPUs per node: "
            "tensor-parallel all-reduces will cross nodes, which is slow"
        )
    return warnings


def _check_cp(cfg: DictConfig) -> None:
    """Context parallelism's rules: the zigzag split and the all-to-all's head split."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    _choice("parallel.cp_method", p.cp_method, CP_METHODS)
    if p.cp == 1:
        return
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


def _check_zero(cfg: DictConfig) -> None:
    """ZeRO's rules: which stages compose with what, offload targets, fp16."""
    p, stage = cfg.parallel, cfg.parallel.zero_stage
    _choice("parallel.offload_optimizer", p.offload_optimizer, OFFLOAD_DEVICES)
    _choice("parallel.offload_params", p.offload_params, OFFLOAD_DEVICES)
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
    if stage == 0 and p.get("deepspeed"):
        raise ConfigError(
            "parallel.deepspeed sets raw DeepSpeed keys, but parallel.zero_stage=0 runs DDP, not "
            "DeepSpeed; set parallel.zero_stage to 1, 2 or 3")


"""The layout's rules (parallel.*, with the batch and sequence they split), checked before any
process starts: ZeRO and FSDP, tp, pp, the world's product, the micro-batches a schedule needs,
cp and the sequence length. partrain.config.validate calls them in its fixed order."""

from omegaconf import DictConfig

from partrain.config.keys import divisors, shown
from partrain.config.resolve import World, degrees_product
from partrain.errors import ConfigError
from partrain.models.arith import ffn_dim

CP_METHODS = ("ring", "all_to_all")
ZERO_BACKENDS = ("deepspeed", "fsdp")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MAX_PIPELINE_CHUNKS = 1024  # pp * pp_virtual_stages: real pipelines have tens of stages


def choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """`value` is one of `allowed`, else a ConfigError naming the key and the choices."""
    if value not in allowed:
        raise ConfigError(f"{key}={shown(value)} is not one of: {', '.join(allowed)}")


def check_zero(cfg: DictConfig) -> None:
    """ZeRO's rules: the stage, which stages compose with what, offload targets, fp16."""
    p, stage = cfg.parallel, cfg.parallel.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={stage} must be 0 (DDP), 1, 2 or 3")
    choice("parallel.offload_optimizer", p.offload_optimizer, OFFLOAD_DEVICES)
    choice("parallel.offload_params", p.offload_params, OFFLOAD_DEVICES)
    choice("parallel.zero_backend", p.zero_backend, ZERO_BACKENDS)
    if p.zero_backend == "fsdp":
        check_fsdp(cfg)
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
    if p.offload_optimizer == "nvme" and stage < 3 and p.zero_backend == "deepspeed":
        # DeepSpeed's ZeRO-1/2 take any offload device as the host's (stage_1_and_2.py): the
        # state would sit in host memory, not on the disk asked for.
        raise ConfigError(
            f"parallel.offload_optimizer=nvme needs parallel.zero_stage=3 (DeepSpeed's ZeRO-1/2 "
            f"offload to host memory only; got zero_stage={stage}): use zero_stage=3, or "
            "offload_optimizer=cpu")
    if cfg.train.dtype == "fp16" and stage == 0:
        raise ConfigError(
            "train.dtype=fp16 needs loss scaling, which partrain does through DeepSpeed: use "
            "parallel.zero_stage >= 1, or train.dtype=bf16")
    if cfg.train.dtype == "fp16" and p.pp > 1:
        # The pipeline's schedule runs each micro-batch's backward itself, not through the
        # engine's, so the loss is never multiplied by the loss scale: DeepSpeed's dynamic
        # scaler raises at the first backward on every rank.
        raise ConfigError(
            f"train.dtype=fp16 with parallel.pp={p.pp}: the pipeline's backward does not go "
            "through DeepSpeed's loss scaler, which fp16 needs; use train.dtype=bf16, or pp=1")
    if stage == 0 and p.get("deepspeed_config"):
        raise ConfigError(
            f"parallel.deepspeed_config={p.deepspeed_config} is a DeepSpeed config, but "
            "parallel.zero_stage=0 runs DDP, not DeepSpeed; set zero_optimization.stage in the "
            "file (or parallel.zero_stage) to 1, 2 or 3")
    if stage == 0 and p.get("deepspeed"):
        raise ConfigError(
            "parallel.deepspeed sets raw DeepSpeed keys, but parallel.zero_stage=0 runs DDP, not "
            "DeepSpeed; set parallel.zero_stage to 1, 2 or 3")


def check_hsdp(p: DictConfig, dp: int) -> None:
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


def check_fsdp(cfg: DictConfig) -> None:
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


def check_fsdp_shards(cfg: DictConfig, dp: int, user=None) -> None:
    """Weights tp splits by rows (q, k, v, the MLP's first matrices, the embedding, the head)
    are sharded by FSDP on their second dimension, model.dim, which FSDP2 splits only evenly
    (an uneven first dimension it takes): every rank failed at its start otherwise. `dp`: the
    resolved degree (an `auto` one too). A user's model (`user`: family.UserModel) by its own
    plan's splits: those weights' second dimensions, and no tp-split bias (1-D)."""
    p, m = cfg.parallel, cfg.model
    if p.zero_backend != "fsdp" or p.zero_stage < 2 or p.tp == 1:
        return
    shards = dp // p.dp_replicate * p.cp
    over = ("dp / dp_replicate" if p.dp_replicate > 1 else "dp") + (" x cp" if p.cp > 1 else "")
    if m.get("target"):
        _check_user_fsdp_shards(m.target, p, user, shards, over)
        return
    if shards > 1 and m.dim % shards:
        raise ConfigError(
            f"parallel.zero_backend=fsdp with parallel.tp={p.tp}: FSDP2 shards the weights tp "
            f"splits by rows (q, k, v, the MLP's first matrices, the embedding and the head) on "
            f"their second dimension, model.dim={m.dim}, over {over} = {shards} ranks, and it "
            f"cannot split that dimension unevenly: {shards} must divide {m.dim} (try {over} in "
            f"{divisors(m.dim)}), or use parallel.zero_backend=deepspeed, which runs this layout")


def _check_user_fsdp_shards(target: str, p: DictConfig, user, shards: int, over: str) -> None:
    if user is None:
        return
    engine = (f"parallel.zero_backend=fsdp with parallel.tp={p.tp}: FSDP2 shards model.target="
              f"{target}'s tp-split weights again")
    if user.tp_biases:
        raise ConfigError(
            f"{engine}, and cannot split the 1-D biases tp splits ("
            f"{', '.join(user.tp_biases[:3])}{', ...' if len(user.tp_biases) > 3 else ''}); use "
            "parallel.zero_backend=deepspeed, which runs this layout, or parallel.tp=1")
    uneven = [(name, size) for name, size in user.tp_rows if shards > 1 and size % shards]
    if uneven:
        name, size = uneven[0]
        raise ConfigError(
            f"{engine}: those split by rows ({name}: {size} columns) on their second dimension, "
            f"over {over} = {shards} ranks, and it cannot split it unevenly: {shards} must divide "
            f"{size} (try {over} in {divisors(size)}), or use parallel.zero_backend=deepspeed")


def check_tp(p: DictConfig, m: DictConfig) -> None:
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


def check_pipeline(p: DictConfig, m: DictConfig) -> None:
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


def check_world(p: DictConfig, dp: int, world: World) -> None:
    """The degrees' product is the world size."""
    product = p.pp * dp * p.cp * p.tp
    if product != world.size:
        raise ConfigError(
            f"{degrees_product(p, dp)} = {product} != world size {world.size} "
            f"(nnodes {world.nnodes} * nproc_per_node {world.nproc_per_node}, from "
            f"{world.nproc_from}); change the degrees, use parallel.dp=auto, or change the "
            "world size"
        )


def check_micro_batches(p: DictConfig, micro_batches: int) -> None:
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


def check_cp(cfg: DictConfig) -> None:
    """Context parallelism's rules: the zigzag split and the all-to-all's head split."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    choice("parallel.cp_method", p.cp_method, CP_METHODS)
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


def check_seq_len(cfg: DictConfig) -> None:
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

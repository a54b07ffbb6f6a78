"""The typed config schema: every key partrain reads, declared once, with its meaning and unit.

Hydra merges the YAML groups under configs/ and the recipe into these dataclasses, so an unknown
key or a value of the wrong type fails at compose time, before anything starts.

Each field's docstring, the string on the line after it (torchtitan's job_config convention, read
by editors and by `partrain.config.keys.key_table`), is the key's help: what it means, its unit,
its choices; a section's is on its field in the section above. `partrain show --keys` and
docs/config-keys.md are generated from them (tests/unit/config/test_keys_doc.py holds both to it).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class MoEConfig:
    n_experts: int = 0
    """Routed experts in each MoE block; 0 = a dense model (no MoE)."""
    top_k: int = 2
    """Routed experts per token."""
    n_shared_experts: int = 0
    """Experts every token passes through as well (DeepSeek); 0 = none."""
    expert_ffn_dim: Optional[int] = None
    """SwiGLU inner size of one expert; null = the dense model.ffn_dim."""
    first_dense: int = 0
    """The first blocks keep a dense MLP (DeepSeek-V3: 3)."""
    every: int = 1
    """After those, every n-th block is MoE (1 = all, 2 = every other)."""
    balance: str = "aux_loss"
    """aux_loss (Switch/GShard, per sequence) | bias (DeepSeek-V3, loss-free) | none."""
    aux_loss_coef: float = 0.01
    """Weight of the auxiliary balancing loss (balance=aux_loss)."""
    bias_update_rate: float = 0.001
    """Per-step change of the expert bias (balance=bias)."""
    capacity_factor: float = 0.0
    """0 = dropless; else each expert takes at most ceil(cf * seq_len * top_k / n_experts) tokens
    of a sequence."""
    norm_topk: bool = True
    """Renormalise the top-k router weights to sum to 1 (Mixtral, DeepSeek)."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Label shown in plans and logs (it picks nothing: model.family and model.target do)."""
    family: str = "llama"
    """The registered model family partrain builds (partrain.models.family.FAMILIES)."""
    target: Optional[str] = None
    """Your own nn.Module instead: 'package.module:function', called with the model section
    (model.args, vocab_size, max_seq_len); the shape keys below then do not apply."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Your model's own keys (model.target), passed to its builder as model.args."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    dim: int = 128
    """Hidden size (elements per token)."""
    head_dim: Optional[int] = None
    """Elements per attention head; null = dim / n_heads (Qwen3 sets its own)."""
    ffn_dim: Optional[int] = None
    """SwiGLU inner size; null = 8/3 * dim rounded up to multiple_of."""
    multiple_of: int = 32
    """Rounding of the derived ffn_dim."""
    vocab_size: int = 256
    """Embedding rows (tokens); the byte-level corpus needs 256."""
    max_seq_len: int = 512
    """Longest sequence (tokens) the rotary tables are built for."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_type: str = "default"
    """default | llama3: Llama-3.1/3.2 frequency scaling by the rope_* keys below."""
    rope_factor: float = 8.0
    """llama3: wavelengths longer than original_max_seq_len / low_freq_factor are divided by
    it."""
    rope_low_freq_factor: float = 1.0
    """llama3: see rope_factor; between it and high_freq_factor, a blend."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths under original_max_seq_len / high_freq_factor stay."""
    rope_original_max_seq_len: int = 8192
    """llama3: the context length (tokens) the frequencies were trained for."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal weight initialisation."""
    tie_embeddings: bool = False
    """The output head's weight is the embedding's (one (vocab_size, dim) matrix)."""
    qkv_bias: bool = False
    """A bias on the q, k and v projections (Qwen2/2.5); none on the output projection."""
    qk_norm: bool = False
    """RMSNorm of each head's query and key before the rotary embedding (Qwen3)."""
    sliding_window: Optional[int] = None
    """Mistral's attention window (tokens), kept for the export; partrain attends to every earlier
    position, so it must be >= model.max_seq_len (null = none)."""
    hf_model_type: Optional[str] = None
    """The Hugging Face family an export writes: llama | mistral | qwen2 | qwen3; null = qwen3
    with qk_norm, qwen2 with qkv_bias, else llama. Set by init_from=hf:DIR."""
    init_from: Optional[str] = None
    """Checkpoint dir (or a run dir: its newest), or hf:DIR, whose weights start this run; fresh
    optimizer."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts: routed (and shared) experts in place of the dense MLP of some
    blocks."""


@dataclass
class ParallelConfig:
    dp: Any = "auto"
    """Data-parallel degree, or auto = world size / (pp * cp * tp)."""
    tp: int = 1
    """Tensor-parallel degree (innermost mesh dimension)."""
    pp: int = 1
    """Pipeline-parallel degree (outermost mesh dimension)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (between dp and tp)."""
    ep: int = 1
    """Expert-parallel degree: experts split over groups of ep consecutive dp ranks (divides
    dp)."""
    cp_method: str = "ring"
    """ring (key/value blocks around a ring) | all_to_all (DeepSpeed-Ulysses)."""
    zero_stage: int = 0
    """0 = DDP; 1, 2, 3 = ZeRO over the dp dimension (optimizer state; + gradients; + weights)."""
    zero_backend: str = "deepspeed"
    """deepspeed | fsdp: the engine that shards at zero_stage >= 1 (DeepSpeed ZeRO, or PyTorch's
    FSDP2 at stage 2 or 3)."""
    dp_replicate: int = 1
    """HSDP (zero_backend=fsdp): dp splits into dp_replicate groups of dp / dp_replicate
    consecutive dp ranks; FSDP shards inside a group (a node) and all-reduces across them."""
    pp_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved_1f1b."""
    pp_virtual_stages: int = 1
    """Model chunks per pp rank (interleaved_1f1b)."""
    pp_layers: Optional[List[int]] = None
    """Blocks per stage (pp * pp_virtual_stages numbers); null = balanced."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside tp groups."""
    offload_optimizer: str = "none"
    """none | cpu | nvme: ZeRO-Offload of optimizer state and step (zero_stage >= 1; nvme at
    zero_stage 3, DeepSpeed's ZeRO-Infinity)."""
    offload_params: str = "none"
    """none | cpu | nvme: ZeRO-Infinity parameter offload (zero_stage 3)."""
    offload_nvme_path: Optional[str] = None
    """Directory for offload to nvme (zero_stage 3), on a local drive of every node with direct
    I/O (not tmpfs or ramfs); each run swaps in a folder of its own in it, <run dir name>-<hash>,
    removed by each node's launcher when the run ends there (two jobs may share the path).
    Checked by each rank at the start, with libaio for DeepSpeed's async_io op (apt-get install
    libaio-dev)."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed keys merged over the derived config; contradictions are refused."""
    deepspeed_config: Optional[str] = None
    """A DeepSpeed JSON file (ds_config.json), read once at compose: what it says of the ZeRO
    stage, offload, batch, precision, clipping and optimizer sets those keys ("auto" = partrain's
    value), the rest goes on as raw keys; every conflict reported at once."""


@dataclass
class BlendSource:
    path: Optional[str] = None
    """A token dir (made by `partrain data prepare`)."""
    weight: float = 1.0
    """Its share of the training samples, relative to the other sources' weights."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """stdlib = Python's own source as bytes; tokens = a prepared token dir (data.path, or the
    dirs of data.blend)."""
    path: Optional[str] = None
    """Token dir (`partrain data prepare`: meta.json, train-/val- shards, document indexes) when
    source=tokens."""
    sampling: str = "random"
    """random | epochs: the training sequences of each step. random = global_batch_size windows
    of seq_len + 1 tokens at random offsets drawn anew each step (with replacement; the default,
    so that every run, reference number and checkpoint made before this key trains on the same
    batches); epochs = the train split cut into (tokens - 1) // seq_len sequences, each seen once
    per epoch in an order shuffled per epoch (Megatron-LM's)."""
    blend: Optional[List[BlendSource]] = None
    """Several token dirs mixed by weight, a list of {path: DIR, weight: W} (sets data.source
    to tokens; data.path stays null): sample g of the run comes from the source furthest behind
    its share weight * (g + 1) (Megatron-LM's blend), each source in its own data.sampling order;
    validation draws the sources' val splits with the same weights. All must share one
    tokenizer (the same tokenizer.json, end-of-text token and vocab_size). null = no blend."""
    val_fraction: float = 0.05
    """Share of the stdlib corpus held out for validation."""
    stdlib_max_bytes: int = 8_000_000
    """Bytes of stdlib source read, in sorted file order."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw | adam | sgd: torch.optim.AdamW, Adam (weight decay added to the gradient, not
    decoupled) or SGD with momentum (under ZeRO, DeepSpeed builds the same torch optimizer)."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    schedule: str = "cosine"
    """cosine | linear | constant | wsd: after the linear warmup, cosine or linear decay to
    lr * min_lr_ratio at max_steps, constant at lr, or warmup-stable-decay (lr, then 1-sqrt decay
    to lr * min_lr_ratio over the last decay_ratio of max_steps)."""
    min_lr_ratio: float = 0.1
    """The decay (cosine, linear, wsd) ends at lr * min_lr_ratio at max_steps."""
    warmup_steps: int = 20
    """Linear warmup from lr / warmup_steps (optimizer steps)."""
    decay_ratio: float = 0.1
    """wsd only: the fraction of train.max_steps, at the end, over which the learning rate decays
    (in (0, 1]; the decay may not reach into the warmup)."""
    weight_decay: float = 0.1
    """Weight decay of matrices and embeddings (never norm gains): decoupled for adamw; for adam
    and sgd torch's L2 term, weight_decay * weight added to the gradient."""
    beta1: float = 0.9
    """Adam(W)'s decay rate of the first moment (the gradient's running mean)."""
    beta2: float = 0.95
    """Adam(W)'s decay rate of the second moment (the squared gradient's running mean)."""
    eps: float = 1e-8
    """Adam(W)'s epsilon, added to the second moment's square root."""
    momentum: float = 0.9
    """sgd only: the momentum factor in [0, 1) (0: plain SGD, no momentum buffer)."""
    nesterov: bool = False
    """sgd only: Nesterov momentum (needs momentum > 0)."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""


@dataclass
class TrainConfig:
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step."""
    micro_batch_size: Optional[int] = None
    """Sequences per micro-batch on one dp rank."""
    micro_batches: Optional[int] = None
    """Micro-batches per step; any two of the batch triple fix the third."""
    seq_len: int = 128
    """Tokens per sequence."""
    max_steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seeds the weights and the batch order (same for every layout)."""
    dtype: str = "auto"
    """auto = bf16 on CUDA, fp32 on CPU; or fp32 | bf16 | fp16 (fp16: ZeRO only, loss
    scaling)."""
    eval_every: int = 50
    """Steps between validation passes; 0 = only at the end."""
    eval_batches: int = 4
    """Global batches of the validation split per pass."""
    log_every: int = 10
    """Steps between lines in the rank logs (and on a non-terminal stdout)."""
    max_skipped_steps: int = 5
    """Divergence guard: a step whose loss or gradient norm is not finite is skipped (no update,
    on every rank); this many in a row stop the run with exit 4, naming the newest good
    checkpoint to resume from."""
    activation_checkpointing: str = "none"
    """none | selective | full: recompute in backward what a block would keep (full: all but its
    input; selective: all but matmul and attention outputs)."""
    document_masking: bool = False
    """Attention stays inside each document of a packed sequence (the data's document index);
    positions are not restarted (rotary: the same scores). Not with parallel.cp > 1."""
    compile: bool = False
    """torch.compile each transformer block (after tp/cp/ep/pp have rewritten it, before
    DDP/ZeRO) and the loss (without tp); the first steps pay the compilation."""
    float8: bool = False
    """The blocks' linear layers multiply in FP8 (torchao's float8 training; needs torchao and
    GPUs of compute capability 8.9+, e.g. H100); the head, routers and weights stay as they are.
    Not with parallel.tp > 1 or DeepSpeed ZeRO."""
    float8_recipe: str = "tensorwise"
    """tensorwise | rowwise: one FP8 scale per tensor, or per row (more accurate, slower)."""
    float8_emulate: bool = False
    """Emulate the FP8 matmuls (torchao's emulate: the same casts, no FP8 kernels): for tests on
    CPU, at no gain."""
    measure_memory: bool = False
    """Tensor accounting of the run's 2nd step: memory_base_bytes / memory_peak_bytes per rank in
    metrics.jsonl, and memory_cuda_peak_bytes (max_memory_allocated) on CUDA (slows that step)."""
    trace: bool = False
    """Write trace.json (Chrome trace events, one track per rank, the first 50 steps) to the run
    dir; a start that resumed writes trace.from-step-S.json beside it (S: its first step)."""
    profile_start: int = 0
    """torch.profiler from this optimizer step (0 = off) over train.profile_steps steps: each
    rank's Chrome trace and top-operator table in RUN_DIR/profile/."""
    profile_steps: int = 3
    """Steps the profiler records, from train.profile_start."""
    tensorboard: bool = False
    """TensorBoard event files in RUN_DIR/tensorboard/ (needs partrain[tensorboard])."""
    wandb: str = "off"
    """off | offline | online: W&B logging into RUN_DIR/wandb/ (needs partrain[wandb])."""
    wandb_project: str = "partrain"
    """W&B project of the run."""


@dataclass
class LauncherConfig:
    nnodes: int = 1
    """Nodes in the job (--nnodes wins)."""
    nproc_per_node: Optional[int] = None
    """Ranks per node (--nproc-per-node wins); null = the visible GPUs on CUDA, else the
    degrees' product over the nodes."""
    device: str = "auto"
    """auto | cpu | cuda (auto = cuda when a GPU is visible)."""
    start_method: str = "auto"
    """auto | spawn | forkserver: how the ranks start (torchrun's --start-method). spawn: each
    rank is a new `python -m partrain.train` that imports torch itself; forkserver: ranks fork
    from one process per node that imported torch and partrain once (seconds less per rank).
    auto = forkserver on CPU under Linux, spawn on CUDA (forked ranks trained alike on one GPU;
    several GPUs under NCCL are not checked yet) and elsewhere."""
    collective_timeout_s: int = 120
    """Process-group timeout in seconds; short so that a broken job fails fast."""
    rdzv_timeout_s: int = 120
    """Seconds nodes wait for each other at start."""
    max_restarts: int = 0
    """Times the workers of every node are restarted after a rank fails, each time resuming
    from the newest committed checkpoint (--max-restarts wins; torchrun's --max-restarts). Not
    after the ranks stopped together on purpose (divergence, a refused preemption save, a bad
    setup): those exit at once."""
    hang_timeout_s: Optional[int] = None
    """Seconds a step may make no progress before the launcher calls it a hang: every rank's
    stack is dumped, one summary says who waits in which collective, and the job ends (exit 1)
    or restarts (max_restarts). The first step of each start may take twice as long (it
    compiles, builds communicators); saves and evaluations are timed only where a rank waits in
    one collective (until 15 s before collective_timeout_s). null = a third of collective_timeout_s; 0 = off; 2 x hang_timeout_s must be below collective_timeout_s."""
    setup: List[str] = field(default_factory=list)
    """Shell lines `partrain slurm`'s script runs on every node before partrain (e.g. `module
    load cuda/12.4`); --setup adds more."""
    allow_predicted_oom: bool = False
    """Start on CUDA even when partrain's memory model predicts a rank's peak above the GPU's
    memory by more than the model's error (10%); `partrain launch` refuses such a layout
    otherwise and names the changes that would fit."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every N optimizer steps into RUN_DIR/checkpoints/; 0 = never on a schedule."""
    keep: int = 2
    """Newest committed checkpoints kept; older ones are deleted after a newer commit."""
    save_last: bool = True
    """Also save after the last step."""
    async_save: bool = False
    """Write in a background thread; the loop blocks only to copy the state."""


@dataclass
class Config:
    name: str = "run"
    """Run name: the default run dir is runs/<name>-<time>."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The decoder's shape (a Llama-style transformer) and where its weights start from."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The layout: the mesh's degrees (pp, dp, cp, tp from outermost in; ep inside dp), the
    pipeline schedule, ZeRO and offload."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the tokens come from."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer (AdamW, Adam, SGD), its learning-rate schedule and gradient clipping."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The batch, the steps, precision, and what a run records."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """How many processes start where, and how long they wait for each other."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When to save, and how many checkpoints to keep."""


def register() -> None:
    """Put the schema where configs/config.yaml's defaults list finds it (`base_config`), once a
    process: storing it builds the structured config anew (a sixth of a compose's time)."""
    store = ConfigStore.instance()
    if "base_config.yaml" not in store.list(""):
        store.store(name="base_config", node=Config)

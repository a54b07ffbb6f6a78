"""What the time model prices, as plain data: a layout (Layout), what it assumes of the trainer
(Implementation: partrain's, PARTRAIN and FSDP_IMPL, or a published stack's) and one pipeline
stage (Stage). time_model.py and dp_time.py read them; neither imports the other's types.
"""

from dataclasses import dataclass

# DeepSpeed's own work beyond the collectives, measured at dp=1 on an H100 where there is
# nothing to communicate (docs/performance.md "On GPUs": llama-1b, 1.5B parameters in 16 blocks,
# 2 micro-batches of 8192 tokens; ZeRO-1/2/3 at 0.963, 0.828 and 0.362 of DDP's tokens/s):
# ZeRO-1/2's bf16 -> fp32 gradient copies into its flat buffers and the weights' copy back, per
# parameter and step; ZeRO-3's gather and release hooks, per module and micro-batch (0.357 s per
# micro-batch over 147 modules: 9 per block, the embedding, the final norm and the head). The
# hooks are Python and kernel launches per module, so they scale with modules, not parameters.
DEEPSPEED_S_PER_PARAM = {1: 1.1e-11, 2: 5.7e-11, 3: 5.7e-11}
ZERO3_HOOK_S_PER_MODULE = 0.357 / 147


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    micro_batch_size: int = 1
    activation_checkpointing: str = "none"
    offload_optimizer: str = "none"
    cp_method: str = "ring"
    zero_backend: str = "deepspeed"  # deepspeed | fsdp (FSDP2: FSDP_IMPL's terms)
    dp_replicate: int = 1  # HSDP: FSDP shards over dp x cp / dp_replicate, all-reduces across
    # parallel.pp_layers: blocks per chunk, pp x v of them (chunk s on pp rank s % pp); None:
    # an even split
    pp_layers: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class Implementation:
    """What the time model assumes of the trainer; partrain's by default (PARTRAIN). Another
    trainer's published runs are modelled by its own (scripts/bench_time_model.py)."""
    dp_overlap: bool = True  # the gradient reduction goes out during the last backward
    dp_overlap_under_pp: bool = False  # ... also under pp (partrain averages after the schedule)
    param_gather_overlap: bool = False  # ZeRO-1/2's weight all-gather under the next forward
    zero3_prefetch: bool = True  # ZeRO-3/FSDP gathers the next layer during this one's compute
    zero3_hook_s_per_module: float = ZERO3_HOOK_S_PER_MODULE  # per module and micro-batch
    deepspeed: bool = True  # ZeRO is DeepSpeed's (its flat-buffer copies, DEEPSPEED_S_PER_PARAM)
    tp_overlap: float = 0.0  # share of the tp collectives hidden behind GEMMs
    tp_wire_bytes: int = 0  # bytes per element of every tp collective; 0: partrain's (costs.py)
    grad_bytes: int = 0  # bytes per gradient element reduced; 0: partrain's (fp32 under DDP)
    cp_overlap: bool = False  # cp's key/value exchange hidden behind attention
    flash_attention: bool = True  # fused attention; False: scores through HBM (Megatron 2021-22)
    # The fused kernel's forward + backward as a fraction of the GPU's peak, where its figure on
    # that GPU is known (FlashAttention-2 on an H100: 0.35, FlashAttention-3's abstract; it is
    # what PyTorch's SDPA runs there unless cuDNN's is asked for, pytorch/pytorch#138522);
    # 0: ATTENTION_EFFICIENCY of the GEMMs'.
    attention_peak_fraction: float = 0.0
    selective_matmuls: float = 0.0  # share of the forward GEMMs "selective" recomputes
    send_bytes: int = 4  # bytes per element of a pipeline send (partrain: the fp32 residual)
    send_split_tp: bool = False  # each tp rank sends 1/tp of it (Megatron's scatter/gather)
    # FSDP2's per-parameter shards are copied into one buffer before each all-gather and out of
    # it after, and gradients into one before each reduce-scatter (its "copy-in/copy-out"; FSDP1
    # and DeepSpeed gather into flat buffers in place): bytes through HBM per micro-batch.
    fsdp_copies: bool = False
    # The trainer's GEMMs against the preset's matmul_efficiency: its kernels, compiler and the
    # clocks its GPUs hold (a power cap). 1 for partrain and for the stacks the presets were
    # fitted on; scripts/bench_time_model.py fits it per published stack on that stack's fit rows.
    gemm_scale: float = 1.0


PARTRAIN = Implementation()
# partrain with parallel.zero_backend=fsdp: FSDP2 prefetches the next block's gather (its default
# forward and backward prefetch), has no DeepSpeed hooks or flat-buffer copies, reduces gradients
# in fp32 (MixedPrecisionPolicy(reduce_dtype=float32)) at every micro-batch.
FSDP_IMPL = Implementation(zero3_prefetch=True, zero3_hook_s_per_module=0.0, deepspeed=False,
                           grad_bytes=4, fsdp_copies=True)


@dataclass(frozen=True)
class Stage:
    """What one pp rank runs and holds: its blocks and MoE blocks (an even split's share, a
    fraction where a trainer's layers do not divide by pp), the embedding (first) and the
    output head with the loss (last)."""
    blocks: float
    moe_blocks: float
    first: bool = True
    last: bool = True

"""The wrappers a worker applies to its model, in the only place their order is written.

`parallelize` takes the full single-process model (the same weights for every layout) and returns
it wrapped for this rank, with the data-parallel backend that the step drives:

    activation checkpointing -> tensor -> context -> MoE wiring -> expert -> pipeline -> compile
    -> (the weights to start from) -> DDP, DeepSpeed ZeRO or FSDP2

Each step sees what the one before produced, and the comment on each says why it comes there
(torchtitan's parallelize_llama is the model). The model-parallel apply_* get their own mesh
slice and config section; the order is not repeated anywhere else in partrain or its docs
(docs/design.md points here).
"""

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from partrain.config.deepspeed import deepspeed_config
from partrain.config.resolve import compute_dtype
from partrain.models.arith import moe_block_count
from partrain.models.family import blocks, is_user_model, recompute_full
from partrain.models.llama import TransformerBlock
from partrain.models.moe import MoE
from partrain.parallel.context import apply_context_parallel
from partrain.parallel.data import DataParallelBackend, DDPBackend, apply_data_parallel
from partrain.parallel.expert import apply_expert_parallel, moe_modules
from partrain.parallel.float8 import apply_float8, check_float8
from partrain.parallel.fsdp import ExpertSharding, FSDPBackend, apply_fsdp
from partrain.parallel.mesh import ParallelDims, flattened
from partrain.parallel.nvme import on_nvme, run_swap_dir
from partrain.parallel.pipeline import apply_pipeline_parallel
from partrain.parallel.tensor import apply_tensor_parallel
from partrain.parallel.zero import ZeroBackend, apply_zero, check_nvme_offload, swap_in


@dataclass
class Parallelized:
    """What `parallelize` built: the data-parallel backend (the wrapped model and its optimizer),
    and the group whose ranks route different tokens (MoE load accounting), if any."""
    backend: DataParallelBackend
    moe_load_group: object | None
    n_moe_blocks: int  # of the whole model (every rank takes part in the router accounting)
    sequence_parallel: bool


def parallelize(model: torch.nn.Module, cfg, dims: ParallelDims, mesh, expert_mesh, tracer, *,
                load_weights: Callable[[torch.nn.Module], None],
                param_groups: Callable[[torch.nn.Module], list[dict]],
                build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
                run_dir: Path | None = None) -> Parallelized:
    """Wrap `model` for this rank's place in `mesh`, in the one order, and build its optimizer.
    `load_weights(model)` puts the starting weights (a checkpoint's or a Hugging Face model's, or
    none) into this rank's shards; `param_groups` and `build_optimizer` are the optimizer's;
    `run_dir` names the run's swap folder under offload to nvme."""
    p, t = cfg.parallel, cfg.train
    # Blocks keep their checkpointing mode through every wrapper (they stay the same modules).
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if dims.tp_enabled:
        # First, on the full model: column- then row-parallel linears, heads split over tp.
        model = apply_tensor_parallel(model, mesh["tp"], p)
    sequence_parallel = dims.tp_enabled and p.sequence_parallel
    if dims.cp_enabled:
        # Attention over the cp group; every other module works on this rank's tokens.
        model = apply_context_parallel(model, mesh["cp"], p, t.seq_len)
    # The MoE blocks learn their sequence groups before ep swaps their dispatcher.
    n_moe_blocks = moe_block_count(cfg.model)
    moe_load_group = setup_moe(moe_modules(model), n_moe_blocks, dims, mesh, sequence_parallel,
                               t.micro_batches)
    if dims.ep_enabled:
        # Each rank keeps 1/ep of every MoE's experts; tokens travel to them (all-to-all).
        model = apply_expert_parallel(model, expert_mesh["ep"])
    if dims.pp_enabled:
        # What flows between stages: the residual stream of one micro-batch (this cp rank's
        # tokens of it, and a sequence shard of those under sequence parallelism).
        seq = t.seq_len // dims.cp // (dims.tp if sequence_parallel else 1)
        # (A user's model says its hidden size as `dim`: partrain.models.family.)
        dim = model.dim if is_user_model(cfg.model) else cfg.model.dim
        model = apply_pipeline_parallel(model, mesh["pp"], p, (t.micro_batch_size, seq, dim),
                                        tracer)
    if t.float8:
        # FP8 linears in the blocks as cp, ep and pp left them (before compile, which fuses their
        # casts, and before DDP or FSDP2 take them), as torchtitan orders its converters.
        check_float8(mesh.device_type, t.float8_emulate)
        apply_float8(model, t.float8_recipe, t.float8_emulate)
    if t.compile:
        # The blocks as tp, cp, ep and pp left them; DDP and ZeRO then wrap the compiled blocks.
        compile_blocks(model)
    # Checkpoint weights go into this rank's shards now, before DDP or ZeRO take the model: each
    # rank reads only its slices, whatever layout wrote them (and ZeRO copies them to its fp32
    # master weights when it starts).
    load_weights(model)
    if dims.fsdp_enabled:
        # FSDP2 replaces DDP: every block a unit over dp x cp, then the root; the optimizer
        # steps the DTensor shards it leaves.
        fsdp_mesh, shard_mesh, saved = fsdp_meshes(dims, mesh)
        apply_fsdp(model, fsdp_mesh, saved, dims.zero_stage,
                   fsdp_param_dtype(cfg, mesh.device_type),
                   offload="cpu" in (p.offload_params, p.offload_optimizer),
                   experts=expert_sharding(dims, mesh.device_type) if dims.ep_enabled else None)
        backend = FSDPBackend(model, build_optimizer(model), dims, mesh, sequence_parallel,
                              cfg.optim.grad_clip, shard_mesh)
    elif dims.deepspeed_enabled:
        # ZeRO replaces DDP and the optimizer: DeepSpeed shards over dp and builds optim.name's
        # torch optimizer from the derived config (over the same parameter groups).
        ds_config = deepspeed_config(cfg, on_cuda=mesh.device_type == "cuda")
        if on_nvme(p):
            # The run's own swap folder, checked on every node before DeepSpeed builds its swapper.
            folder = (run_swap_dir(p.offload_nvme_path, run_dir) if run_dir is not None
                      else Path(p.offload_nvme_path))
            check_nvme_offload(p, mesh.device_type, folder)
            ds_config = swap_in(ds_config, folder)
        engine, optimizer = apply_zero(model, mesh, dims, ds_config, param_groups(model),
                                       expert_mesh)
        backend = ZeroBackend(engine, optimizer, mesh["tp"].get_group() if sequence_parallel
                              else None)
    else:
        if dims.dp_cp > 1 and not dims.pp_enabled:
            # Gradients are averaged over dp x cp. Under pp the executor runs forward and
            # backward; the backend averages after the schedule instead.
            model = apply_data_parallel(model, flattened(mesh, "dp_cp"))
        backend = DDPBackend(model, build_optimizer(model), dims, mesh, expert_mesh,
                             sequence_parallel, cfg.optim.grad_clip)
    return Parallelized(backend, moe_load_group, n_moe_blocks, sequence_parallel)


def fsdp_meshes(dims: ParallelDims, mesh):
    """(the mesh FSDP shards over, the mesh of one shard group, the mesh a checkpoint records
    FSDP's shards of tp-split weights on: FSDP's dims and tp, or None without tp). FSDP: dp x cp;
    HSDP (dp_replicate > 1): (dp_replicate, dp_shard x cp)."""
    with warnings.catch_warnings():
        # The 1-D flattened meshes are kept (mesh.flattened); a 2-D one of a root dim and a
        # flattened dim has no such handle before torch's _unflatten, so it is still sliced.
        warnings.filterwarnings("ignore", message=".*flattened dim.*")
        if dims.dp_replicate == 1:
            return flattened(mesh, "dp_cp"), flattened(mesh, "dp_cp"), mesh["dp_cp", "tp"] if dims.tp_enabled else None
        hsdp = dims.build_hsdp_mesh(mesh.device_type)
        return (hsdp["dp_replicate", "dp_shard_cp"], flattened(hsdp, "dp_shard_cp"),
                hsdp["dp_replicate", "dp_shard_cp", "tp"] if dims.tp_enabled else None)


def expert_sharding(dims: ParallelDims, device_type: str) -> ExpertSharding:
    """Under ep: an ep rank's experts sharded over the ranks holding the same ones (edp x cp),
    their gradients summed there and divided by dp x cp."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flattened dim.*")
        mesh = dims.build_expert_shard_mesh(device_type)
        return ExpertSharding(flattened(mesh, "edp_cp"), mesh["ep", "edp_cp"], dims.dp_cp)


def fsdp_param_dtype(cfg, device_type: str) -> torch.dtype | None:
    """What FSDP gathers its fp32 shards as for compute: bf16 under train.dtype bf16 (auto on
    CUDA), else the fp32 weights themselves."""
    bf16 = compute_dtype(cfg.train.dtype, device_type == "cuda") == "bf16"
    return torch.bfloat16 if bf16 else None


def setup_moe(layers, n_moe_blocks: int, dims: ParallelDims, mesh, sequence_parallel: bool,
              micro_batches: int):
    """Wire this rank's MoE blocks into the layout; return the group whose ranks route different
    tokens (their per-expert loads are summed): dp x cp, and tp under sequence parallelism.
    Every rank takes part (new groups are collective), with MoE blocks of its own or not."""
    if not n_moe_blocks:
        return None
    # A sequence split over ranks (cp, tp's sequence shards) sums its router statistics there;
    # the balancing loss's gradient takes the language-model loss's 1/micro_batches.
    seq_dims = (("cp",) if dims.cp_enabled else ()) + (("tp",) if sequence_parallel else ())
    seq_group = None
    if len(seq_dims) == 2:
        seq_group = mesh["cp", "tp"]._flatten("cp_tp").get_group()
    elif seq_dims:
        seq_group = mesh[seq_dims[0]].get_group()
    for moe in layers:
        moe.seq_group, moe.seq_scale, moe.aux_scale = seq_group, dims.cp, 1.0 / micro_batches
    if sequence_parallel:
        return mesh["dp", "cp", "tp"]._flatten("dp_cp_tp").get_group()
    return flattened(mesh, "dp_cp").get_group() if dims.dp_cp > 1 else None


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Set every transformer block of `model` to checkpoint in `mode` (models.arith.RECOMPUTE_MODES;
    the mechanism is partrain.models.recompute). A user model's blocks (its `layers`) are
    recomputed whole under mode "full" (validation refuses "selective" for them)."""
    found = blocks(model)
    for block in found:
        if isinstance(block, TransformerBlock):
            block.recompute = mode
        elif mode == "full":
            recompute_full(block)
            block.recompute = mode
    if mode == "full" and not found:
        # A user's model without blocks: its whole forward is recomputed in backward.
        recompute_full(model)
        model.recompute = mode
    return model


def checkpointed_blocks(model: torch.nn.Module) -> int:
    """How many of `model`'s blocks (this rank's, under pp) checkpoint their activations."""
    return sum(getattr(m, "recompute", "none") != "none" for m in model.modules())


def compile_blocks(model: torch.nn.Module) -> int:
    """train.compile: torch.compile every transformer block of `model` in place (the modules stay
    the same objects, so wrappers that hold them see the compiled forward). A block's
    checkpointing is part of its compiled forward. Returns the number of blocks compiled."""
    found = blocks(model)
    if not found:  # a user's model without blocks: compiled whole
        model.compile()
        return 1
    for block in found:
        if isinstance(getattr(block, "feed_forward", None), MoE) and block.recompute != "none":
            # Dynamo cannot trace the router's data-dependent dispatch inside a checkpoint: it
            # would run the whole block eagerly, its recomputation unmarked (the router would
            # count tokens twice). Such a block compiles its attention only.
            block.attention.compile()
        else:
            block.compile()
    return len(found)

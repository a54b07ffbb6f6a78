"""DeepSpeed ZeRO (parallel.zero_stage = 1, 2, 3): optimizer state, gradients and parameters
sharded over the "dp" mesh dimension (dp x cp under context parallelism), instead of DDP.

The DeepSpeed JSON is derived from partrain's config in one place, partrain.config.deepspeed
(pure, so `partrain show` and validation use it too). `apply_zero` hands the
(possibly tensor- or pipeline-parallel) model to `deepspeed.initialize` with partrain's mesh as
its `mpu`, so ZeRO partitions over dp replicas of the same tp shard / pp stage and the gradient
norm is summed over the rest of the model.

`ZeroBackend` is the data-parallel backend the train step drives (partrain.parallel.data).

Choices that keep layout parity: gradient accumulation is ours (`managed_gradient_accumulation`
off: each micro-batch's backward accumulates, `engine.step()` reduces and steps once per
optimizer step), the learning rate follows partrain's schedule (set on the optimizer's
groups each step, as for every other layout) and weight decay skips norm gains (two parameter
groups). DeepSpeed clips and reports the norm before clipping.

Under expert parallelism (ZeRO-1/2) DeepSpeed's own MoE support takes the expert slices: they are
marked as its expert parameters (`allreduce=False`, a `group_name`), partrain's ep and
expert-data-parallel (edp x cp) groups are registered as DeepSpeed's expert groups of that name,
and the engine is shown partrain's MoE modules as its MoE class while it is built
(`_expert_parallel`). DeepSpeed then partitions each slice over the ranks holding it, sums its
gradients there divided by dp x cp (the same as `average_expert_gradients`), and sums its norm
over every dp rank (the slices of the ep group once each).
"""

import logging
import math
import os
import re
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from partrain.models.moe import MoE
from partrain.parallel.data import Update
from partrain.parallel.mesh import flattened
from partrain.parallel.nvme import nvme_problem, on_nvme
from partrain.parallel.tensor import sync_sequence_parallel_grads


class MeshMPU:
    """DeepSpeed's `mpu` interface over partrain's (pp, dp, cp, tp) mesh.

    ZeRO partitions over the data-parallel group. DeepSpeed's "model parallel" group is every
    rank holding a different piece of one replica (pp x tp), over which it sums the gradient
    norm; parameters not marked `tensor_model_parallel` count only on tp rank 0, so replicated
    norm gains are counted once per pipeline stage."""

    def __init__(self, mesh, dims):
        self.dims = dims
        self.coords = dims.coords(dist.get_rank())
        # Under cp the data-parallel group is dp x cp: cp ranks hold the same parameters and
        # their gradients are averaged like dp's (DeepSpeed then counts each sequence cp times in
        # its batch size: partrain.config.deepspeed.derived_config).
        self._dp = flattened(mesh, "dp_cp").get_group()
        self._tp = mesh["tp"].get_group()
        self._pp = mesh["pp"].get_group()
        # One group per replica (the ranks sharing a dp coordinate); every rank takes part in
        # creating every group, as new_group requires, and keeps its own.
        for d in range(dims.dp):
            for c in range(dims.cp):
                ranks = [dims.rank(pp, d, tp, c) for pp in range(dims.pp) for tp in range(dims.tp)]
                group = dist.new_group(ranks)
                if (d, c) == (self.coords["dp"], self.coords["cp"]):
                    self._model, self._model_rank = group, ranks.index(dist.get_rank())

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self):
        return self.coords["dp"] * self.dims.cp + self.coords["cp"]

    def get_data_parallel_world_size(self):
        return self.dims.dp_cp

    def get_model_parallel_group(self):
        return self._model

    def get_model_parallel_rank(self):
        return self._model_rank

    def get_model_parallel_world_size(self):
        return self.dims.pp * self.dims.tp

    def get_tensor_model_parallel_group(self):
        return self._tp

    def get_tensor_model_parallel_rank(self):
        return self.coords["tp"]

    def get_tensor_model_parallel_world_size(self):
        return self.dims.tp

    def get_tensor_model_parallel_src_rank(self):
        return self.dims.rank(self.coords["pp"], self.coords["dp"], 0, self.coords["cp"])

    def get_pipeline_model_parallel_group(self):
        return self._pp

    def get_pipeline_model_parallel_world_size(self):
        return self.dims.pp


class _TestedOptimizer(logging.Filter):
    """DeepSpeed warns of "an untested optimizer" under ZeRO for torch's SGD (optim.name=sgd),
    which partrain holds to layout parity and exact resume (tests/integration/test_optimizers.py):
    on rank 0's stdout the warning would only alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


_TESTED_OPTIMIZER = _TestedOptimizer()


def _quiet_deepspeed() -> None:
    """DeepSpeed logs at INFO on every rank's stdout; rank 0's stdout is the progress display."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    logger.addFilter(_TESTED_OPTIMIZER)


@contextmanager
def _expert_parallel(model: nn.Module, expert_mesh):
    """Within the block, DeepSpeed sees this rank's expert slices as its expert parameters over
    partrain's ep groups: the engine built inside keeps them so (its optimizer's MoE groups)."""
    if expert_mesh is None:
        yield
        return
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.utils import groups

    from partrain.parallel.expert import moe_modules

    name = f"ep_size_{expert_mesh['ep'].size()}"
    for registry, dim in ((groups._EXPERT_PARALLEL_GROUP, "ep"),
                          (groups._EXPERT_DATA_PARALLEL_GROUP, "edp_cp")):
        registry[name] = expert_mesh[dim].get_group()
    for ranks, dim in ((groups._EXPERT_PARALLEL_GROUP_RANKS, "ep"),
                       (groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, "edp_cp")):
        ranks[name] = dist.get_process_group_ranks(expert_mesh[dim].get_group())
    for param in model.parameters():
        if getattr(param, "ep_sharded", False):
            param.allreduce, param.group_name = False, name
    # The engine finds MoE layers by DeepSpeed's class only; partrain's modules pass as it while
    # the engine is built (their groups exist already: nothing to set up).
    swapped = [(moe, type(moe)) for moe in moe_modules(model)]
    for moe, cls in swapped:
        moe.__class__ = type(cls.__name__, (cls, DeepSpeedMoE), {
            "num_experts": property(lambda self: self.n_experts),
            "set_deepspeed_parallelism": lambda self, *args, **kwargs: None})
    try:
        yield
    finally:
        for moe, cls in swapped:
            moe.__class__ = cls


def deepspeed_accelerator(device_type: str) -> None:
    """DeepSpeed picks its accelerator (and its ops' builders) when first imported: on CPU ranks,
    its CPU one; on GPU ranks its JIT-built ops (async_io for nvme, the offload's Adam) read
    TORCH_CUDA_ARCH_LIST, put in a form they parse (`ds_arch_list`)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Its CPU accelerator's device count is LOCAL_SIZE, which DeepSpeed's own launcher sets
        # to the ranks of the node; without it, it runs `numactl --hardware` to count NUMA nodes,
        # and ZeRO-3 asks at every gradient bucket's reduce (a fork of the rank each time: about
        # 0.9 s of a dp2 rank's 10 steps, py-spy).
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return
    given = os.environ.get("TORCH_CUDA_ARCH_LIST")
    parsed = ds_arch_list(given) if given else given
    if parsed != given:
        os.environ["TORCH_CUDA_ARCH_LIST"] = parsed
        logging.getLogger("partrain").info(
            "TORCH_CUDA_ARCH_LIST=%s: DeepSpeed's op builder reads no architecture suffix; "
            "its ops are built for %s", given, parsed)


# DeepSpeed's shared-memory all-reduce on CPU (its ShareMemCommBuilder's op).
SHM_COMM_OP = "deepspeed_shm_comm"


def without_inference_collective() -> None:
    """DeepSpeed's comm layer on CPU JIT-builds (about 20 s of compiling on 2 cores, the first time
    on a machine) and sets up at every start its shared-memory all-reduce, which only its inference
    path calls (`inference_all_reduce`); a training step reduces through torch.distributed. Marked
    incompatible in DeepSpeed's table of ops, it is neither built nor set up. (A DeepSpeed without
    that table builds it as before.)"""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible[SHM_COMM_OP] = False


_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")


def ds_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder parses it: the arch-specific and family
    suffixes dropped (`9.0a` -> `9.0`, `10.0f+PTX` -> `10.0+PTX`; DeepSpeed 0.19 stops on
    them with `invalid literal for int() ... '0a'`, and the PyTorch images for Hopper set
    `9.0a`). Its ops use nothing of sm_90a's own, and the sm_90 code runs there. Other entries are
    left as they are."""
    out = []
    for entry in value.replace(" ", ";").split(";"):
        found = _ARCH.fullmatch(entry.strip())
        out.append(f"{found[1]}.{found[2]}{found[3] or ''}" if found else entry.strip())
    return ";".join(e for e in out if e)


class OffloadUnavailable(Exception):
    """Offload to nvme that this machine cannot do (no libaio for DeepSpeed's async_io op, or an
    offload_nvme_path it cannot write); raised on every rank at once, before DeepSpeed starts
    (the launcher: exit 2, a setting this machine cannot run)."""


def check_nvme_offload(parallel_cfg, device_type: str, folder: Path) -> None:
    """Raise OffloadUnavailable on every rank when any rank's node cannot offload to nvme in
    `folder` (each rank tells the others, so that none goes on into DeepSpeed's collectives
    alone)."""
    if not on_nvme(parallel_cfg):
        return
    deepspeed_accelerator(device_type)
    try:
        problem = nvme_problem(parallel_cfg, folder)
    except Exception as err:  # noqa: BLE001 (whatever it is, the other ranks must hear of it)
        problem = f"{on_nvme(parallel_cfg)[0]}: checking this node failed: {err!r}"
    failed = torch.tensor([problem is not None], dtype=torch.int32, device=device_type)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise OffloadUnavailable(problem or "parallel.offload_nvme_path: a rank on another node "
                                 "cannot offload to nvme; its node's output says why")


def swap_in(ds_config: dict, folder: Path) -> dict:
    """The DeepSpeed config with its nvme offload pointed at the run's folder."""
    zero = ds_config["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key, {}).get("device") == "nvme":
            zero[key]["nvme_path"] = str(folder)
    logging.getLogger("partrain").info("offload to nvme: the swap files in %s", folder)
    return ds_config


def apply_zero(model: nn.Module, mesh, dims, ds_config: dict, param_groups: list[dict],
               expert_mesh=None):
    """Wrap `model` in a DeepSpeed engine; returns (engine, optimizer). `param_groups` are the
    optimizer's groups (weight decay on matrices only); the dp group comes from the mesh, the
    expert groups (under ep) from `expert_mesh`."""
    deepspeed_accelerator(mesh.device_type)
    import deepspeed

    _quiet_deepspeed()
    if mesh.device_type == "cpu":
        without_inference_collective()
    for param in model.parameters():
        # DeepSpeed's name for a tensor-parallel shard: its norm sums these over tp.
        if getattr(param, "tp_sharded", False):
            param.tensor_model_parallel = True
        # A tied embedding's copy on the last pipeline stage: counted once in the norm, on the
        # first stage (DeepSpeed's own name for a weight replicated across stages).
        if getattr(param, "tied_to", None):
            param.ds_pipe_replicated = True
    with _expert_parallel(model, expert_mesh):
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups, config=ds_config,
            mpu=MeshMPU(mesh, dims), dist_init_required=False)
    return engine, optimizer


# DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py): the scale, its iteration count,
# the last overflow's, and the overflows left before the next cut (hysteresis).
LOSS_SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class ZeroBackend:
    """zero_stage 1-3: DeepSpeed's engine accumulates in its backward and, in `engine.step()`,
    reduces over dp (and syncs sequence-parallel norms first, at stage 1), clips and steps; its
    norm is the one before clipping, summed over the replica (pp x tp).

    Divergence: DeepSpeed skips a step whose norm is not finite only on some of its paths (fp16's
    loss scaler; bf16 and fp32 depend on the version and `check_grad_overflow`), so the backend
    guards the step itself: the ZeRO optimizer calls its inner optimizer (torch's AdamW, Adam or
    SGD, or DeepSpeed's CPU Adam under offload) after it has computed the global norm, and that
    call is skipped when the loss or the norm is not finite. The fp32 master partitions are then
    copied back to the parameters unchanged. Which parameter broke: the gradients are partitioned
    and freed by DeepSpeed, so a hook on each parameter notes in backward whether its gradient
    was finite."""

    def __init__(self, engine, optimizer, sequence_parallel_group=None):
        self.model, self.optimizer = engine, optimizer
        self.module = engine.module
        self.sequence_parallel_group = sequence_parallel_group
        self.fp16 = engine.fp16_enabled()
        self.moes = [m for m in self.module.modules() if isinstance(m, MoE)]
        self._loss_finite, self._applied = True, False
        inner = optimizer.optimizer
        inner_step = inner.step

        def guarded_step(*args, **kwargs):
            norm = float(optimizer._global_grad_norm)
            if self._loss_finite and math.isfinite(norm) and norm >= 0:
                self._applied = True
                return inner_step(*args, **kwargs)
            return None

        inner.step = guarded_step
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._bad = torch.zeros(len(self.params), dtype=torch.bool,
                                device=next(self.module.parameters()).device)
        for i, param in enumerate(self.params):
            param.register_hook(partial(self._note, i))

    def _note(self, i: int, grad):
        self._bad[i].logical_or_(~torch.isfinite(grad).all())

    def no_sync(self, last: bool):
        return nullcontext()  # the engine reduces once, in step()

    def after_evaluation(self) -> None:
        pass  # DeepSpeed releases ZeRO-3's gathered weights after each module's forward

    def backward(self, loss) -> None:
        if self.fp16:  # the scale this backward multiplies the loss by reaches the MoE loss too
            scale = float(self.optimizer.loss_scale)
            for moe in self.moes:
                moe.loss_scale = scale
        self.model.backward(loss, scale_wrt_gas=False)

    def scaler_state(self) -> dict:
        """fp16's dynamic loss scale and the counters that move it, for a checkpoint's meta.json:
        a resume goes on at the scale the run had reached. Without it DeepSpeed started again at
        2^initial_scale_power and skipped steps (overflows) until it found the scale again, and
        grew it on another step than the uninterrupted run (its own checkpoints keep the
        scaler too). Empty without fp16."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if not self.fp16 or scaler is None:
            return {}
        return {"loss_scaler": {key: float(getattr(scaler, key)) if key == "cur_scale"
                                else int(getattr(scaler, key))
                                for key in LOSS_SCALER_KEYS if hasattr(scaler, key)}}

    def restore_scaler(self, meta: dict) -> None:
        """At a resume: the loss scaler as scaler_state() saved it."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        saved = meta.get("loss_scaler") or {}
        if not self.fp16 or scaler is None:
            return
        for key, value in saved.items():
            if key in LOSS_SCALER_KEYS and hasattr(scaler, key):
                setattr(scaler, key, value)

    def step(self, tracer, loss_finite: bool) -> Update:
        self._loss_finite, self._applied = loss_finite, False
        with tracer.span("zero: reduce, clip, step", "comm"):
            if self.sequence_parallel_group is not None:
                sync_sequence_parallel_grads(self.module, self.sequence_parallel_group)
            self.model.step()
        norm = float(self.model.get_global_grad_norm())
        update = Update(norm, applied=self._applied)
        if not update.applied:
            # fp16: an overflow with a finite loss is the loss scaler's to handle.
            update.scaler_skipped = self.fp16 and loss_finite
            bad = self._bad.nonzero()
            update.nonfinite = self.params[int(bad[-1])] if len(bad) else None  # backward's first
        self._bad.zero_()
        return update

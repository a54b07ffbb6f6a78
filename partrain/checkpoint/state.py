"""What a checkpoint holds, in the names of the single-process model, for every layout.

Keys (all tensors, so that DCP plans, de-duplicates and reshards them):

    model.<name>                  the fp32 weights (under ZeRO the master copy DeepSpeed keeps)
    optim.<name>.exp_avg          AdamW's (or Adam's) first moment, sharded like the weight
    optim.<name>.exp_avg_sq       its second moment
    optim.<name>.step             its step count for that parameter (a scalar)
    optim.<name>.momentum_buffer  SGD's instead: its momentum buffer (zeros with momentum 0)
    model.<buffer>                a persistent buffer (one module.state_dict() holds), as it is
    rng.rank<R>.cpu, .cuda        rank R's torch generator states (dropout), restored only onto
                                  the layout that saved them

A frozen parameter (requires_grad=False) is saved as its weight alone: no optimizer holds it.
Under ZeRO its value is the module's (DeepSpeed keeps no fp32 copy of it; ZeRO-3 gathers it).

The optimizer's state names are torch's (`optimizer.state[param]`), which DeepSpeed keeps too, so
one key name reaches both. A checkpoint's optimizer is its config's optim.name; a resume may not
change it (partrain.checkpoint.resume), so the keys a run loads are the ones its checkpoint holds.

<name> is the parameter's name in the model `build_model` makes (`layers.7.attention.wq.weight`):
the wrappers' prefixes (`module.` of DDP and DeepSpeed, `chunks.N.` of the pipeline) are dropped,
and pipeline stages keep the global block ids. A tied head is the embedding
(`tok_embeddings.weight`, no `output.weight`); under pp the last stage's copy is saved and loaded
under that name too (the two copies are equal, so DCP's de-duplication keeps one). A
tensor-parallel shard (`tp_shard_dim`) is saved as what it is, a slice of the full tensor: a
DTensor with a Shard placement on the tp mesh, so DCP records its global offset. Plain shards
under one name would be de-duplicated by DCP as if they were replicas, and the checkpoint would
load "fine" and be wrong. Replicated tensors (the same on every dp rank, or every tp rank for norm
gains) are written once.

Under FSDP2 (parallel.zero_backend=fsdp) the weights and moments already are DTensor shards over
dp x cp and go in as they are; a tp-split weight, which FSDP splits along its other dimension, is
re-described over FSDP's dims and tp so that its offsets place it in the full tensor.

Loading builds the same keys for the layout being loaded into, and DCP reads from every saved
shard the part each rank needs: that is resharding, for free. Under ZeRO the weights go into the
model before DeepSpeed partitions it, and the optimizer state through DeepSpeed's own per-parameter
helpers (deepspeed.utils.safe_set_full_*) afterwards.
"""

import errno
import logging
import re
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

from partrain.checkpoint import zero_state
from partrain.checkpoint.zero_state import local_shape
from partrain.parallel.dist import local

WRAPPER_PREFIX = re.compile(r"^(?:module\.|chunks\.\d+\.)+")
MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENTUM = ("momentum_buffer",)
AMSGRAD = ("max_exp_avg_sq",)

log = logging.getLogger("partrain")


@contextmanager
def said(what: str):
    """DCP reports a failed save or load as CheckpointException, a BaseException that torch's
    error recorder does not record (the launcher could only say "no Python error recorded"):
    turned into a RuntimeError saying `what` failed, on which ranks, and why."""
    try:
        yield
    except CheckpointException as err:
        raise RuntimeError(f"{what} failed: {describe(err)}") from None


def describe(err: CheckpointException) -> str:
    """Each failed rank's error in one line, and what to do about a full disk."""
    hint = (" (the file system is full: free space there, then relaunch to resume from the "
            "newest committed checkpoint)" if out_of_space(err) else "")
    return failures(err) + hint


def failures(err: BaseException) -> str:
    """Each failed rank's error (a CheckpointException's), ranks with the same error together:
    `ranks 0, 1: OSError: [Errno 28] No space left on device`."""
    if not isinstance(err, CheckpointException):
        return f"{type(err).__name__}: {err}"
    ranks: dict[str, list[int]] = {}
    for rank, (exc, _) in sorted(err.failures.items()):
        exc = _full_disk_error(exc) or exc
        ranks.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
    return "; ".join(f"rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}: {text}"
                     for text, found in ranks.items())


def out_of_space(err: BaseException) -> bool:
    """Whether `err` is a full file system or a used-up quota: any rank's failure of a
    CheckpointException, or an error it was raised from or while handling (torch.save's writer
    reports a full disk as a RuntimeError raised while handling the OSError)."""
    if isinstance(err, CheckpointException):
        return any(_full_disk_error(exc) for exc, _ in err.failures.values())
    return _full_disk_error(err) is not None


def _full_disk_error(err: BaseException | None) -> OSError | None:
    """The OSError saying the disk is full that `err` is or was raised from or while handling."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def canonical_name(name: str) -> str:
    """A wrapped model's parameter name as the single-process model has it."""
    return WRAPPER_PREFIX.sub("", name)


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's parameters (its tp shard of its pp stage) by canonical name; a pipeline
    stage's copy of a tied weight (`tied_to`) goes by the weight's own name."""
    params = {}
    for name, param in model.named_parameters():
        key = getattr(param, "tied_to", None) or canonical_name(name)
        if key in params:
            raise ValueError(f"two parameters map to the checkpoint name {key!r}")
        params[key] = param
    return params


def checkpointed_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers (those module.state_dict() holds: a MoE's expert bias, a user's
    counter or BatchNorm statistics), by canonical name, saved as `model.<name>` like a weight,
    without moments. Non-persistent ones (the rotary tables) are derived from the config and stay
    out. Buffers are never sharded: each pipeline stage holds its own, tp and dp ranks each a
    copy (DCP writes one)."""
    found = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                found[canonical_name(f"{prefix}.{name}" if prefix else name)] = buf
    return found


def trainable(params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """The parameters an optimizer holds: a frozen one (requires_grad=False) has no state."""
    return {name: param for name, param in params.items() if param.requires_grad}


def rng_keys(rank: int) -> dict[str, str]:
    """This rank's generator states in a checkpoint: torch's CPU one, and CUDA's where used."""
    return {"cpu": f"rng.rank{rank}.cpu", "cuda": f"rng.rank{rank}.cuda"}


def _rng_state() -> dict[str, torch.Tensor]:
    keys = rng_keys(_rank())
    state = {keys["cpu"]: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[keys["cuda"]] = torch.cuda.get_rng_state()
    return state


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def as_saved(local: torch.Tensor, param: nn.Parameter, tp_mesh) -> torch.Tensor:
    """`local` (this rank's tensor for `param`, or state shaped like it) as it goes into the
    checkpoint: a DTensor slice of the full tensor if the parameter is a tp shard, or an
    expert-parallel slice (dim 0 of stacked experts over its ep mesh)."""
    dim = getattr(param, "tp_shard_dim", None)
    if isinstance(local, DTensor):  # FSDP's shard over dp x cp, and a tp split besides
        return _fsdp_saved(local, dim, getattr(param, "saved_mesh", None),
                           experts=getattr(param, "ep_sharded", False))
    if getattr(param, "ep_sharded", False):
        dim, tp_mesh = 0, param.ep_mesh
    if dim is None or tp_mesh is None or tp_mesh.size() == 1:
        return local
    full = list(local.shape)
    full[dim] *= tp_mesh.size()
    return DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size(full), stride=torch.empty(full, device="meta").stride())


def _fsdp_saved(shard: DTensor, tp_dim: int | None, saved_mesh, experts: bool = False) -> DTensor:
    """An FSDP shard as the checkpoint records it: as it is, or, where tp splits the weight too,
    a DTensor over FSDP's dims and tp whose offsets place this rank's rectangle in the full tensor
    (FSDP splits the other dimension: partrain.parallel.fsdp.shard_dim). An expert slice
    (`experts`), which FSDP shards over the ranks holding the same experts, is recorded over
    (ep, those ranks): its experts split over ep first, then FSDP's split of a slice."""
    if saved_mesh is None or (tp_dim is None and not experts):
        return shard
    full = list(shard.shape)
    if experts:
        full[0] *= saved_mesh.shape[0]
        placements = [Shard(0), *shard.placements]
    else:
        full[tp_dim] *= saved_mesh.shape[-1]
        placements = [*shard.placements, Shard(tp_dim)]
    return DTensor.from_local(shard.to_local(), saved_mesh, placements, run_check=False,
                              shape=torch.Size(full), stride=torch.empty(full, device="meta").stride())


def _as_param(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """Loaded optimizer state shaped like `param`: a DTensor like FSDP's parameter, or a copy."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local(value).clone(), param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    return local(value).clone()


def _inner(optimizer):
    """The torch optimizer itself: DeepSpeed's ZeRO wraps it (`.optimizer`)."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def state_keys(optimizer) -> tuple[str, ...]:
    """The optimizer's per-parameter tensors a checkpoint holds, by torch's names: SGD's
    momentum buffer, or Adam's two moments (AdamW, Adam, DeepSpeed's CPU Adam), and with
    `amsgrad` (a DeepSpeed config's optimizer.params) the largest second moment so far."""
    inner = _inner(optimizer)
    if isinstance(inner, torch.optim.SGD):
        return MOMENTUM
    if any(group.get("amsgrad") for group in inner.param_groups):
        return MOMENTS + AMSGRAD
    return MOMENTS


def _counts_steps(optimizer) -> bool:
    """Whether the optimizer keeps a step count (Adam's bias correction; SGD has none)."""
    return not isinstance(_inner(optimizer), torch.optim.SGD)


def build_state(model: nn.Module, optimizer, tp_mesh, zero: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's state on this rank (collective under ZeRO: every dp rank calls it)."""
    state = {}
    keys, steps = state_keys(optimizer), _counts_steps(optimizer)
    params = named_parameters(model)
    if zero:
        from deepspeed.utils import (
            safe_get_full_fp32_param,
            safe_get_full_optimizer_state,
        )

        step, made = zero_state.step_count(optimizer), zero_state.has_state(optimizer)
        if made:
            zero_state.link_state(optimizer)
        on_disk = zero_state.gather_swapped(optimizer, params, keys if made else [])
        frozen = zero_state.frozen_weights(params)
    else:
        frozen = {name: param.detach() for name, param in params.items()
                  if not param.requires_grad}
    for name, weight in frozen.items():
        state[f"model.{name}"] = as_saved(weight, params[name], tp_mesh)
    for name, param in trainable(params).items():
        if zero:
            full = on_disk.get(name, {})
            weight = (full["weight"] if full else
                      safe_get_full_fp32_param(param)).reshape(local_shape(param))
            moments = {key: ((full[key] if full else safe_get_full_optimizer_state(param, key))
                             .reshape(local_shape(param)) if made
                             else torch.zeros(local_shape(param)))
                       for key in keys}
            param_step = step
        else:
            weight = param.detach()
            opt = optimizer.state.get(param, {})
            # SGD with momentum 0 keeps no buffer: zeros, which a momentum > 0 resume reads as
            # torch's fresh buffer (its first step then takes the gradient as it is).
            moments = {key: opt[key] if opt.get(key) is not None else torch.zeros_like(weight)
                       for key in keys}
            param_step = float(opt.get("step", 0))
        state[f"model.{name}"] = as_saved(weight, param, tp_mesh)
        for key, value in moments.items():
            state[f"optim.{name}.{key}"] = as_saved(value, param, tp_mesh)
        if steps:
            state[f"optim.{name}.step"] = torch.tensor(param_step, dtype=torch.float64)
    for name, buf in checkpointed_buffers(model).items():
        state[f"model.{name}"] = buf.detach().clone()
    state.update(_rng_state())
    return state


def _template(shapes: dict[str, tuple[nn.Parameter, torch.Size]], tp_mesh, keys) -> dict:
    state = {}
    for name, (param, shape) in shapes.items():
        for key in keys:
            if key == "step":
                state[f"optim.{name}.step"] = torch.zeros((), dtype=torch.float64)
            else:
                prefix = "model" if key == "weight" else "optim"
                suffix = "" if key == "weight" else f".{key}"
                zeros = torch.zeros_like(param) if isinstance(param, DTensor) else torch.zeros(shape)
                state[f"{prefix}.{name}{suffix}"] = as_saved(zeros, param, tp_mesh)
    return state


@torch.no_grad()
def load_weights(model: nn.Module, path, tp_mesh) -> None:
    """Fill this rank's parameters from the checkpoint at `path` (before DDP or ZeRO wrap them).
    Collective: every rank calls it."""
    params = named_parameters(model)
    state = _template({n: (p, p.shape) for n, p in params.items()}, tp_mesh, ["weight"])
    buffers = _saved_buffers(model, path)
    state.update({f"model.{name}": torch.zeros_like(buf) for name, buf in buffers.items()})
    with said(f"reading the weights of {path}"):
        dcp.load(state, checkpoint_id=path)
    for name, param in params.items():
        param.copy_(local(state[f"model.{name}"]))
    for name, buf in buffers.items():
        buf.copy_(state[f"model.{name}"])


def _saved_keys(path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _saved_buffers(model: nn.Module, path) -> dict[str, torch.Tensor]:
    """The model's persistent buffers that the checkpoint holds. One saved before partrain kept
    a user's buffers (only a MoE's expert bias) lacks the others: they keep the builder's value,
    and the log says so."""
    buffers, saved = checkpointed_buffers(model), _saved_keys(path)
    missing = [name for name in buffers if f"model.{name}" not in saved]
    if missing:
        log.warning("%s holds no %s (saved before partrain checkpointed a model's buffers): "
                    "they start from the model's own values", path, ", ".join(missing))
    return {name: buf for name, buf in buffers.items() if name not in missing}


def load_rng(path, same_layout: bool) -> bool:
    """Restore this rank's generator states from the checkpoint at `path` (not collective), when
    it was saved on this layout (`same_layout`: rank R then has rank R's role, so dropout draws
    what the uninterrupted run drew); True when restored. On another layout, or from a
    checkpoint without them, the generators stay as the start left them (seeded by train.seed)."""
    keys = rng_keys(_rank())
    saved = _saved_keys(path)
    if not same_layout or keys["cpu"] not in saved:
        return False
    state = {keys["cpu"]: torch.get_rng_state()}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized() and keys["cuda"] in saved
    if cuda:
        state[keys["cuda"]] = torch.cuda.get_rng_state()
    with said(f"reading the generator states of {path}"):
        dcp.load(state, checkpoint_id=path, no_dist=True)
    torch.set_rng_state(state[keys["cpu"]])
    if cuda:
        torch.cuda.set_rng_state(state[keys["cuda"]])
    return True


@torch.no_grad()
def load_optimizer(model: nn.Module, optimizer, path, tp_mesh, zero: bool) -> None:
    """Fill the optimizer's state (moments and step) from the checkpoint, after the optimizer (or
    DeepSpeed's engine) is built. Collective: every rank calls it. A frozen parameter has no
    optimizer state (its weight came with the model's, before the engine was built)."""
    params = trainable(named_parameters(model))
    shapes = {n: (p, local_shape(p)) for n, p in params.items()}
    moments, steps = state_keys(optimizer), _counts_steps(optimizer)
    keys = (["weight"] if zero else []) + [*moments] + (["step"] if steps else [])
    state = _template(shapes, tp_mesh, keys)
    with said(f"reading the optimizer state of {path}"):
        dcp.load(state, checkpoint_id=path)
    if not zero:
        for name, param in params.items():
            optimizer.state[param] = {
                **({"step": torch.tensor(float(state[f"optim.{name}.step"]), dtype=torch.float32)}
                   if steps else {}),
                **{key: _as_param(state[f"optim.{name}.{key}"], param) for key in moments}}
        return
    zero_state.load(optimizer, params, state, moments, steps)

"""DeepSpeed ZeRO's side of a checkpoint: where its fp32 master weights and its inner optimizer's
state live (flat partitions, per-parameter fragments, partitions swapped to nvme) and how a
checkpoint's per-parameter tensors are read out of them and written back.

partrain.checkpoint.state builds and loads the checkpoint's keys for every layout; under ZeRO it
calls these. DeepSpeed's own per-parameter helpers (deepspeed.utils.safe_get_full_* and
safe_set_full_*) do most of the work; what is here is what they lack: a step count, state that
the inner optimizer makes only at its first step, frozen parameters (no fp32 copy), and
partitions on nvme read in once rather than once per parameter and key.
"""

import torch
from torch import nn

from partrain.parallel.dist import local


def local_shape(param: nn.Parameter) -> torch.Size:
    """This rank's shape of the parameter (ZeRO-3 leaves the parameter empty: ds_shape)."""
    return getattr(param, "ds_shape", None) or param.shape


def _stage(optimizer) -> int:
    return 3 if hasattr(optimizer, "fp32_partitioned_groups_flat") else 2


def _flat_partitions(optimizer) -> list[torch.Tensor]:
    """DeepSpeed's flat fp32 partitions, the tensors its inner AdamW steps."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def _swapped(optimizer, group: int) -> bool:
    """Whether ZeRO-3 keeps this partition and its optimizer state on nvme (offload_optimizer=
    nvme; DeepSpeed keeps partitions too small to be worth it in memory)."""
    return (getattr(optimizer, "swap_optimizer", False)
            and optimizer._swappable_optimizer_subgroup(group))


def _swapped_params(optimizer, params: dict[str, nn.Parameter]) -> dict[int, list]:
    """The (name, parameter) pairs of each partition that ZeRO-3 keeps on nvme, by partition."""
    groups = {group: [] for group in range(len(_flat_partitions(optimizer)))
              if _swapped(optimizer, group)}
    for name, param in params.items():
        if groups and param.requires_grad:
            group = optimizer.grad_position[optimizer.get_param_id(param)][0]
            if group in groups:
                groups[group].append((name, param))
    return groups


def _fragment(optimizer, flat: torch.Tensor, param, key: str) -> torch.Tensor:
    """This rank's fragment of `param` in a ZeRO-3 fp32 partition read in (`key` "weight") or in
    one of its state tensors, where DeepSpeed's set_full_hp_param and get_full_hp_param find it."""
    _, offset, count = optimizer.grad_position[optimizer.get_param_id(param)]
    source = flat if key == "weight" else optimizer.optimizer.state[flat][key]
    return source.narrow(0, offset, count)


def _fill_fragment(optimizer, flat: torch.Tensor, param, values: dict) -> None:
    """What DeepSpeed's ZeRO-3 set_full_hp_param writes (this rank's slice of the full tensor,
    into the fp32 partition or one of its state tensors), for a partition already read in."""
    for key, value in values.items():
        target = _fragment(optimizer, flat, param, key)
        start = target.numel() * optimizer._get_param_partition_rank(param)
        target.copy_(value.flatten().narrow(0, start, target.numel()))


def gather_swapped(optimizer, params: dict[str, nn.Parameter], keys) -> dict[str, dict]:
    """Offloaded to nvme: the full fp32 weight and `keys` state of each parameter whose ZeRO-3
    partition is on disk, each partition read in once and left as it was on disk (DeepSpeed's
    helpers read the whole partition once per parameter and key: 38 s against 0.4 s to save a
    25M model at dp2). Collective over each parameter's partition group."""
    full = {}
    for group, members in _swapped_params(optimizer, params).items():
        optimizer._optimizer_states_and_gradient_swap_in(group)
        flat = _flat_partitions(optimizer)[group]
        for name, param in members:
            full[name] = {key: optimizer._fp32_state_allgather(
                param, _fragment(optimizer, flat, param, key)) for key in ["weight", *keys]}
        optimizer._release_swap_buffers(group)
    return full


def has_state(optimizer) -> bool:
    """Whether the inner optimizer has made its state (at its first step)."""
    inner = optimizer.optimizer
    return any(inner.state.get(flat) for flat in _flat_partitions(optimizer))


def step_count(optimizer) -> float:
    steps = [optimizer.optimizer.state[flat].get("step", 0)
             for flat in _flat_partitions(optimizer) if flat in optimizer.optimizer.state]
    return max((float(s) for s in steps), default=0.0)


def link_state(optimizer) -> None:
    """Point each parameter's DeepSpeed fragment at its part of the inner optimizer's state.

    ZeRO-1/2 link them once, after the first step of the first parameter group, when the inner
    AdamW has no state yet for the others (the no-decay group): their fragments stay empty and
    safe_get_full_optimizer_state fails. Linking again when every group has state fixes that;
    ZeRO-3 looks the state up at each call and needs nothing."""
    if _stage(optimizer) < 3:
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def frozen_weights(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """The frozen parameters' weights under ZeRO, which DeepSpeed's helpers do not give (no fp32
    master copy: None): the module's own tensor, gathered under ZeRO-3, which partitions frozen
    parameters too (collective over the dp group, so every rank gathers the same list). In fp32,
    as every weight is saved (the value the forward reads: bf16 where DeepSpeed made it so)."""
    frozen = {name: param for name, param in params.items() if not param.requires_grad}
    partitioned = [param for param in frozen.values() if hasattr(param, "ds_id")]
    if partitioned:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(partitioned, modifier_rank=None):
            return {name: param.detach().float().clone().reshape(local_shape(param))
                    for name, param in frozen.items()}
    return {name: param.detach().float().clone() for name, param in frozen.items()}


def load(optimizer, params: dict[str, nn.Parameter], state: dict, moments, steps: bool) -> None:
    """Write the checkpoint's weights and optimizer state read into `state` (keys as
    partrain.checkpoint.state names them) into DeepSpeed's fp32 partitions and its inner
    optimizer's state, after the engine is built. Collective over the dp group."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    # DeepSpeed's inner optimizer creates its state at the first step; make it now, then write
    # each parameter's fragment of it through DeepSpeed's helpers.
    step = max((float(state[f"optim.{name}.step"]) for name in params), default=0.0) \
        if steps else 0.0
    inner = optimizer.optimizer
    on_disk = _swapped_params(optimizer, params)
    for group, flat in enumerate(_flat_partitions(optimizer)):
        torch_made = (isinstance(inner, torch.optim.Optimizer)
                      and type(inner).__module__.startswith("torch"))
        value = torch.tensor(step, dtype=torch.float32) if torch_made else int(step)
        # Offloaded to nvme, a partition is on disk (an empty tensor here): read it in once, make
        # its state at its size, fill every parameter's fragment and write it all out (the
        # helpers below would read and write the whole partition once per parameter and key:
        # 126 s against 21 s to resume a 25M model at dp2).
        if group in on_disk:
            optimizer._optimizer_states_and_gradient_swap_in(group)
        inner.state[flat] = {**({"step": value} if steps else {}),
                             **{key: torch.zeros_like(flat) for key in moments}}
        if group in on_disk:
            for name, param in on_disk[group]:
                _fill_fragment(optimizer, flat, param, {
                    "weight": local(state[f"model.{name}"]),
                    **{key: local(state[f"optim.{name}.{key}"]) for key in moments}})
            optimizer._optimizer_states_and_gradient_swap_out(group)
    link_state(optimizer)
    filled = {name for members in on_disk.values() for name, _ in members}
    for name, param in params.items():
        if name in filled:
            continue
        safe_set_full_fp32_param(param, local(state[f"model.{name}"]))
        for key in moments:
            safe_set_full_optimizer_state(param, local(state[f"optim.{name}.{key}"]), key)

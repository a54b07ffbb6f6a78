"""train.float8: the transformer blocks' linear layers multiply in FP8, through torchao's float8
training (`convert_to_float8_training`: each nn.Linear becomes a Float8Linear that casts its
input, weight and output gradient to float8_e4m3 with a scale per tensor, `tensorwise`, or per
row, `rowwise`, and runs torch._scaled_mm; the weights, optimizer state and everything else stay
as they were). As torchtitan: the output head stays in bf16 (its vocabulary-wide logits are the
loss's precision), and so do the MoE routers and any layer whose sizes are not multiples of 16
(the FP8 kernels' rule; the tokens of a micro-batch too, which config validation checks).

FP8 matmuls need a GPU of compute capability 8.9 or later (Ada and Hopper: L40S, H100, H200);
elsewhere a run is refused on every rank (exit 2) unless train.float8_emulate asks torchao to
emulate them (for tests on CPU: the same casts and scales, a bf16/fp32 matmul)."""

import dataclasses

import torch
from torch import nn

MIN_CAPABILITY = (8, 9)
# Module names (their last part) left in bf16: partrain's head, a Hugging Face-style head (a
# user's model), the MoE routers.
SKIPPED = ("output", "lm_head", "router")


class Float8Unavailable(Exception):
    """train.float8 on hardware without FP8 matmuls or without torchao; raised on every rank at
    once (the launcher: exit 2, a setting this machine cannot run)."""


def check_float8(device_type: str, emulate: bool) -> None:
    """Refuse train.float8 on this rank's device (`device_type`, the mesh's; on CUDA the current
    device) without FP8 matmuls, unless emulated."""
    if emulate:
        return
    if device_type != "cuda":
        raise Float8Unavailable(
            f"train.float8=true needs GPUs with FP8 matmuls (compute capability 8.9+: H100, "
            f"H200, L40S); this run's device is {device_type} (train.float8_emulate=true "
            "emulates them, for tests only, at no gain)")
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise Float8Unavailable(
            f"train.float8=true needs GPUs with FP8 matmuls (compute capability 8.9+: H100, "
            f"H200, L40S); {name} has {capability[0]}.{capability[1]}. Train in bf16 "
            "(train.float8=false) on it")


def _keep(module: nn.Module, fqn: str) -> bool:
    if fqn.rsplit(".", 1)[-1] in SKIPPED or not isinstance(module, nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_linears(model: nn.Module) -> int:
    """How many of the model's linear layers (on this rank) multiply in FP8."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def apply_float8(model: nn.Module, recipe: str, emulate: bool) -> int:
    """Swap the linear layers for torchao's Float8Linear in place; returns how many."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise Float8Unavailable(
            f"train.float8=true needs torchao ({err}): pip install 'partrain[float8]'") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=_keep)
    return float8_linears(model)

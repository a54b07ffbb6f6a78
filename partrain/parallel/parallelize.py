"""The wrappers a worker applies to its model, in one order."""

import torch


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Set every transformer block of `model` to checkpoint in `mode` (partrain.models.arith.RECOMPUTE_MODES)."""
    from partrain.models.llama import TransformerBlock

    for module in model.modules():
        if isinstance(module, TransformerBlock):
            module.recompute = mode
    return model


def checkpointed_blocks(model: torch.nn.Module) -> int:
    """How many of `model`'s blocks (this rank's, under pp) checkpoint their activations."""
    return sum(getattr(m, "recompute", "none") != "none" for m in model.modules())


def compile_blocks(model: torch.nn.Module) -> int:
    """train.compile: torch.compile every transformer block of `model` in place (the modules stay
    the same objects, so wrappers that hold them see the compiled forward). A block's
    checkpointing is part of its compiled forward. Returns the number of blocks compiled."""
    from partrain.models.llama import TransformerBlock
    from partrain.models.moe import MoE

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        if isinstance(block.feed_forward, MoE) and block.recompute != "none":
            # Dynamo cannot trace the router's data-dependent dispatch inside a checkpoint: it
            # would run the whole block eagerly, its recomputation unmarked (the router would
            # count tokens twice). Such a block compiles its attention only.
            block.attention.compile()
        else:
            block.compile()
    return len(blocks)

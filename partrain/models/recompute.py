"""Activation checkpointing (train.activation_checkpointing): what a transformer block keeps for
its backward, traded against computing part of its forward again.

- none: every op keeps what its backward needs (the default).
- full: a block keeps only its input; backward runs the block's forward again first
  (`torch.utils.checkpoint`, non-reentrant).
- selective: per op, torch's selective activation checkpointing: the outputs of the matrix
  products and of attention are kept (the expensive ops), the cheap element-wise ones are computed
  again (the norms, rotary embedding, SiLU and the gate product, the router's softmax, the
  copies, gathers and scatters around collectives). This is torchtitan's op-level "selective"; it
  keeps more than Megatron's, whose selective mode drops the attention core's s x s scores:
  with a fused attention kernel those are never stored in the first place.

The same math either way: the recomputed ops see the same inputs, so gradients are identical.
Collectives inside a block (tp, cp, ep) run again in the recomputation; every rank of a group
recomputes the same blocks in the same order, so they match up. Forward side effects (the MoE
router's load and aux-loss accounting) check `recomputing()` and happen once.
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: matrix products (train.float8's too:
# torchao's Float8Linear multiplies with _scaled_mm) and attention kernels.
KEPT_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_mm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})

# The profiler's record_function markers are annotations, not computation: FSDP2's hooks emit
# them, and an expert FSDP unit inside a checkpointed MoE block (parallel/fsdp.py) emits them a
# different number of times in the recomputation than in the forward, which selective
# checkpointing's replay counts took for a changed computation ("invocation index 2 encountered
# during backward but not found in storage": ep x FSDP2 x selective failed at step 1). Ignored
# by it, as PyTorch itself does from pytorch/pytorch#196862 on.
_torch_checkpoint.SAC_IGNORED_OPS.update(
    op for op in (getattr(getattr(torch.ops.profiler, "_record_function_enter_new", None),
                          "default", None),
                  getattr(getattr(torch.ops.profiler, "_record_function_exit", None),
                          "_RecordFunction", None))
    if op is not None)

_recomputing = False


def recomputing() -> bool:
    """True while a block's forward runs again for its backward."""
    return _recomputing


@contextmanager
def _recomputation(inner=None):
    global _recomputing
    previous, _recomputing = _recomputing, True
    try:
        with inner or nullcontext():
            yield
    finally:
        _recomputing = previous


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _full_contexts():
    return nullcontext(), _recomputation()


def _selective_contexts():
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    return forward, _recomputation(recompute)


def _compiled_selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def run_block(forward, mode: str, *args):
    """`forward(*args)` under the block's checkpointing `mode` (only while gradients are on)."""
    if mode == "none" or not torch.is_grad_enabled():
        return forward(*args)
    if torch.compiler.is_compiling():
        # train.compile: the recomputation becomes part of the compiled backward graph, so no
        # forward side effect runs twice, and torch.compile takes only dispatch modes here.
        if mode == "full":
            return checkpoint(forward, *args, use_reentrant=False)
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=_compiled_selective_contexts)
    contexts = _full_contexts if mode == "full" else _selective_contexts
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts)

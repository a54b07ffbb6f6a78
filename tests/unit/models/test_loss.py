"""models/loss.py's chunked cross-entropy against torch's F.cross_entropy on fp32 logits: the
same loss and gradients at any chunk size, in fp32 and bf16, and what it keeps for the backward
(the logits in their own dtype, never a full-vocabulary fp32 tensor)."""

import pytest
import torch
import torch.nn.functional as F

from partrain.models.loss import cross_entropy


def _both(dtype, chunk_elements, tokens=(3, 50), vocab=300):
    torch.manual_seed(0)
    logits = (4 * torch.randn(*tokens, vocab)).to(dtype)
    target = torch.randint(0, vocab, tokens)
    ours = logits.clone().requires_grad_()
    loss = cross_entropy(ours, target, chunk_elements=chunk_elements)
    loss.backward()
    theirs = logits.clone().requires_grad_()
    ref = F.cross_entropy(theirs.flatten(0, 1).float(), target.flatten())
    ref.backward()
    return loss, ref, ours.grad, theirs.grad


@pytest.mark.parametrize("chunk_tokens", [1, 7, 150, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_loss_and_gradient_at_any_chunk(dtype, chunk_tokens):
    loss, ref, grad, ref_grad = _both(dtype, chunk_tokens * 300)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    assert grad.dtype == dtype
    gap = ((grad.float() - ref_grad.float()).abs().max() / ref_grad.float().abs().max()).item()
    # fp32: the same math in another order; bf16: both round the same fp32 gradient once
    assert gap <= (1e-6 if dtype == torch.float32 else 1e-2), gap


def test_it_keeps_the_logits_in_their_dtype_and_no_fp32_vocabulary_tensor():
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (n,))

    def saved_by(fn):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            fn()
        return kept

    ours = saved_by(lambda: cross_entropy(logits, target, chunk_elements=8 * vocab))
    theirs = saved_by(lambda: F.cross_entropy(logits.float(), target))
    full_fp32 = [t for t in ours if t.dtype == torch.float32 and t.numel() >= n * vocab]
    assert not full_fp32, [t.shape for t in full_fp32]
    assert any(t.dtype == torch.bfloat16 and t.numel() == n * vocab for t in ours)
    # torch's own keeps the fp32 log-probabilities of every token: what this saves
    assert any(t.dtype == torch.float32 and t.numel() == n * vocab for t in theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_loss_is_the_same_loss_and_gradient(dtype):
    """train.compile's loss (torch.compile of the plain fp32 cross-entropy) against the chunked
    one: the same value, and the gradient in the logits' dtype."""
    from partrain.models.loss import compiled_cross_entropy

    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 50, 300)).to(dtype)
    target = torch.randint(0, 300, (3, 50))
    results = []
    for fn in (cross_entropy, compiled_cross_entropy()):
        leaf = logits.clone().requires_grad_()
        loss = fn(leaf, target)
        loss.backward()
        results.append((loss, leaf.grad))
    (loss, grad), (compiled, compiled_grad) = results
    assert compiled.dtype == torch.float32 and compiled_grad.dtype == dtype
    assert abs(compiled.item() - loss.item()) <= 1e-6 * loss.item()
    gap = ((compiled_grad.float() - grad.float()).abs().max() / grad.float().abs().max()).item()
    assert gap <= (1e-6 if dtype == torch.float32 else 1e-2), gap
    assert compiled_cross_entropy() is compiled_cross_entropy()  # one compiled function

"""What the cp ring hands torch's CUDA memory-efficient attention kernel (parallel/context.py):
(batch, seq, heads, dim) memory, and a log-sum-exp padded to the kernel's 32-query tiles. The
kernel itself runs only on a GPU (scripts/check_cp_fused.py); these hold the layout contract."""

import math

import torch

from partrain.parallel.context import _bshd, _lse_padded


def seq_major(x: torch.Tensor) -> bool:
    b, h, s, d = x.shape
    return x.stride(3) == 1 and x.stride(1) == d and x.stride(2) == h * d


def test_heads_first_memory_is_laid_out_seq_major_with_the_same_values():
    x = torch.randn(2, 4, 40, 8)  # (batch, heads, seq, dim), heads-first contiguous
    assert not seq_major(x)
    y = _bshd(x)
    assert seq_major(y) and torch.equal(y, x) and y.shape == x.shape


def test_a_slice_of_a_laid_out_tensor_is_not_copied():
    laid = _bshd(torch.randn(2, 4, 40, 8))
    block = laid[:, :, 8:24]  # one zigzag chunk: a sequence slice
    assert _bshd(block).data_ptr() == block.data_ptr()
    # A slice of heads-first memory is copied into the layout.
    heads_first = torch.randn(2, 4, 40, 8)[:, :, 8:24]
    assert seq_major(_bshd(heads_first))


def test_the_log_sum_exp_is_padded_to_whole_tiles_with_inf():
    lse = torch.randn(2, 4, 80)  # a chunk of 80 queries: 16 short of 3 tiles
    padded = _lse_padded(lse)
    assert padded.shape == (2, 4, 96) and padded.is_contiguous()
    assert torch.equal(padded[..., :80], lse) and (padded[..., 80:] == math.inf).all()
    whole = torch.randn(2, 4, 64)
    assert torch.equal(_lse_padded(whole), whole)

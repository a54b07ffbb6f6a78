"""Data batches: the global batch of a step depends only on (seed, step); dp ranks and
micro-batches slice it without changing it."""

import numpy as np
import pytest
import torch

from partrain.data.batches import global_batch_rows, rank_micro_batches

SEQ_LEN = 32
GLOBAL = 16


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(123).integers(0, 256, size=5000).astype(np.uint8)


def test_global_batch_rows_deterministic_for_seed_and_step():
    a = global_batch_rows(10_000, 5, 16, 64, seed=1)
    b = global_batch_rows(10_000, 5, 16, 64, seed=1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (16,)


def test_global_batch_rows_differ_across_steps_seeds_and_splits():
    base = global_batch_rows(10_000, 5, 16, 64, seed=1)
    assert not np.array_equal(base, global_batch_rows(10_000, 6, 16, 64, seed=1))
    assert not np.array_equal(base, global_batch_rows(10_000, 5, 16, 64, seed=2))
    assert not np.array_equal(base, global_batch_rows(10_000, 5, 16, 64, seed=1, split="val"))


def test_global_batch_rows_stay_in_bounds():
    n, seq = 300, 100
    starts = np.concatenate([global_batch_rows(n, s, 64, seq, seed=0) for s in range(20)])
    assert starts.min() >= 0
    assert starts.max() + seq + 1 <= n
    # The last possible window is reachable (endpoint inclusive) over many draws.
    assert starts.max() == n - seq - 1
    # Exactly seq_len + 1 tokens: only one window fits.
    assert set(global_batch_rows(seq + 1, 0, 8, seq, seed=0)) == {0}


def _whole(tokens, step, dp, micro_batch_size, seed=0, split="train"):
    """Concatenate every dp rank's micro-batches in (dp rank, micro-batch) order."""
    xs, ys, shapes = [], [], []
    for dp_rank in range(dp):
        micro = rank_micro_batches(tokens, step, global_batch_size=GLOBAL,
                                   micro_batch_size=micro_batch_size, dp=dp, dp_rank=dp_rank,
                                   seq_len=SEQ_LEN, seed=seed, split=split)
        assert len(micro) == GLOBAL // (dp * micro_batch_size)
        for x, y in micro:
            shapes.append(tuple(x.shape))
            xs.append(x)
            ys.append(y)
    assert set(shapes) == {(micro_batch_size, SEQ_LEN)}
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("dp, micro_batch_size", [
    (1, 4), (1, 1), (2, 8), (2, 2), (4, 4), (4, 1), (8, 2), (16, 1),
])
@pytest.mark.parametrize("step", [1, 7])
def test_every_split_sees_the_same_global_batch(tokens, dp, micro_batch_size, step):
    ref_x, ref_y = _whole(tokens, step, dp=1, micro_batch_size=GLOBAL)
    x, y = _whole(tokens, step, dp, micro_batch_size)
    assert torch.equal(x, ref_x)
    assert torch.equal(y, ref_y)


def test_batch_is_the_windows_at_the_drawn_starts(tokens):
    starts = global_batch_rows(len(tokens), 3, GLOBAL, SEQ_LEN, seed=0)
    (x, y), = rank_micro_batches(tokens, 3, global_batch_size=GLOBAL, micro_batch_size=GLOBAL,
                                 dp=1, dp_rank=0, seq_len=SEQ_LEN, seed=0)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    for row, s in enumerate(starts):
        np.testing.assert_array_equal(x[row].numpy(), tokens[s:s + SEQ_LEN])
        np.testing.assert_array_equal(y[row].numpy(), tokens[s + 1:s + SEQ_LEN + 1])


def test_targets_are_inputs_shifted_by_one(tokens):
    for x, y in rank_micro_batches(tokens, 2, global_batch_size=GLOBAL, micro_batch_size=4, dp=2,
                                   dp_rank=1, seq_len=SEQ_LEN, seed=0):
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_dp_ranks_get_disjoint_slices(tokens):
    a = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=8, dp=2,
                           dp_rank=0, seq_len=SEQ_LEN, seed=0)
    b = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=8, dp=2,
                           dp_rank=1, seq_len=SEQ_LEN, seed=0)
    assert not torch.equal(a[0][0], b[0][0])


def test_steps_and_splits_give_different_batches(tokens):
    one, = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1,
                              dp_rank=0, seq_len=SEQ_LEN, seed=0)
    two, = rank_micro_batches(tokens, 2, global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1,
                              dp_rank=0, seq_len=SEQ_LEN, seed=0)
    val, = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1,
                              dp_rank=0, seq_len=SEQ_LEN, seed=0, split="val")
    assert not torch.equal(one[0], two[0])
    assert not torch.equal(one[0], val[0])

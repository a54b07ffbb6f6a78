"""The batches of each step: the same global batch for every layout, sliced by dp rank.

Step s's global batch is `global_batch_size` windows of seq_len + 1 tokens whose start offsets
come from a generator seeded by (seed, split, s). Rank r of dp takes rows [r*n, (r+1)*n), cut into
micro-batches in order: the rows a layout trains on never depend on dp, micro_batches or pp.
"""

import numpy as np
import torch

_SPLIT_IDS = {"train": 0, "val": 1}


def global_batch_rows(n_tokens: int, step: int, global_batch_size: int, seq_len: int, seed: int,
                      split: str = "train") -> np.ndarray:
    """Start offsets of the global batch's sequences for one step."""
    rng = np.random.default_rng([seed, _SPLIT_IDS[split], step])
    return rng.integers(0, n_tokens - seq_len - 1, size=global_batch_size, endpoint=True)


def rank_micro_batches(tokens: np.ndarray, step: int, *, global_batch_size: int,
                       micro_batch_size: int, dp: int, dp_rank: int, seq_len: int, seed: int,
                       split: str = "train") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's micro-batches of step `step`: (inputs, targets), each (micro_batch_size, seq_len)."""
    starts = global_batch_rows(len(tokens), step, global_batch_size, seq_len, seed, split)
    per_rank = global_batch_size // dp
    mine = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    windows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in mine])
    windows = torch.from_numpy(windows)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(micro_batch_size)]

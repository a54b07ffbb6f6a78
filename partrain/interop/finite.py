"""Weights that come from outside a run are finite numbers, or they are refused where they are read.

A nan or inf in a starting weight trains to nan from the first step; in an export it is a model
that computes nothing; in `sample` it prints half a line before it fails. Each tensor is checked
as the model holds it (float32): a float64 value beyond float32's range becomes inf there.
"""

import torch

HELD_AS = torch.float32  # the dtype partrain's parameters are kept in
# At most this many values are read and checked at once, so that a large embedding is not
# copied whole: 16M values, 64 MB as float32.
CHUNK_VALUES = 1 << 24


def non_finite(values: torch.Tensor, offset: int = 0) -> str | None:
    """None if every value is finite as float32; else how many are not, and the first of them
    (its index, `offset` added to the first dimension, and its value as stored)."""
    held = values.to(HELD_AS)
    bad = ~torch.isfinite(held)
    count = int(bad.sum())
    if not count:
        return None
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())  # not nonzero(): all of them, as int64
    first = []
    for size in reversed(bad.shape):
        flat, i = divmod(flat, size)
        first.insert(0, i)
    stored = values[tuple(first)].item()
    if first:
        first[0] += offset
    where = f"[{', '.join(map(str, first))}]"
    beyond = (", beyond float32's range (+-3.4e38), in which partrain holds weights"
              if torch.isfinite(torch.tensor(stored, dtype=torch.float64)) else "")
    return f"{count:,} value(s) that are not finite numbers (first {stored!r} at {where}{beyond})"


def chunks(rows: int, row_values: int, most: int = CHUNK_VALUES):
    """Row ranges [start, stop) of at most `most` values each (a row bigger than that alone)."""
    step = max(1, most // max(1, row_values))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)

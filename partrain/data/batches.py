"""The batches of each step: the same global batch for every layout, sliced by dp rank.

Step s's global batch is `global_batch_size` windows of seq_len + 1 tokens. By default
(data.sampling=random) their start offsets come from a generator seeded by (seed, split, s);
data.sampling=epochs and data.blend choose them otherwise (sampler.py), always from (seed, s)
alone. Rank r of dp takes rows [r*n, (r+1)*n), cut into micro-batches in order: the rows a
layout trains on never depend on dp, micro_batches or pp.

With train.document_masking each micro-batch also carries its rows' document ids (inputs,
targets, documents): the document of each input token, counted from the row's first, from the
source's document index (tokens.py), so a row's mask depends on the row alone.
"""

import numpy as np
import torch

from partrain.data.sampler import global_batch_rows


def rank_micro_batches(tokens: np.ndarray, step: int, *, global_batch_size: int,
                       micro_batch_size: int, dp: int, dp_rank: int, seq_len: int, seed: int,
                       split: str = "train") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's micro-batches of step `step`: (inputs, targets), each (micro_batch_size, seq_len)."""
    starts = global_batch_rows(len(tokens), step, global_batch_size, seq_len, seed, split)
    return _cut([tokens], np.zeros(len(starts), dtype=np.int64), starts, seq_len,
                micro_batch_size, dp, dp_rank)


def sampler_micro_batches(sampler, step: int, *, micro_batch_size: int, dp: int,
                          dp_rank: int, documents: bool = False) -> list[tuple]:
    """Like rank_micro_batches, for the rows a sampler (sampler.py) chose for step `step`; with
    `documents`, each micro-batch is (inputs, targets, document ids) from the sampler's
    document indexes (`sampler.docs`)."""
    sources, starts = sampler.rows(step)
    return _cut(sampler.streams, sources, starts, sampler.seq_len, micro_batch_size, dp, dp_rank,
                sampler.docs if documents else None)


def document_ids(doc_starts: np.ndarray, start: int, seq_len: int) -> np.ndarray:
    """The document of each of the seq_len tokens from `start`, counted from the first one's
    (0, 0, 1, 1, 1, 2, ...), by the index of document starts (ascending, from 0)."""
    positions = np.arange(start, start + seq_len)
    ids = np.searchsorted(doc_starts, positions, side="right")
    return (ids - ids[0]).astype(np.int32)


def _cut(streams: list, sources: np.ndarray, starts: np.ndarray, seq_len: int,
         micro_batch_size: int, dp: int, dp_rank: int, docs: list | None = None) -> list[tuple]:
    """This dp rank's slice of the global batch's rows, read and cut into micro-batches; with
    `docs` (each stream's document starts), each row's document ids as well."""
    per_rank = len(starts) // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    rows = list(zip(sources[mine].tolist(), starts[mine].tolist()))
    windows = torch.from_numpy(np.stack([np.asarray(streams[k][s:s + seq_len + 1], dtype=np.int64)
                                         for k, s in rows]))
    if docs is None:
        return [(w[:, :-1], w[:, 1:]) for w in windows.split(micro_batch_size)]
    ids = torch.from_numpy(np.stack([document_ids(docs[k], s, seq_len) for k, s in rows]))
    return [(w[:, :-1], w[:, 1:], d) for w, d in zip(windows.split(micro_batch_size),
                                                      ids.split(micro_batch_size))]

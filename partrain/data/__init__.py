"""Data: token streams (the embedded stdlib corpus or a prepared token dir) and the batches
cut from them. The global batch of step s depends only on the seed and s; dp rank r takes its
slice, so every layout sees the same sequences."""

from partrain.data.batches import global_batch_rows, rank_micro_batches
from partrain.data.prepare import prepare_token_dir
from partrain.data.tokens import TokenSplits, check_data, load_tokens

__all__ = ["global_batch_rows", "rank_micro_batches", "TokenSplits", "check_data", "load_tokens",
           "prepare_token_dir"]

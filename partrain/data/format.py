"""The token-dir contract shared by `partrain data prepare` (which writes it) and the loader
(which reads it): the format tag in meta.json, the token dtypes, and the vocabulary a token id must
fall in."""


FORMAT = "partrain-tokens/1"


DTYPES = ("uint8", "uint16", "uint32")


def vocab_to_use(vocab_size: int, tp: int = 1) -> int:
    """model.vocab_size for a tokenizer of `vocab_size` tokens: rounded up to a multiple of
    128 * tp, as Megatron pads it (tp shards of whole 128-row blocks)."""
    step = 128 * tp
    return -(-vocab_size // step) * step

"""The token-dir contract shared by `partrain data prepare` (which writes it) and the loader
(which reads it): the format tags in meta.json, the file names, the token dtypes, and the
vocabulary a token id must fall in.

A token dir of format 2 (what `data prepare` writes):

    meta.json                        {"format": "partrain-tokens/2", "dtype", "vocab_size", ...}
    train-00000.bin, train-00001.bin the train split's ids, raw little-endian `dtype`, in order;
                                     `train_shards` in meta.json lists the ids in each file
    train.idx.npy                    the documents' start offsets in the split: int64, sorted,
                                     the first 0 (numpy's .npy format)
    val-00000.bin, ..., val.idx.npy  the same for the val split
    tokenizer.json, tokenizer_config.json    with `"tokenizer": "tokenizer.json"`

Each split reads as the concatenation of its shard files; offsets in the index are into that
concatenation. A document may run across shard files, and the val split's first document may be
the end of the train split's last one (a --val-fraction cut falls anywhere).

Format 1 (`partrain-tokens/1`, still read) is `train.bin`, `val.bin` and `meta.json`, with no index.
"""


FORMAT = "partrain-tokens/2"
FORMAT_V1 = "partrain-tokens/1"
FORMATS = (FORMAT_V1, FORMAT)
SPLITS = ("train", "val")
DTYPES = ("uint8", "uint16", "uint32")
INDEX_DTYPE = "<i8"  # document start offsets, as Megatron's indexed datasets keep them
SHARD_MB = 1024  # `data prepare --shard-mb`: MiB of ids per shard file at most


def shard_name(split: str, number: int) -> str:
    """The file of a split's `number`-th shard (from 0) in a format 2 token dir."""
    return f"{split}-{number:05d}.bin"


def index_name(split: str) -> str:
    """The file of a split's document start offsets in a format 2 token dir."""
    return f"{split}.idx.npy"


def vocab_to_use(vocab_size: int, tp: int = 1) -> int:
    """model.vocab_size for a tokenizer of `vocab_size` tokens: rounded up to a multiple of
    128 * tp, as Megatron pads it (tp shards of whole 128-row blocks)."""
    step = 128 * tp
    return -(-vocab_size // step) * step

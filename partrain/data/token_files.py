"""A token dir's files, read and checked before any process starts (tokens.py loads them):
meta.json against the file sizes and the dtype's range, the shard files of each split, the
document index's ends and a bounded sample of its order, the ids against a bounded sample
(`sample_max_token_id`), and a format 1 split's documents found by a scan for its end-of-text
id. A dir whose meta.json lies is refused here rather than failing later on a rank with an
IndexError in the embedding.
"""

import json
import math
from pathlib import Path

import numpy as np

from partrain.config.paths import what_is
from partrain.data.format import (
    DTYPES,
    FORMAT_V1,
    FORMATS,
    INDEX_DTYPE,
    SPLITS,
    index_name,
    shard_name,
)
from partrain.data.tokenizer import TOKENIZER_FILE
from partrain.errors import ConfigError, reason

# The ids of a split are checked over at most SAMPLE_BLOCKS contiguous blocks of SAMPLE_BLOCK
# ids, spread evenly from the first id to the last: at most 256 Ki ids (1 MiB of uint32) and 64
# seeks per split, whatever the file's size. Contiguous blocks read whole pages, where single
# strided ids would each fault in a page of their own. A split that fits in the sample is read
# whole, so the check is exact for it.
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK = 4096
# A meta.json is a few hundred bytes; a bigger one is the wrong file, and is not read whole.
META_MAX_BYTES = 16 << 20
SCAN_CHUNK = 1 << 24  # ids read at a time when a format 1 split is scanned for its documents


def json_kind(value) -> str:
    """What a JSON value is, in the file's own terms, for messages about a value of a wrong type."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a non-finite number" if not math.isfinite(value) else "a decimal number"
    return {str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), type(value).__name__)


def is_int(value) -> bool:
    # bool is an int in Python, but `"vocab_size": true` is not a vocabulary size.
    return isinstance(value, int) and not isinstance(value, bool)


def regular_file(path: Path, file: Path, name: str) -> None:
    """Refuse a split file or meta.json that is a directory, a pipe or a device, a symlink loop
    or a dangling link (a missing one is left to the caller, which says what it expected)."""
    found = what_is(file)
    if found == "is a directory":
        raise ConfigError(f"data.path={path}: {name} is a directory, not a file")
    if found not in ("is a regular file", "does not exist"):
        raise ConfigError(f"data.path={path}: {name} {found}")


def read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if what_is(meta_path) == "does not exist":
        raise ConfigError(
            f"data.path={path}: no meta.json there; make a token dir with "
            "`partrain data prepare FILES... --out DIR`")
    regular_file(path, meta_path, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            raw = f.read(META_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"data.path={path}: meta.json cannot be read: {reason(e)}") from None
    if len(raw) > META_MAX_BYTES:
        raise ConfigError(
            f"data.path={path}: meta.json is over {META_MAX_BYTES >> 20} MiB; a token dir's "
            "meta.json is a small JSON object, is this the right file?")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is harmless
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"data.path={path}: meta.json is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
            f"{e.start}); it must be JSON in UTF-8") from None
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"data.path={path}: meta.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        raise ConfigError(
            f"data.path={path}: meta.json format is {meta.get('format') if isinstance(meta, dict) else meta!r}, "
            f"expected {' or '.join(map(repr, reversed(FORMATS)))}")
    if meta.get("dtype") not in DTYPES:
        raise ConfigError(
            f"data.path={path}: meta.json dtype={meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(meta.get("tokenizer"), str):
        raise ConfigError(
            f"data.path={path}: meta.json tokenizer={meta.get('tokenizer')!r} must be a string "
            "naming the tokenizer (e.g. \"bytes\")")
    if meta["tokenizer"] == TOKENIZER_FILE and not (path / TOKENIZER_FILE).is_file():
        raise ConfigError(f"data.path={path}: meta.json names tokenizer={TOKENIZER_FILE!r}, but "
                          f"there is no {TOKENIZER_FILE} beside it (`data prepare --tokenizer` "
                          "copies it there)")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        value = meta.get(key)
        if not is_int(value):
            raise ConfigError(f"data.path={path}: meta.json {key}={value!r} must be a positive "
                              f"integer, not {json_kind(value)}")
        if value < 1:
            raise ConfigError(f"data.path={path}: meta.json {key}={value!r} must be a positive integer")
    dtype = np.dtype(meta["dtype"])
    ids = int(np.iinfo(dtype).max) + 1
    if meta["vocab_size"] > ids:
        fits = next((d for d in DTYPES if np.iinfo(d).max + 1 >= meta["vocab_size"]), None)
        raise ConfigError(
            f"data.path={path}: meta.json vocab_size={meta['vocab_size']} does not fit "
            f"dtype={meta['dtype']}, which holds ids 0..{ids - 1} (vocab_size <= {ids})"
            + (f"; ids of this vocabulary need {fits}" if fits else ""))
    if "max_token_id" in meta:
        value = meta["max_token_id"]
        if not is_int(value) or value < 0:
            raise ConfigError(
                f"data.path={path}: meta.json max_token_id={value!r} must be a non-negative "
                "integer" + ("" if is_int(value) else f", not {json_kind(value)}"))
        if value >= meta["vocab_size"]:
            raise ConfigError(
                f"data.path={path}: meta.json max_token_id={value} is not below vocab_size="
                f"{meta['vocab_size']}; every token id must be < vocab_size")
    for split, files in split_files(path, meta).items():
        for name, tokens in files:
            file = path / name
            regular_file(path, file, name)
            expected = tokens * dtype.itemsize
            try:
                size = file.stat().st_size if file.is_file() else None
            except OSError as e:
                raise ConfigError(f"data.path={path}: {name} cannot be read: "
                                  f"{reason(e)}") from None
            if size is None and meta["format"] == FORMAT_V1:
                raise ConfigError(f"data.path={path}: {split}.bin is missing; a token dir holds "
                                  "train.bin, val.bin and meta.json")
            if size is None:
                raise ConfigError(
                    f"data.path={path}: {name} is missing; meta.json {split}_shards lists "
                    f"{len(files)} shard file(s), {files[0][0]} to {files[-1][0]}")
            if size != expected:
                raise ConfigError(
                    f"data.path={path}: {name} has {size:,} bytes, but meta.json says "
                    f"{tokens:,} tokens of {meta['dtype']} = {expected:,} bytes")
        if meta["format"] != FORMAT_V1:
            index = path / index_name(split)
            regular_file(path, index, index_name(split))
            if not index.is_file():
                raise ConfigError(f"data.path={path}: {index_name(split)} is missing; a token dir "
                                  f"of format {meta['format']} holds the {split} split's document "
                                  "index")
    return meta


def split_files(path: Path, meta: dict) -> dict[str, list[tuple[str, int]]]:
    """Each split's files and the ids in each, as meta.json says: format 1's {split}.bin, format
    2's shard files."""
    if meta["format"] == FORMAT_V1:
        return {split: [(f"{split}.bin", meta[f"{split}_tokens"])] for split in SPLITS}
    files = {}
    for split in SPLITS:
        key, shards = f"{split}_shards", meta.get(f"{split}_shards")
        if not isinstance(shards, list) or not shards or \
                not all(is_int(n) and n >= 1 for n in shards):
            raise ConfigError(
                f"data.path={path}: meta.json {key}={shards!r:.80} must be a non-empty list of "
                f"positive integers: the ids in each of {shard_name(split, 0)}, ...")
        if sum(shards) != meta[f"{split}_tokens"]:
            raise ConfigError(
                f"data.path={path}: meta.json {key} adds up to {sum(shards):,} ids, but "
                f"{split}_tokens={meta[f'{split}_tokens']:,}")
        files[split] = [(shard_name(split, number), n) for number, n in enumerate(shards)]
    return files


def sample_max_token_id(tokens: np.ndarray) -> tuple[int, int]:
    """(largest id, its index) over a bounded sample of `tokens`: SAMPLE_BLOCKS contiguous blocks
    of SAMPLE_BLOCK ids spread evenly over the array, first and last ids included; the whole
    array when it is no longer than the sample. Reads at most SAMPLE_BLOCKS * SAMPLE_BLOCK ids."""
    n = len(tokens)
    if n <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
        starts, block = [0], n
    else:
        starts, block = np.linspace(0, n - SAMPLE_BLOCK, SAMPLE_BLOCKS).astype(np.int64), SAMPLE_BLOCK
    best, where = -1, -1
    for start in starts:
        chunk = np.asarray(tokens[int(start):int(start) + block])
        i = int(chunk.argmax())
        if int(chunk[i]) > best:
            best, where = int(chunk[i]), int(start) + i
    return best, where


def check_token_ids(path: Path, meta: dict, splits: dict, files: dict) -> None:
    """The sampled ids against meta.json: a wrong dtype reads the bytes as other ids, and an id
    at or above vocab_size would index past the model's embedding."""
    recorded = meta.get("max_token_id")
    for split, tokens in splits.items():
        try:
            top, where = sample_max_token_id(tokens)
        except OSError as e:
            raise ConfigError(f"data.path={path}: the {split} split's files cannot be read: "
                              f"{reason(e)}") from None
        name, at = _file_at(files[split], where)
        found = f"{name} holds token id {top} ({at})"
        if recorded is not None and top > recorded:
            raise ConfigError(
                f"data.path={path}: {found}, above meta.json max_token_id={recorded}; every id "
                "must be <= max_token_id, so meta.json does not describe these bytes (is "
                f"dtype={meta['dtype']} right?)")
        if top >= meta["vocab_size"]:
            raise ConfigError(
                f"data.path={path}: {found}, not below meta.json vocab_size={meta['vocab_size']}; "
                f"every id must be < vocab_size (is dtype={meta['dtype']} right?)")


def _file_at(files: list[tuple[str, int]], index: int) -> tuple[str, str]:
    """The file that holds id `index` of a split, and where in it ("at index 7")."""
    at = index
    for name, tokens in files:
        if at < tokens:
            return name, f"at index {at}" + ("" if at == index else f"; {index:,} in the split")
        at -= tokens
    return files[-1][0], f"at index {index}"


def load_index(path: Path, meta: dict, split: str, tokens: int) -> np.ndarray:
    """A format 2 split's document index, memory-mapped, checked at its ends and over a bounded
    sample of its order (as the ids are)."""
    name = index_name(split)
    try:
        index = np.load(path / name, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"data.path={path}: {name} is not a .npy array of document offsets "
                          f"({str(e)[:200]})") from None
    if index.dtype != np.dtype(INDEX_DTYPE) or index.ndim != 1 or len(index) < 1:
        raise ConfigError(f"data.path={path}: {name} holds {index.dtype} of shape {index.shape}; "
                          "a document index is a non-empty 1-D array of int64 offsets")
    recorded = meta.get(f"{split}_documents")
    if recorded is not None and recorded != len(index):
        raise ConfigError(f"data.path={path}: {name} holds {len(index):,} document offsets, but "
                          f"meta.json {split}_documents={recorded!r}")
    problem = _index_problem(index, tokens)
    if problem:
        raise ConfigError(f"data.path={path}: {name}: {problem}; a document index holds each "
                          "document's start, in increasing order, from 0")
    return index


def _index_problem(index: np.ndarray, tokens: int) -> str | None:
    if index[0] != 0:
        return f"its first offset is {int(index[0]):,}, not 0"
    if index[-1] >= tokens:
        return f"its last offset {int(index[-1]):,} is not within the split's {tokens:,} ids"
    n = len(index)
    if n <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
        starts, block = [0], n
    else:
        starts = np.linspace(0, n - SAMPLE_BLOCK, SAMPLE_BLOCKS).astype(np.int64)
        block = SAMPLE_BLOCK
    for start in starts:
        chunk = np.asarray(index[int(start):int(start) + block])
        bad = np.flatnonzero(np.diff(chunk) <= 0)
        if len(bad):
            i = int(bad[0])
            return (f"offset {int(start) + i + 1:,} ({int(chunk[i + 1]):,}) does not come after "
                    f"offset {int(start) + i:,} ({int(chunk[i]):,})")
    return None


def scanned_documents(tokens, eot_id: int) -> np.ndarray:
    """A format 1 split's document starts: 0, and after each end-of-text id."""
    found = [np.zeros(1, dtype=np.int64)]
    n = len(tokens)
    for at in range(0, n, SCAN_CHUNK):
        ends = np.flatnonzero(np.asarray(tokens[at:at + SCAN_CHUNK]) == eot_id) + at + 1
        found.append(ends[ends < n].astype(np.int64))
    return np.concatenate(found)

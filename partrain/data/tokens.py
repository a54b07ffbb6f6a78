"""Token streams: the Python standard library's source as bytes, or a memory-mapped token dir.

A token dir (format.py has its files) holds meta.json: {"format": "partrain-tokens/2",
"tokenizer": "bytes", "dtype": "uint8", "vocab_size": 256, "train_tokens": N, "val_tokens": M,
"max_token_id": K, "train_shards": [ids per shard file], "val_shards": [...],
"train_documents": D, "val_documents": E}; a dir of a `tokenizers` tokenizer says "tokenizer":
"tokenizer.json" and keeps that file beside. `partrain data prepare` (prepare.py) writes one.
Each split is its shard files, memory-mapped and read as one sequence (`ShardedTokens`), and its
document index. Format 1 (train.bin, val.bin, no index) is still read: its documents end at each
`eot_id` that its meta.json records, found by a scan of the ids; without one (bytes) a split is
one document. `max_token_id` (the largest id in either split) is optional: dirs written before
it existed, or by other tools, are still read.

A token dir is checked before any process starts, cheaply and for any file size: meta.json
against the file sizes and the dtype's range, the document index's ends and a bounded sample of
its order, and the ids themselves against a bounded sample (`sample_max_token_id`), so that a
dir whose meta.json lies is refused here rather than failing later on a rank with an IndexError
in the embedding.
"""

import json
import math
import operator
import os
import re
import sysconfig
from dataclasses import dataclass
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
from partrain.data.tokenizer import BYTE_VOCAB, TOKENIZER_FILE
from partrain.errors import ConfigError

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


class ShardedTokens:
    """A split's shard files, memory-mapped, as one 1-D sequence of ids: len(), [i], [a:b] (an
    ndarray: a view of the file within one shard, a copy across shards), [indices] and
    np.asarray (the whole split, in memory)."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        # Shard k holds ids [bounds[k], bounds[k + 1]) of the split.
        self.bounds = np.cumsum([0] + [len(s) for s in shards])
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self.bounds[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    ndim = 1

    def __repr__(self) -> str:
        return f"ShardedTokens({len(self):,} ids of {self.dtype} in {len(self.shards)} shards)"

    def _shard_of(self, index):
        return np.searchsorted(self.bounds, index, side="right") - 1

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self._take(np.arange(start, stop, step))
            if stop <= start:
                return self.shards[0][:0]
            first, last = int(self._shard_of(start)), int(self._shard_of(stop - 1))
            pieces = [self.shards[k][max(start, self.bounds[k]) - self.bounds[k]:
                                     min(stop, self.bounds[k + 1]) - self.bounds[k]]
                      for k in range(first, last + 1)]
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        if isinstance(key, (int, np.integer)):
            index = operator.index(key)
            index += len(self) if index < 0 else 0
            if not 0 <= index < len(self):
                raise IndexError(f"index {key} is out of range for {len(self)} ids")
            shard = int(self._shard_of(index))
            return self.shards[shard][index - self.bounds[shard]]
        return self._take(key)

    def _take(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        indices = np.where(indices < 0, indices + len(self), indices)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"an index is out of range for {len(self)} ids")
        shard = self._shard_of(indices)
        out = np.empty(indices.shape, dtype=self.dtype)
        for k in np.unique(shard):
            at = shard == k
            out[at] = self.shards[k][indices[at] - self.bounds[k]]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self.shards)
        return whole if dtype is None else whole.astype(dtype)


@dataclass
class TokenSplits:
    """A dataset's two splits. `train` and `val` are 1-D sequences of ids: an ndarray (np.memmap
    of one file), or a ShardedTokens for a split of several shard files; both take len(), [i],
    [a:b] and np.asarray."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int  # ids are < vocab_size
    description: str
    # Each document's start offset in its split: int64, sorted, the first 0. The val split's first
    # document may be the end of one that began in train. Not given: the split is one document.
    train_docs: np.ndarray | None = None
    val_docs: np.ndarray | None = None

    def __post_init__(self):
        if self.train_docs is None:
            self.train_docs = np.zeros(1, dtype=np.int64)
        if self.val_docs is None:
            self.val_docs = np.zeros(1, dtype=np.int64)


def stdlib_files() -> list[Path]:
    """The stdlib's top-level .py files in sorted order: real text that every Python install has."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _stdlib_splits(max_bytes: int, val_fraction: float) -> TokenSplits:
    chunks, total = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    stream = np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)
    # A file is a document, after the newline that ends the one before (as `data prepare` joins).
    starts = np.cumsum([0] + [len(c) + 1 for c in chunks[:-1]], dtype=np.int64)
    cut = int(len(stream) * (1 - val_fraction))
    train_docs, val_docs = split_documents(starts[starts < len(stream)], cut)
    return TokenSplits(stream[:cut], stream[cut:], BYTE_VOCAB,
                       f"Python {sysconfig.get_python_version()} stdlib source, "
                       f"{len(stream):,} bytes", train_docs, val_docs)


def split_documents(starts: np.ndarray, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """The document starts of a sequence cut at `cut` into train and val: val's first document
    starts at 0, in the middle of one or at one."""
    train, val = starts[starts < cut], starts[starts >= cut] - cut
    if not len(val) or val[0] != 0:
        val = np.concatenate([np.zeros(1, dtype=np.int64), val])
    return train.astype(np.int64), val.astype(np.int64)


def _kind(value) -> str:
    """What a JSON value is, in the file's own terms, for messages about a value of a wrong type."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a non-finite number" if not math.isfinite(value) else "a decimal number"
    return {str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), type(value).__name__)


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _is_int(value) -> bool:
    # bool is an int in Python, but `"vocab_size": true` is not a vocabulary size.
    return isinstance(value, int) and not isinstance(value, bool)


def _regular_file(path: Path, file: Path, name: str) -> None:
    """Refuse a split file or meta.json that is a directory, a pipe or a device, a symlink loop
    or a dangling link (a missing one is left to the caller, which says what it expected)."""
    found = what_is(file)
    if found == "is a directory":
        raise ConfigError(f"data.path={path}: {name} is a directory, not a file")
    if found not in ("is a regular file", "does not exist"):
        raise ConfigError(f"data.path={path}: {name} {found}")


def _read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if what_is(meta_path) == "does not exist":
        raise ConfigError(
            f"data.path={path}: no meta.json there; make a token dir with "
            "`partrain data prepare FILES... --out DIR`")
    _regular_file(path, meta_path, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            raw = f.read(META_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"data.path={path}: meta.json cannot be read: {_reason(e)}") from None
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
        if not _is_int(value):
            raise ConfigError(f"data.path={path}: meta.json {key}={value!r} must be a positive "
                              f"integer, not {_kind(value)}")
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
        if not _is_int(value) or value < 0:
            raise ConfigError(
                f"data.path={path}: meta.json max_token_id={value!r} must be a non-negative "
                "integer" + ("" if _is_int(value) else f", not {_kind(value)}"))
        if value >= meta["vocab_size"]:
            raise ConfigError(
                f"data.path={path}: meta.json max_token_id={value} is not below vocab_size="
                f"{meta['vocab_size']}; every token id must be < vocab_size")
    for split, files in split_files(path, meta).items():
        for name, tokens in files:
            file = path / name
            _regular_file(path, file, name)
            expected = tokens * dtype.itemsize
            try:
                size = file.stat().st_size if file.is_file() else None
            except OSError as e:
                raise ConfigError(f"data.path={path}: {name} cannot be read: "
                                  f"{_reason(e)}") from None
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
            _regular_file(path, index, index_name(split))
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
                not all(_is_int(n) and n >= 1 for n in shards):
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


def _check_token_ids(path: Path, meta: dict, splits: dict, files: dict) -> None:
    """The sampled ids against meta.json: a wrong dtype reads the bytes as other ids, and an id
    at or above vocab_size would index past the model's embedding."""
    recorded = meta.get("max_token_id")
    for split, tokens in splits.items():
        try:
            top, where = sample_max_token_id(tokens)
        except OSError as e:
            raise ConfigError(f"data.path={path}: the {split} split's files cannot be read: "
                              f"{_reason(e)}") from None
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


def _load_index(path: Path, meta: dict, split: str, tokens: int) -> np.ndarray:
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


def _scanned_documents(tokens, eot_id: int) -> np.ndarray:
    """A format 1 split's document starts: 0, and after each end-of-text id."""
    found = [np.zeros(1, dtype=np.int64)]
    n = len(tokens)
    for at in range(0, n, SCAN_CHUNK):
        ends = np.flatnonzero(np.asarray(tokens[at:at + SCAN_CHUNK]) == eot_id) + at + 1
        found.append(ends[ends < n].astype(np.int64))
    return np.concatenate(found)


def load_tokens(data_cfg) -> TokenSplits:
    if data_cfg.source == "stdlib":
        return _stdlib_splits(data_cfg.stdlib_max_bytes, data_cfg.val_fraction)
    path = Path(data_cfg.path)
    meta = _read_meta(path)
    files = split_files(path, meta)
    splits = {}
    for split in SPLITS:
        shards = []
        for name, _ in files[split]:
            try:
                shards.append(np.memmap(path / name, dtype=meta["dtype"], mode="r"))
            except OSError as e:
                raise ConfigError(f"data.path={path}: {name} cannot be read: "
                                  f"{_reason(e)}") from None
        splits[split] = shards[0] if len(shards) == 1 else ShardedTokens(shards)
    _check_token_ids(path, meta, splits, files)
    eot_id = meta.get("eot_id")
    if meta["format"] != FORMAT_V1:
        docs = {split: _load_index(path, meta, split, meta[f"{split}_tokens"]) for split in SPLITS}
    elif _is_int(eot_id) and 0 <= eot_id < meta["vocab_size"]:
        docs = {split: _scanned_documents(splits[split], eot_id) for split in SPLITS}
    else:  # bytes joined by newlines, which a document may hold too: one document per split
        docs = {split: None for split in SPLITS}
    return TokenSplits(splits["train"], splits["val"], meta["vocab_size"],
                       f"{path} ({meta['tokenizer']}, {meta['train_tokens']:,} train tokens)",
                       docs["train"], docs["val"])


# What `partrain data prepare` reads (prepare.py: JSON Lines, Parquet, Arrow, anything else as
# text): a data.path with one of these, or a directory of them, is text still to be tokenized.
RAW_SUFFIXES = {".jsonl": "a JSON Lines file", ".ndjson": "a JSON Lines file",
                ".json": "a JSON file", ".parquet": "a Parquet file", ".txt": "a text file",
                ".text": "a text file", ".md": "a text file", ".csv": "a text file",
                ".arrow": "an Arrow file"}
RAW_LOOKED_AT = 1000  # entries of a directory looked at for raw files, so any directory is quick


def _prepare_hint(path: Path, what: str) -> str:
    """Raw text at data.path: the command that makes a token dir of it, on one line."""
    import shlex

    out = path.with_name(f"{path.stem if path.suffix else path.name}-tokens")
    command = f"partrain data prepare {shlex.quote(str(path))} --out {shlex.quote(str(out))}"
    json_note = (" (a .json file is read as text; one JSON object per line is a .jsonl file)"
                 if path.suffix.lower() == ".json" else "")
    return (f"data.path={path} is {what}, not a token dir; tokenize it first: `{command}` "
            f"(add --tokenizer PATH for a tokenizer.json; default: a token per byte){json_note}, "
            f"then data=tokens data.path={shlex.quote(str(out))}")


def _raw_files_in(path: Path) -> bool:
    """Whether a directory without meta.json holds text for `data prepare` (looked at briefly)."""
    import itertools

    try:
        with os.scandir(path) as entries:
            return any(Path(entry.name).suffix.lower() in RAW_SUFFIXES
                       for entry in itertools.islice(entries, RAW_LOOKED_AT))
    except OSError:
        return False


def _check_raw(path: Path) -> None:
    """data.path names text still to be tokenized, or a file inside a token dir: refused with
    what to give instead."""
    found = what_is(path)
    if found == "is a regular file":
        if _token_dir_file(path.name) and (path.parent / "meta.json").is_file():
            raise ConfigError(f"data.path={path} is a file of a token dir; give the directory: "
                              f"data=tokens data.path={path.parent}")
        raise ConfigError(_prepare_hint(path, RAW_SUFFIXES.get(path.suffix.lower(), "a file")))
    if found == "is a directory" and what_is(path / "meta.json") == "does not exist":
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            raise ConfigError(_prepare_hint(path, "a Hugging Face dataset (save_to_disk)"))
        if _raw_files_in(path):
            raise ConfigError(_prepare_hint(path, "a directory of text files"))


def _token_dir_file(name: str) -> bool:
    """Whether `name` is one of a token dir's own files (either format)."""
    return re.fullmatch(r"meta\.json|(train|val)(\.bin|-\d{5,}\.bin|\.idx\.npy)", name) is not None


def check_data(cfg) -> str:
    """Everything about the data that can be wrong, found before any process starts."""
    if cfg.data.source != "tokens" and cfg.data.path:
        _check_raw(Path(cfg.data.path))
        raise ConfigError(
            f"data.path={cfg.data.path} is set, but data.source={cfg.data.source} does not read "
            "it (it trains on the Python standard library's source); for your own data add "
            "data=tokens, with data.path a token dir made by `partrain data prepare FILES... "
            "--out DIR`")
    if cfg.data.source == "tokens":
        if not cfg.data.path:
            raise ConfigError("data.source=tokens needs data.path=DIR (made by `partrain data prepare`)")
        _check_raw(Path(cfg.data.path))
        found = what_is(Path(cfg.data.path))
        if found != "is a directory":
            raise ConfigError(f"data.path={cfg.data.path} is not a directory: it {found}")
    # load_tokens has checked every (sampled) id against the data's vocab_size, so this check
    # also keeps every id below model.vocab_size.
    splits = load_tokens(cfg.data)
    source = (f"data.path={cfg.data.path}" if cfg.data.source == "tokens" else
              f"data.source=stdlib with data.stdlib_max_bytes={cfg.data.stdlib_max_bytes}")
    if splits.vocab_size > cfg.model.vocab_size:
        from partrain.data.format import vocab_to_use

        raise ConfigError(
            f"{source}: the data's vocab_size={splits.vocab_size} exceeds model.vocab_size="
            f"{cfg.model.vocab_size}; token ids would fall outside the embedding (use "
            f"model.vocab_size={vocab_to_use(splits.vocab_size, cfg.parallel.tp)}: the tokenizer's "
            f"{splits.vocab_size} rounded up to a multiple of 128 * parallel.tp)")
    need = cfg.train.seq_len + 1
    for name, split in (("train", splits.train), ("val", splits.val)):
        if len(split) < need:
            raise ConfigError(
                f"{source}: the {name} split has {len(split):,} tokens, fewer than "
                f"train.seq_len + 1 = {need}")
    return splits.description

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

A token dir is checked before any process starts, cheaply and for any file size (token_files.py:
meta.json, the shard files, the document index, a bounded sample of the ids), and its
tokenizer.json loaded as `partrain sample` and `export` will load the run's copy of it.
"""

import hashlib
import operator
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partrain.config.paths import relative_note, what_is
from partrain.data.format import FORMAT_V1, SPLITS
from partrain.data.token_files import (
    check_token_ids,
    is_int,
    load_index,
    read_meta,
    scanned_documents,
    split_files,
)
from partrain.data.tokenizer import BYTE_VOCAB, TOKENIZER_FILE
from partrain.errors import ConfigError, reason



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
    meta: dict | None = None  # the token dir's meta.json; None for the stdlib's source

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


def load_tokens(data_cfg) -> TokenSplits:
    if data_cfg.source == "stdlib":
        return _stdlib_splits(data_cfg.stdlib_max_bytes, data_cfg.val_fraction)
    path = Path(data_cfg.path)
    meta = read_meta(path)
    files = split_files(path, meta)
    splits = {}
    for split in SPLITS:
        shards = []
        for name, _ in files[split]:
            try:
                shards.append(np.memmap(path / name, dtype=meta["dtype"], mode="r"))
            except OSError as e:
                raise ConfigError(f"data.path={path}: {name} cannot be read: "
                                  f"{reason(e)}") from None
        splits[split] = shards[0] if len(shards) == 1 else ShardedTokens(shards)
    check_token_ids(path, meta, splits, files)
    eot_id = meta.get("eot_id")
    if meta["format"] != FORMAT_V1:
        docs = {split: load_index(path, meta, split, meta[f"{split}_tokens"]) for split in SPLITS}
    elif is_int(eot_id) and 0 <= eot_id < meta["vocab_size"]:
        docs = {split: scanned_documents(splits[split], eot_id) for split in SPLITS}
    else:  # bytes joined by newlines, which a document may hold too: one document per split
        docs = {split: None for split in SPLITS}
    return TokenSplits(splits["train"], splits["val"], meta["vocab_size"],
                       f"{path} ({meta['tokenizer']}, {meta['train_tokens']:,} train tokens)",
                       docs["train"], docs["val"], meta)


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


FINGERPRINT_BYTES = 4096  # of each end of a shard or index file, in a token dir's fingerprint


def _token_dir_file(name: str) -> bool:
    """Whether `name` is one of a token dir's own files (either format)."""
    return re.fullmatch(r"meta\.json|(train|val)(\.bin|-\d{5,}\.bin|\.idx\.npy)", name) is not None


def fingerprint(path: Path) -> str:
    """What makes a token dir the same data wherever it lies: its meta.json as written (the
    counts of tokens and documents, the inputs, the tokenizer's name), its tokenizer.json, and
    the name, size, first and last FINGERPRINT_BYTES of each shard and index file; sha256, its
    first 16 hex digits. A copy (cp -r, rsync) has the same; a dir prepared again from other
    text or with other settings has another. Reads a few KiB a file. OSError where the dir
    cannot be read."""
    digest = hashlib.sha256()
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name == "meta.json" or entry.name == TOKENIZER_FILE:
            digest.update(f"{entry.name}\0".encode() + Path(entry.path).read_bytes())
        elif _token_dir_file(entry.name):
            size = entry.stat().st_size
            with open(entry.path, "rb") as f:
                head = f.read(FINGERPRINT_BYTES)
                f.seek(max(size - FINGERPRINT_BYTES, 0))
                tail = f.read(FINGERPRINT_BYTES)
            digest.update(f"{entry.name}\0{size}\0".encode() + head + tail)
    return digest.hexdigest()[:16]


def check_tokenizer(path: Path, meta: dict) -> None:
    """A token dir's tokenizer.json, loaded as `partrain sample` and `export` load the run's copy
    of it (the library reads it, an end-of-text token is found, it has no more tokens than the
    ids' vocab_size): a launch copies it into RUN_DIR/tokenizer/, and a run trained beside a
    tokenizer they refuse could be neither sampled nor exported."""
    from partrain.data import tokenizer as tk

    file = path / TOKENIZER_FILE
    source = meta.get("tokenizer_source")
    fix = ("; put back the tokenizer.json the dir was prepared with"
           + (f" ({source}, as meta.json tokenizer_source says)" if isinstance(source, str) else "")
           + ", or prepare the dir again with `partrain data prepare ... --tokenizer PATH`")
    try:
        tok = tk.load(file, f"data.path={path}:")
    except ConfigError as e:
        raise ConfigError(f"{e}{fix}") from None
    try:
        eot, eot_id = tk.end_of_text(tok, file)
    except ConfigError:
        raise ConfigError(
            f"data.path={path}: {file} has no end-of-text token (no eos_token in the "
            f"{tk.TOKENIZER_CONFIG} beside it, none of {', '.join(tk.EOT_NAMES)} in its "
            f"vocabulary), which `partrain sample` and `export` need{fix}") from None
    # The ids end each document with meta.json's eot_id; `sample` and `export` stop at the
    # tokenizer's: another tokenizer.json with the same vocabulary size passed the check above
    recorded = meta.get("eot_token")
    known = tok.token_to_id(recorded) if isinstance(recorded, str) else None
    if "eot_id" in meta and (known if known is not None else eot_id) != meta["eot_id"]:
        raise ConfigError(
            f"data.path={path}: {file} ends a document with "
            f"{recorded if known is not None else eot}={known if known is not None else eot_id}, "
            f"but meta.json eot_id={meta['eot_id']} ended the ids: it is not the tokenizer "
            f"these ids were made with{fix}")
    size, count = tk.id_span(tok), tok.get_vocab_size(with_added_tokens=True)
    if size > meta["vocab_size"]:
        has = f"{size:,} tokens" if size == count else f"ids up to {size - 1:,}"
        raise ConfigError(
            f"data.path={path}: {file} has {has}, more than meta.json vocab_size="
            f"{meta['vocab_size']:,}: it is not the tokenizer these ids were made with{fix}")


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
            raise ConfigError(f"data.path={cfg.data.path} is not a directory: it {found}"
                              f"{relative_note(cfg.data.path)}")
    # load_tokens has checked every (sampled) id against the data's vocab_size, so this check
    # also keeps every id below model.vocab_size.
    splits = load_tokens(cfg.data)
    if splits.meta is not None and splits.meta["tokenizer"] == TOKENIZER_FILE:
        check_tokenizer(Path(cfg.data.path), splits.meta)
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

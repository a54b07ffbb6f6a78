"""Token streams: the Python standard library's source as bytes, or a memory-mapped token dir.

A token dir holds `train.bin` and `val.bin` (raw little-endian integers) and `meta.json`:
{"format": "partrain-tokens/1", "tokenizer": "bytes", "dtype": "uint8", "vocab_size": 256,
 "train_tokens": N, "val_tokens": M, "max_token_id": K}; a dir of a `tokenizers` tokenizer says
"tokenizer": "tokenizer.json" and keeps that file beside. `partrain data prepare` (prepare.py)
writes one. `max_token_id` (the largest id in either split) is optional: dirs written before it
existed, or by other tools, are still read.

A token dir is checked before any process starts, cheaply and for any file size: meta.json
against the file sizes and the dtype's range, and the ids themselves against a bounded sample
(`sample_max_token_id`), so that a dir whose meta.json lies is refused here rather than failing
later on a rank with an IndexError in the embedding.
"""

import json
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partrain.config.paths import what_is
from partrain.data.format import DTYPES, FORMAT
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


@dataclass
class TokenSplits:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int  # ids are < vocab_size
    description: str


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
    cut = int(len(stream) * (1 - val_fraction))
    return TokenSplits(stream[:cut], stream[cut:], BYTE_VOCAB,
                       f"Python {sysconfig.get_python_version()} stdlib source, "
                       f"{len(stream):,} bytes")


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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(
            f"data.path={path}: meta.json format is {meta.get('format') if isinstance(meta, dict) else meta!r}, "
            f"expected {FORMAT!r}")
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
    for split in ("train", "val"):
        file = path / f"{split}.bin"
        _regular_file(path, file, f"{split}.bin")
        expected = meta[f"{split}_tokens"] * dtype.itemsize
        try:
            size = file.stat().st_size if file.is_file() else None
        except OSError as e:
            raise ConfigError(f"data.path={path}: {split}.bin cannot be read: {_reason(e)}") from None
        if size is None:
            raise ConfigError(f"data.path={path}: {split}.bin is missing; a token dir holds "
                              "train.bin, val.bin and meta.json")
        if size != expected:
            raise ConfigError(
                f"data.path={path}: {split}.bin has {size:,} bytes, but meta.json says "
                f"{meta[f'{split}_tokens']:,} tokens of {meta['dtype']} = {expected:,} bytes")
    return meta


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


def _check_token_ids(path: Path, meta: dict, splits: dict[str, np.ndarray]) -> None:
    """The sampled ids against meta.json: a wrong dtype reads the bytes as other ids, and an id
    at or above vocab_size would index past the model's embedding."""
    recorded = meta.get("max_token_id")
    for split, tokens in splits.items():
        try:
            top, where = sample_max_token_id(tokens)
        except OSError as e:
            raise ConfigError(f"data.path={path}: {split}.bin cannot be read: {_reason(e)}") from None
        if recorded is not None and top > recorded:
            raise ConfigError(
                f"data.path={path}: {split}.bin holds token id {top} (at index {where}), above "
                f"meta.json max_token_id={recorded}; every id must be <= max_token_id, so "
                f"meta.json does not describe these bytes (is dtype={meta['dtype']} right?)")
        if top >= meta["vocab_size"]:
            raise ConfigError(
                f"data.path={path}: {split}.bin holds token id {top} (at index {where}), not "
                f"below meta.json vocab_size={meta['vocab_size']}; every id must be < vocab_size "
                f"(is dtype={meta['dtype']} right?)")


def load_tokens(data_cfg) -> TokenSplits:
    if data_cfg.source == "stdlib":
        return _stdlib_splits(data_cfg.stdlib_max_bytes, data_cfg.val_fraction)
    path = Path(data_cfg.path)
    meta = _read_meta(path)
    splits = {}
    for split in ("train", "val"):
        try:
            splits[split] = np.memmap(path / f"{split}.bin", dtype=meta["dtype"], mode="r")
        except OSError as e:
            raise ConfigError(f"data.path={path}: {split}.bin cannot be read: {_reason(e)}") from None
    _check_token_ids(path, meta, splits)
    return TokenSplits(splits["train"], splits["val"], meta["vocab_size"],
                       f"{path} ({meta['tokenizer']}, {meta['train_tokens']:,} train tokens)")


# What `partrain data prepare` reads (prepare.py: JSON Lines, Parquet, anything else as text):
# a data.path with one of these, or a directory of them, is text still to be tokenized.
RAW_SUFFIXES = {".jsonl": "a JSON Lines file", ".ndjson": "a JSON Lines file",
                ".json": "a JSON file", ".parquet": "a Parquet file", ".txt": "a text file",
                ".text": "a text file", ".md": "a text file", ".csv": "a text file"}
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
        if path.name in ("meta.json", "train.bin", "val.bin") and \
                (path.parent / "meta.json").is_file():
            raise ConfigError(f"data.path={path} is a file of a token dir; give the directory: "
                              f"data=tokens data.path={path.parent}")
        raise ConfigError(_prepare_hint(path, RAW_SUFFIXES.get(path.suffix.lower(), "a file")))
    if found == "is a directory" and what_is(path / "meta.json") == "does not exist" \
            and _raw_files_in(path):
        raise ConfigError(_prepare_hint(path, "a directory of text files"))


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

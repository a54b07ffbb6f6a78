"""Token streams: the Python standard library's source as bytes, or a memory-mapped token dir.

A token dir holds `train.bin` and `val.bin` (raw little-endian integers) and `meta.json`:
{"format": "partrain-tokens/1", "tokenizer": "bytes", "dtype": "uint8", "vocab_size": 256,
 "train_tokens": N, "val_tokens": M}. `partrain data prepare` writes one from text files.
"""

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partrain.errors import ConfigError

FORMAT = "partrain-tokens/1"
DTYPES = ("uint8", "uint16", "uint32")
BYTE_VOCAB = 256


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


def _read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(
            f"data.path={path}: no meta.json there; make a token dir with "
            "`partrain data prepare FILES... --out DIR`")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
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
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        if not isinstance(meta.get(key), int) or meta[key] < 1:
            raise ConfigError(f"data.path={path}: meta.json {key}={meta.get(key)!r} must be a positive integer")
    for split in ("train", "val"):
        file = path / f"{split}.bin"
        expected = meta[f"{split}_tokens"] * np.dtype(meta["dtype"]).itemsize
        size = file.stat().st_size if file.is_file() else None
        if size != expected:
            raise ConfigError(
                f"data.path={path}: {split}.bin has {size if size is not None else 'no file'} bytes, "
                f"meta.json says {meta[f'{split}_tokens']} tokens of {meta['dtype']} = {expected} bytes")
    return meta


def load_tokens(data_cfg) -> TokenSplits:
    if data_cfg.source == "stdlib":
        return _stdlib_splits(data_cfg.stdlib_max_bytes, data_cfg.val_fraction)
    path = Path(data_cfg.path)
    meta = _read_meta(path)
    train = np.memmap(path / "train.bin", dtype=meta["dtype"], mode="r")
    val = np.memmap(path / "val.bin", dtype=meta["dtype"], mode="r")
    return TokenSplits(train, val, meta["vocab_size"],
                       f"{path} ({meta['tokenizer']}, {meta['train_tokens']:,} train tokens)")


def check_data(cfg) -> str:
    """Everything about the data that can be wrong, found before any process starts."""
    if cfg.data.source == "tokens":
        if not cfg.data.path:
            raise ConfigError("data.source=tokens needs data.path=DIR (made by `partrain data prepare`)")
        if not Path(cfg.data.path).is_dir():
            raise ConfigError(f"data.path={cfg.data.path} is not a directory")
    splits = load_tokens(cfg.data)
    if splits.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the data's vocab_size={splits.vocab_size} exceeds model.vocab_size="
            f"{cfg.model.vocab_size}; token ids would fall outside the embedding")
    need = cfg.train.seq_len + 1
    for name, split in (("train", splits.train), ("val", splits.val)):
        if len(split) < need:
            raise ConfigError(
                f"the {name} split has {len(split)} tokens, fewer than train.seq_len + 1 = {need}")
    return splits.description


def prepare_token_dir(files: list[Path], out: Path, val_fraction: float) -> dict:
    """Byte-tokenize text files into a token dir; written to a temp dir, then renamed into place."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction={val_fraction} must be between 0 and 1")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is an existing file; give a new directory")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; give a new directory")
    chunks = []
    for file in files:
        if not file.is_file():
            raise ConfigError(f"input file {file} does not exist")
        try:
            chunks.append(file.read_bytes())
        except OSError as e:
            raise ConfigError(f"input file {file} cannot be read: {e.strerror}") from None
    stream = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    cut = int(len(stream) * (1 - val_fraction))
    if cut < 2 or len(stream) - cut < 2:
        raise ConfigError(
            f"the input files hold {len(stream)} bytes: too few for a train and a validation split")
    meta = {"format": FORMAT, "tokenizer": "bytes", "dtype": "uint8", "vocab_size": BYTE_VOCAB,
            "train_tokens": cut, "val_tokens": len(stream) - cut,
            "sources": [str(f) for f in files]}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    stream[:cut].tofile(tmp / "train.bin")
    stream[cut:].tofile(tmp / "val.bin")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return meta

"""`partrain data prepare`: text, JSON Lines, Parquet and Arrow files, Hugging Face datasets saved
with `save_to_disk`, or directories of them, tokenized into a token dir (format.py says what it
holds, tokens.py reads it).

Inputs are documents, read in bounded memory by inputs.py: a non-empty text file is one (read
in pieces), a JSON Lines line, a Parquet row or an Arrow record is one (its `--field`).

Two tokenizers:
- bytes (the default): a token per byte of the file, documents joined by a newline, ids uint8;
- `--tokenizer tokenizer.json` (the `tokenizers` library): every document followed by the
  end-of-text token (a special token's text inside a document is encoded as text, so the only
  end-of-text ids are the separators), ids uint16 when the highest id fits, else uint32 (the
  vocab_size recorded is the highest id + 1, not the token count: a vocabulary may skip ids),
  encoded by as many worker processes as cores, each tokenizing ~1 MiB of text at a time, the
  results written in input order.

The ids stream to shard files of at most `--shard-mb` (train-00000.bin, ...) as they come, the
documents' start offsets to a file beside, so memory stays bounded whatever the input's size.
With `--val INPUTS` the val split is made from those; else the last `--val-fraction` of the ids
moves to the val split at the end (the shard holding the cut is split, the shards after it are
renamed). Everything is written under a temporary name beside `--out` and renamed into place at
the end; a failure or Ctrl-C leaves nothing behind.
"""

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import numpy as np

from partrain.data import tokenizer as tk
from partrain.data.input_paths import input_files
from partrain.data.inputs import documents
from partrain.data.format import (
    FORMAT,
    INDEX_DTYPE,
    SHARD_MB,
    index_name,
    shard_name,
    vocab_to_use,
)
from partrain.errors import ConfigError, reason
from partrain.staging import check_out, staged_dir

VAL_FRACTION = 0.05  # --val-fraction's default
INDEX_CHUNK = 1 << 20  # document offsets read at a time when the index is written
CHUNK_CHARS = 1 << 20  # text per task sent to a worker process
# --workers is at most this many per core: more processes than cores only take turns on them, and
# each one holds a tokenizer and its share of the text. The bound keeps a typo (`--workers 100000`)
# from forking until the system refuses.
WORKERS_PER_CORE = 4


# ---- output ----------------------------------------------------------------------------------
class _Split:
    """A split being written: its ids into shard files of at most `shard_tokens` ids
    (train-00000.bin, ...), its documents' start offsets into a raw int64 file beside, made into
    the .npy index at the end (its length is known only then)."""

    def __init__(self, stage, name: str, shard_tokens: int):
        self.stage, self.name, self.shard_tokens = stage, name, shard_tokens
        self.shards: list[int] = []  # ids in each shard file so far
        self.total = 0  # ids so far
        self.documents = 0
        self.starts_file = stage.path / f".{name}.starts"
        self._bin = None
        self._starts = None

    def __enter__(self):
        self.stage.step = f"writing {index_name(self.name)}"
        self._starts = open(self.starts_file, "wb")
        return self

    def __exit__(self, *exc):
        self._close_shard()
        self.stage.step = f"writing {index_name(self.name)}"
        self._starts.close()

    def write(self, ids: np.ndarray, starts: np.ndarray) -> None:
        """Append `ids`, in which documents start at offsets `starts`."""
        self._starts.write((starts + self.total).astype(INDEX_DTYPE).tobytes())
        self.documents += len(starts)
        at = 0
        while at < len(ids):
            if self._bin is None or self.shards[-1] == self.shard_tokens:
                self._close_shard()
                self.stage.step = f"writing {shard_name(self.name, len(self.shards))}"
                self._bin = open(self.stage.path / shard_name(self.name, len(self.shards)), "wb")
                self.shards.append(0)
            piece = ids[at:at + self.shard_tokens - self.shards[-1]]
            self._bin.write(piece.tobytes())
            self.shards[-1] += len(piece)
            at += len(piece)
        self.total += len(ids)

    def _close_shard(self) -> None:
        if self._bin is not None:
            self._bin.close()  # a full disk may refuse the last buffered bytes only here
            self._bin = None


def _starts_chunks(file: Path, keep=None, offset: int = 0) -> Iterator[np.ndarray]:
    """The offsets in a raw starts file, INDEX_CHUNK at a time: those `keep` keeps, less
    `offset`."""
    with open(file, "rb") as f:
        while len(chunk := np.fromfile(f, dtype=INDEX_DTYPE, count=INDEX_CHUNK)):
            yield (chunk if keep is None else chunk[keep(chunk)]) - offset


def _write_index(path: Path, count: int, chunks, lead_zero: bool = False) -> None:
    """A .npy file of `count` int64 offsets (a 0 first when `lead_zero`) from `chunks`."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": INDEX_DTYPE, "fortran_order": False, "shape": (count + lead_zero,)})
        if lead_zero:
            f.write(np.zeros(1, dtype=INDEX_DTYPE).tobytes())
        for chunk in chunks:
            f.write(chunk.tobytes())


def _cut_shards(stage, shards: list[int], cut: int, itemsize: int) -> tuple[list[int], list[int]]:
    """Move ids [cut, end) of the train shards to val shards: the shard holding the cut is split
    (its tail copied to val-00000.bin), the shards after it are renamed. Returns the (train,
    val) shard sizes."""
    bounds = np.cumsum([0] + shards)
    k = int(np.searchsorted(bounds, cut, side="right")) - 1  # the shard holding id `cut`
    head = cut - int(bounds[k])
    train, val = shards[:k] + ([head] if head else []), []
    if head:
        stage.step = f"writing {shard_name('val', 0)}"
        with open(stage.path / shard_name("train", k), "r+b") as source:
            source.seek(head * itemsize)
            with open(stage.path / shard_name("val", 0), "wb") as tail:
                shutil.copyfileobj(source, tail, 1 << 24)
            source.truncate(head * itemsize)
        val.append(shards[k] - head)
    for number in range(k + 1 if head else k, len(shards)):
        stage.step = f"renaming {shard_name('train', number)} to {shard_name('val', len(val))}"
        (stage.path / shard_name("train", number)).rename(stage.path / shard_name("val", len(val)))
        val.append(shards[number])
    return train, val


def _write_indexes(stage, train: _Split, val: _Split | None, cut: int) -> tuple[int, int]:
    """train.idx.npy and val.idx.npy from the raw starts: split at `cut` when val is None (the val
    split then starts in the middle of a document, or at one). (train, val) documents."""
    stage.step = f"writing {index_name('train')}"
    if val is not None:
        _write_index(stage.path / index_name("train"), train.documents,
                     _starts_chunks(train.starts_file))
        stage.step = f"writing {index_name('val')}"
        _write_index(stage.path / index_name("val"), val.documents, _starts_chunks(val.starts_file))
        val.starts_file.unlink()
        train.starts_file.unlink()
        return train.documents, val.documents
    before, at_cut = 0, False
    for chunk in _starts_chunks(train.starts_file):
        before += int(np.searchsorted(chunk, cut))
        at_cut = at_cut or bool((chunk == cut).any())
    _write_index(stage.path / index_name("train"), before,
                 _starts_chunks(train.starts_file, lambda c: c < cut))
    stage.step = f"writing {index_name('val')}"
    _write_index(stage.path / index_name("val"), train.documents - before,
                 _starts_chunks(train.starts_file, lambda c: c >= cut, offset=cut),
                 lead_zero=not at_cut)
    train.starts_file.unlink()
    return before, train.documents - before + (not at_cut)


# ---- tokenization ----------------------------------------------------------------------------
def _chunks(docs: Iterator[tuple[str, int, bool]]) -> Iterator[tuple[list[str], list[bool], int]]:
    """Documents (or pieces) grouped into tasks of about CHUNK_CHARS characters, with whether
    each ends a document, and their bytes."""
    chunk, ends, chars, nbytes = [], [], 0, 0
    for doc, size, end in docs:
        chunk.append(doc)
        ends.append(end)
        chars, nbytes = chars + len(doc), nbytes + size
        if chars >= CHUNK_CHARS:
            yield chunk, ends, nbytes
            chunk, ends, chars, nbytes = [], [], 0, 0
    if chunk:
        yield chunk, ends, nbytes


@contextmanager
def _pool(file: Path, eot_id: int, dtype: str, workers: int):
    """The tokenizer processes, all started before this returns (and before any progress-bar
    thread), with Ctrl-C ignored in them from birth: it is the parent's to handle."""
    # fork on Linux: a worker starts at once and imports nothing (spawn would re-run the
    # `partrain` script, torch and all, in each one); spawn elsewhere (macOS forbids fork here).
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=tk.init_worker,
                               initargs=(str(file), eot_id, dtype))
    main = threading.current_thread() is threading.main_thread()  # signals are the main thread's
    before = set(multiprocessing.active_children())
    # Born with Ctrl-C ignored, and SIGTERM and SIGHUP at their default (the parent takes them
    # as Ctrl-C while it stages its output: a forked worker with that handler took terminate()
    # as a KeyboardInterrupt and went on waiting for work).
    births = {signal.SIGINT: signal.SIG_IGN, **{
        sig: signal.SIG_IGN if signal.getsignal(sig) is signal.SIG_IGN else signal.SIG_DFL
        for sig in (signal.SIGTERM, signal.SIGHUP)}}  # ignored (nohup): ignored in them too
    try:
        previous = {sig: signal.signal(sig, how) for sig, how in births.items()} if main else {}
        try:
            for started in [pool.submit(os.getpid) for _ in range(workers)]:
                started.result()
        except OSError as e:
            # The system refused a process (fork's EAGAIN or ENOMEM). The pool has started some
            # and, failing inside its first submit, has no thread to stop them: stop them here,
            # or they would wait for work forever and the interpreter's exit with them.
            for child in set(multiprocessing.active_children()) - before:
                child.terminate()
                child.join()
            raise ConfigError(
                f"--workers={workers}: the system refused to start a tokenizer process "
                f"({reason(e)}); give fewer --workers") from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _encode_all(chunks, file: Path, eot_id: int, dtype: str, pool, workers: int):
    """((ids, ids per piece), whether each piece ends a document, text bytes) per chunk, in
    order: encoded here without a pool,
    else by the pool's processes, at most two tasks per process in flight."""
    if pool is None:
        tok = tk.for_documents(tk.load(file))
        for docs, ends, nbytes in chunks:
            yield tk.encode(tok, eot_id, dtype, docs, ends), ends, nbytes
        return
    pending, window = deque(), 2 * workers
    for docs, ends, nbytes in chunks:
        pending.append((pool.submit(tk.encode_documents, docs, ends), ends, nbytes))
        while len(pending) >= window:
            future, ends, done = pending.popleft()
            yield future.result(), ends, done
    while pending:
        future, ends, done = pending.popleft()
        yield future.result(), ends, done


def _byte_ids(docs: Iterator[tuple[bytes, int, bool]]):
    """(ids, document starts in them, text bytes) per document or piece: its bytes, after the
    newline that ends the document before it (a piece that continues one: its bytes alone)."""
    newline = np.array([10], dtype=np.uint8)
    first, later, none = (np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64),
                          np.zeros(0, dtype=np.int64))
    begins, any_before = True, False
    for doc, size, end in docs:
        ids = np.frombuffer(doc, dtype=np.uint8)
        if not begins:
            yield ids, none, size
        elif not any_before:
            yield ids, first, size
        else:
            yield np.concatenate([newline, ids]), later, size
        begins, any_before = end, True


def _token_ids(chunks, file: Path, eot_id: int, dtype: str, pool, workers: int):
    """(ids, document starts in them, text bytes) per chunk of documents, in order: a piece
    that continues a document (a large text file's) starts none."""
    begins = True  # the next piece begins a document
    for (ids, sizes), ends, nbytes in _encode_all(chunks, file, eot_id, dtype, pool, workers):
        offsets = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        starting = np.array([begins] + ends[:-1], dtype=bool)
        begins = ends[-1]
        yield ids, offsets[starting], nbytes


def _progress(console):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=True,
                    disable=console is None or not console.is_terminal)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_workers(workers: int) -> None:
    """--workers: at least 1, at most WORKERS_PER_CORE per core this process may run on."""
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be at least 1")
    cores = default_workers()
    if workers > WORKERS_PER_CORE * cores:
        raise ConfigError(
            f"--workers={workers} must be at most {WORKERS_PER_CORE * cores} ({WORKERS_PER_CORE} "
            f"per core, {cores} core(s) here): more processes than cores only take turns on them "
            "(the default is one per core)")


def prepare_token_dir(inputs: list[Path], out: Path, val_fraction: float | None = None,
                      tokenizer: Path | None = None, field: str = "text", eot: str | None = None,
                      workers: int | None = None, console=None,
                      val_inputs: list[Path] | None = None,
                      shard_bytes: int = SHARD_MB << 20) -> dict:
    """Tokenize `inputs` into a new token dir `out`, the val split from `val_inputs` when given,
    else the last `val_fraction` (default VAL_FRACTION) of the ids; returns its meta.json."""
    if val_inputs and val_fraction is not None:
        raise ConfigError(
            f"--val-fraction={val_fraction} and --val: the val split is made either from the --val "
            "inputs or from a fraction of the inputs; give one of the two")
    if not val_inputs:
        val_fraction = VAL_FRACTION if val_fraction is None else val_fraction
        if not (math.isfinite(val_fraction) and 0.0 < val_fraction < 1.0):
            raise ConfigError(f"--val-fraction={val_fraction} must be between 0 and 1 (exclusive)")
    workers = default_workers() if workers is None else workers
    check_workers(workers)
    if eot is not None and tokenizer is None:
        raise ConfigError(f"--eot {eot!r} needs --tokenizer (the byte tokenizer joins documents "
                          "with a newline)")
    try:
        check_out(out)
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be inspected: {reason(e)}") from None
    train_files, val_files = input_files(inputs, val_inputs or [])
    sources = {"train": train_files, "val": val_files}
    meta = {"format": FORMAT}
    if tokenizer is None:
        meta.update(tokenizer=tk.BYTES, dtype="uint8", vocab_size=tk.BYTE_VOCAB)
    else:
        file = tk.tokenizer_file(tokenizer)
        tok = tk.load(file)
        eot, eot_id = tk.end_of_text(tok, file, eot)
        vocab = tk.id_span(tok)  # the highest id + 1, not the token count: ids may have gaps
        meta.update(tokenizer=tk.TOKENIZER_FILE, dtype=tk.id_dtype(vocab),
                    vocab_size=vocab, eot_token=eot, eot_id=eot_id)
    itemsize = np.dtype(meta["dtype"]).itemsize
    if shard_bytes < itemsize:
        raise ConfigError(f"a shard of {shard_bytes} bytes holds no {meta['dtype']} id")
    unit = "bytes" if tokenizer is None else "tokens"
    # Every id in the order written: what `fingerprint` (meta.json) tells apart of two dirs with
    # the same sizes and ends (a text edited in its middle, prepared again in place)
    nbytes, top, splits, ids_hash = 0, -1, {}, hashlib.sha256()
    parallel = tokenizer is not None and workers > 1
    with staged_dir(out) as stage, \
            (_pool(file, eot_id, meta["dtype"], workers) if parallel else nullcontext()) as pool:
        with _progress(console) as progress:
            bar = progress.add_task("tokenizing", total=sum(
                f.stat().st_size for files in sources.values() for f in files))
            for name, files in sources.items():
                if not files:
                    continue
                docs = (d for f in files
                        for d in documents(f, field, as_text=tokenizer is not None))
                encoded = (_byte_ids(docs) if tokenizer is None else
                           _token_ids(_chunks(docs), file, eot_id, meta["dtype"], pool, workers))
                with _Split(stage, name, shard_bytes // itemsize) as split:
                    for ids, starts, size in encoded:
                        split.write(ids, starts)
                        ids_hash.update(np.ascontiguousarray(ids, dtype=meta["dtype"]).data)
                        nbytes += size
                        top = max(top, int(ids.max())) if len(ids) else top
                        progress.update(bar, advance=size)
                splits[name] = split
        train, val = splits["train"], splits.get("val")
        if val is None:
            total = train.total
            cut = int(total * (1 - val_fraction))
            if cut < 2 or total - cut < 2:
                raise ConfigError(
                    f"the input files hold {total} {unit}; --val-fraction={val_fraction} splits "
                    f"them into {cut} train and {total - cut} val tokens, and each split needs at "
                    "least 2")
            train_shards, val_shards = _cut_shards(stage, train.shards, cut, itemsize)
            meta_val = {"val_fraction": val_fraction}
        else:
            for name, flag in (("train", "the input files"), ("val", "the --val input files")):
                if splits[name].total < 2:
                    raise ConfigError(f"{flag} hold {splits[name].total} {unit}; the {name} split "
                                      "needs at least 2")
            cut, train_shards, val_shards = None, train.shards, val.shards
            meta_val = {"val_sources": [str(p) for p in val_inputs]}
        train_documents, val_documents = _write_indexes(stage, train, val, cut)
        meta.update(train_tokens=sum(train_shards), val_tokens=sum(val_shards), max_token_id=top,
                    text_bytes=nbytes, sources=[str(p) for p in inputs], **meta_val,
                    files=len(sources["train"]) + len(sources["val"]),
                    train_documents=train_documents, val_documents=val_documents,
                    train_shards=train_shards, val_shards=val_shards,
                    shard_tokens=shard_bytes // itemsize, ids_sha256=ids_hash.hexdigest())
        if tokenizer is not None:
            stage.step = "writing the tokenizer files"
            meta["tokenizer_source"] = str(file.absolute())
            tk.write_files(file, eot, stage.path)
        stage.step = "writing meta.json"
        (stage.path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def summary(meta: dict, out: Path, seconds: float, workers: int) -> list[str]:
    """What `data prepare` prints: the throughput, then the dir and how to train on it."""
    mb, seconds = meta["text_bytes"] / 1e6, max(seconds, 1e-9)
    tokens = meta["train_tokens"] + meta["val_tokens"]
    how = ("byte-level" if meta["tokenizer"] == tk.BYTES else
           f"{meta['tokenizer_source']}, {workers} worker process(es)")
    vocab = ("" if meta["tokenizer"] == tk.BYTES else
             f" model.vocab_size={vocab_to_use(meta['vocab_size'])}")
    shards = len(meta["train_shards"]) + len(meta["val_shards"])
    return [f"tokenized {mb:,.1f} MB of text from {meta['files']} file(s) in {seconds:.1f} s: "
            f"{mb / seconds:,.2f} MB/s, {tokens / seconds:,.0f} tokens/s ({how})",
            f"wrote {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens in "
            f"{meta['train_documents']:,} + {meta['val_documents']:,} documents, {shards} shard "
            f"file(s) (vocab {meta['vocab_size']}, {meta['dtype']}); train with: partrain launch "
            f"data=tokens data.path={out}{vocab}"]

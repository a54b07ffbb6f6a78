"""`partrain data prepare`: text, JSON Lines and Parquet files, or directories of them, tokenized
into a token dir (tokens.py reads it).

Inputs are documents: a text file is one, a JSON Lines line or a Parquet row is one (its `--field`,
"text" by default; JSON Lines through pyarrow's JSON reader, Parquet through pyarrow.parquet). A
directory stands for the files under it, recursively, in sorted order, hidden names skipped; the
suffix says the kind (.jsonl/.ndjson, .parquet, anything else text).

Two tokenizers:
- bytes (the default): a token per byte of the file, documents joined by a newline, ids uint8;
- `--tokenizer tokenizer.json` (the `tokenizers` library): every document followed by the
  end-of-text token, ids uint16 when the vocabulary fits, else uint32, encoded by as many worker
  processes as cores, each tokenizing ~1 MiB of text at a time, the results written in input order.

The ids stream to `train.bin` as they come; the last `--val-fraction` of them then moves to
`val.bin`. Everything is written under a temporary name beside `--out` and renamed into place at
the end; a failure or Ctrl-C leaves nothing behind.
"""

import itertools
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

from partrain.config.paths import what_is
from partrain.data import tokenizer as tk
from partrain.data.format import FORMAT, vocab_to_use
from partrain.errors import ConfigError
from partrain.staging import check_out, staged_dir

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_CHARS = 1 << 20  # text per task sent to a worker process
ROWS_PER_BATCH = 4096  # Parquet rows read at a time
# pyarrow reads JSON Lines in blocks, and a record must fit in one: a document of up to this much
# JSON is read (the reader's own default, 1 MiB, refuses a long book as a "straddling object").
JSONL_BLOCK_BYTES = 64 << 20
# --workers is at most this many per core: more processes than cores only take turns on them, and
# each one holds a tokenizer and its share of the text. The bound keeps a typo (`--workers 100000`)
# from forking until the system refuses.
WORKERS_PER_CORE = 4


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


# ---- inputs ----------------------------------------------------------------------------------
def _check_file(file: Path) -> None:
    found = what_is(file)
    if found == "is a regular file":
        return
    # A pipe or device could be endless or read only once; a file can be read again.
    hint = "; save its contents to a file first" if found.startswith("is not a regular") else ""
    raise ConfigError(f"input file {file} {found}{hint}")


def collect_inputs(paths: list[Path]) -> list[Path]:
    """The files the inputs stand for, in order: a directory's regular files recursively, in
    sorted order, hidden files and directories skipped."""
    files = []
    for path in paths:
        if not path.is_dir():
            _check_file(path)
            files.append(path)
            continue
        found = []
        for root, dirs, names in os.walk(path, onerror=_walk_error):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [Path(root) / n for n in sorted(names)
                      if not n.startswith(".") and (Path(root) / n).is_file()]
        if not found:
            raise ConfigError(f"input directory {path} holds no files (hidden ones are skipped)")
        files += found
    return files


def _walk_error(e: OSError) -> None:
    raise ConfigError(f"input directory {e.filename} cannot be read: {_reason(e)}")


def _kind(file: Path) -> str:
    suffix = file.suffix.lower()
    return "jsonl" if suffix in JSONL_SUFFIXES else "parquet" if suffix in PARQUET_SUFFIXES else "text"


def _jsonl_texts(file: Path, field: str) -> Iterator:
    import pyarrow as pa
    import pyarrow.json as pj

    # Only `field` is parsed, as a string: other fields are skipped, a number there is an error.
    options = pj.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]),
                              unexpected_field_behavior="ignore")
    try:
        for batch in pj.open_json(file, read_options=pj.ReadOptions(block_size=JSONL_BLOCK_BYTES),
                                  parse_options=options):
            yield batch.column(0).to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        # pyarrow counts rows within a block, and lets bytes that are not UTF-8 through to
        # to_pylist: the file is read again, line by line, for the line to name.
        found = _jsonl_bad_line(file, field) or str(e).splitlines()[0][:300]
        raise ConfigError(f"input file {file} is not JSON Lines with a string field {field!r} "
                          f"in every object ({found})") from None


def _jsonl_bad_line(file: Path, field: str) -> str | None:
    """The first line of a JSON Lines file that breaks the format (one JSON object per line, in
    UTF-8), and how, in words; None when each line is fine on its own. For the message only."""
    try:
        with open(file, "rb") as f:
            return _first_bad_line(f, field)
    except OSError:
        return None


def _first_bad_line(f, field: str) -> str | None:
    for number in itertools.count(1):
        raw = f.readline(JSONL_BLOCK_BYTES + 1)
        if not raw:
            return None
        if len(raw) > JSONL_BLOCK_BYTES:
            return (f"line {number} is longer than {JSONL_BLOCK_BYTES:,} bytes, the longest "
                    "record partrain reads; give so long a document as a text file")
        if number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark, as pyarrow allows
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return (f"line {number}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not "
                    "UTF-8, and JSON Lines is UTF-8 text")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            return f"line {number}: JSON nested too deep"
        except ValueError as e:  # JSONDecodeError is a ValueError
            return f"line {number}: not JSON ({getattr(e, 'msg', e)} at column " \
                   f"{getattr(e, 'colno', '?')})"
        if not isinstance(record, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
            return f"line {number}: {kind.get(type(record), 'a number')}, not a JSON object"
        text = record.get(field)
        if text is not None and not isinstance(text, str):
            return f"line {number}: field {field!r} (--field) holds {text!r:.40}, not a string"
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                return (f"line {number}: field {field!r} holds the unpaired surrogate "
                        f"\\u{ord(text[e.start]):04x}, which is not text")


def _parquet_texts(file: Path, field: str) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"input file {file} is not a Parquet file ({str(e)[:300]})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise ConfigError(f"input file {file} has no column {field!r} (--field); its columns: "
                          f"{', '.join(schema.names)}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"input file {file}: column {field!r} (--field) holds {kind}, not text")
    row = 0  # of the batch being read, for a message
    try:
        for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[field]):
            column = batch.column(0)
            try:
                texts = column.to_pylist()
            except UnicodeDecodeError:  # Parquet does not check that its strings are UTF-8
                bad = next(i for i in range(len(column)) if not _utf8(column[i]))
                raise ConfigError(f"input file {file}, row {row + bad + 1}: column {field!r} "
                                  "(--field) holds bytes that are not UTF-8; a document must be "
                                  "UTF-8 text") from None
            row += len(column)
            yield texts
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"input file {file} cannot be read as Parquet ({str(e)[:300]})") from None


def _utf8(value) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def documents(file: Path, field: str, as_text: bool) -> Iterator[tuple[str | bytes, int]]:
    """(document, its size in bytes) for each non-empty document of `file`: bytes for a text file
    read by the byte tokenizer, else str."""
    kind = _kind(file)
    if kind == "text":
        try:
            raw = file.read_bytes()
        except OSError as e:
            raise ConfigError(f"input file {file} cannot be read: {_reason(e)}") from None
        if not as_text:
            yield raw, len(raw)
            return
        try:
            yield raw.decode("utf-8-sig"), len(raw)  # a leading byte-order mark is dropped
        except UnicodeDecodeError as e:
            raise ConfigError(f"input file {file} is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                              f"offset {e.start}); the tokenizer reads text") from None
        return
    found = False
    for texts in (_jsonl_texts if kind == "jsonl" else _parquet_texts)(file, field):
        for text in texts:
            if text:  # null and "" are no document
                found = True
                data = text.encode("utf-8")
                yield (text if as_text else data), len(data)
    if not found:
        raise ConfigError(f"input file {file} holds no text in field {field!r} (--field names "
                          "the field of each record that holds the document)")


# ---- output ----------------------------------------------------------------------------------
def _split(tmp: Path, dtype: str, total: int, cut: int) -> None:
    """Move ids [cut, total) of train.bin to val.bin."""
    size = np.dtype(dtype).itemsize
    with open(tmp / "train.bin", "r+b") as train:
        train.seek(cut * size)
        with open(tmp / "val.bin", "wb") as val:
            shutil.copyfileobj(train, val, 1 << 24)
        train.truncate(cut * size)


# ---- tokenization ----------------------------------------------------------------------------
def _chunks(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    """Documents grouped into tasks of about CHUNK_CHARS characters, with their bytes."""
    chunk, chars, nbytes = [], 0, 0
    for doc, size in docs:
        chunk.append(doc)
        chars, nbytes = chars + len(doc), nbytes + size
        if chars >= CHUNK_CHARS:
            yield chunk, nbytes
            chunk, chars, nbytes = [], 0, 0
    if chunk:
        yield chunk, nbytes


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
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
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
                f"({_reason(e)}); give fewer --workers") from None
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _encode_all(chunks, file: Path, eot_id: int, dtype: str, pool, workers: int):
    """(ids, bytes) per chunk, in order: encoded here without a pool, else by the pool's
    processes, at most two tasks per process in flight."""
    if pool is None:
        tok = tk.load(file)
        for docs, nbytes in chunks:
            yield tk.encode(tok, eot_id, dtype, docs), nbytes
        return
    pending, window = deque(), 2 * workers
    for docs, nbytes in chunks:
        pending.append((pool.submit(tk.encode_documents, docs), nbytes))
        while len(pending) >= window:
            future, done = pending.popleft()
            yield future.result(), done
    while pending:
        future, done = pending.popleft()
        yield future.result(), done


def _byte_ids(docs: Iterator[tuple[bytes, int]]):
    newline = np.array([10], dtype=np.uint8)
    for i, (doc, size) in enumerate(docs):
        ids = np.frombuffer(doc, dtype=np.uint8)
        yield (ids if i == 0 else np.concatenate([newline, ids])), size


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


def prepare_token_dir(inputs: list[Path], out: Path, val_fraction: float, tokenizer: Path | None = None,
                      field: str = "text", eot: str | None = None, workers: int | None = None,
                      console=None) -> dict:
    """Tokenize `inputs` into a new token dir `out`; returns its meta.json."""
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
        raise ConfigError(f"--out {out} cannot be inspected: {_reason(e)}") from None
    files = collect_inputs(inputs)
    meta = {"format": FORMAT}
    if tokenizer is None:
        meta.update(tokenizer=tk.BYTES, dtype="uint8", vocab_size=tk.BYTE_VOCAB)
    else:
        file = tk.tokenizer_file(tokenizer)
        tok = tk.load(file)
        eot, eot_id = tk.end_of_text(tok, file, eot)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        meta.update(tokenizer=tk.TOKENIZER_FILE, dtype="uint16" if vocab <= 1 << 16 else "uint32",
                    vocab_size=vocab, eot_token=eot, eot_id=eot_id)
    docs = (d for f in files for d in documents(f, field, as_text=tokenizer is not None))
    total, nbytes, top = 0, 0, -1
    parallel = tokenizer is not None and workers > 1
    with staged_dir(out) as stage, \
            (_pool(file, eot_id, meta["dtype"], workers) if parallel else nullcontext()) as pool:
        tmp, stage.step = stage.path, "writing train.bin"
        with open(tmp / "train.bin", "wb") as stream, _progress(console) as progress:
            bar = progress.add_task("tokenizing", total=sum(f.stat().st_size for f in files))
            encoded = (_byte_ids(docs) if tokenizer is None else
                       _encode_all(_chunks(docs), file, eot_id, meta["dtype"], pool, workers))
            for ids, size in encoded:
                stream.write(ids.tobytes())
                total, nbytes = total + len(ids), nbytes + size
                top = max(top, int(ids.max())) if len(ids) else top
                progress.update(bar, advance=size)
        cut = int(total * (1 - val_fraction))
        if cut < 2 or total - cut < 2:
            unit = "bytes" if tokenizer is None else "tokens"
            raise ConfigError(
                f"the input files hold {total} {unit}; --val-fraction={val_fraction} splits them "
                f"into {cut} train and {total - cut} val tokens, and each split needs at least 2")
        stage.step = "writing val.bin"
        _split(tmp, meta["dtype"], total, cut)
        meta.update(train_tokens=cut, val_tokens=total - cut, max_token_id=top,
                    text_bytes=nbytes, sources=[str(p) for p in inputs], files=len(files))
        if tokenizer is not None:
            stage.step = "writing the tokenizer files"
            meta["tokenizer_source"] = str(file.absolute())
            tk.write_files(file, eot, tmp)
        stage.step = "writing meta.json"
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def summary(meta: dict, out: Path, seconds: float, workers: int) -> list[str]:
    """What `data prepare` prints: the throughput, then the dir and how to train on it."""
    mb, seconds = meta["text_bytes"] / 1e6, max(seconds, 1e-9)
    tokens = meta["train_tokens"] + meta["val_tokens"]
    how = ("byte-level" if meta["tokenizer"] == tk.BYTES else
           f"{meta['tokenizer_source']}, {workers} worker process(es)")
    vocab = ("" if meta["tokenizer"] == tk.BYTES else
             f" model.vocab_size={vocab_to_use(meta['vocab_size'])}")
    return [f"tokenized {mb:,.1f} MB of text from {meta['files']} file(s) in {seconds:.1f} s: "
            f"{mb / seconds:,.2f} MB/s, {tokens / seconds:,.0f} tokens/s ({how})",
            f"wrote {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
            f"(vocab {meta['vocab_size']}, {meta['dtype']}); train with: partrain launch "
            f"data=tokens data.path={out}{vocab}"]

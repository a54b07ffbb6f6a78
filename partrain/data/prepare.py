"""`partrain data prepare`: text, JSON Lines, Parquet and Arrow files, Hugging Face datasets saved
with `save_to_disk`, or directories of them, tokenized into a token dir (format.py says what it
holds, tokens.py reads it).

Inputs are documents: a non-empty text file is one, a JSON Lines line, a Parquet row or an Arrow
record is one (its `--field`, "text" by default; JSON Lines through pyarrow's JSON reader, Parquet
through pyarrow.parquet, Arrow through pyarrow.ipc). A directory stands for the files under it,
recursively, in sorted order, hidden names skipped; the suffix says the kind (.jsonl/.ndjson,
.parquet, .arrow, anything else text). A directory that `datasets.Dataset.save_to_disk` wrote
(state.json, dataset_info.json, data-*.arrow) stands for its Arrow files in state.json's order.

Two tokenizers:
- bytes (the default): a token per byte of the file, documents joined by a newline, ids uint8;
- `--tokenizer tokenizer.json` (the `tokenizers` library): every document followed by the
  end-of-text token, ids uint16 when the vocabulary fits, else uint32, encoded by as many worker
  processes as cores, each tokenizing ~1 MiB of text at a time, the results written in input order.

The ids stream to shard files of at most `--shard-mb` (train-00000.bin, ...) as they come, the
documents' start offsets to a file beside, so memory stays bounded whatever the input's size
(a document is held whole, and a text file is one). With `--val INPUTS` the val split is made from
those; else the last `--val-fraction` of the ids moves to the val split at the end (the shard
holding the cut is split, the shards after it are renamed). Everything is written under a
temporary name beside `--out` and renamed into place at the end; a failure or Ctrl-C leaves
nothing behind.
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
from partrain.data.format import (
    FORMAT,
    INDEX_DTYPE,
    SHARD_MB,
    index_name,
    shard_name,
    vocab_to_use,
)
from partrain.errors import ConfigError
from partrain.staging import check_out, staged_dir

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
# What `datasets` writes into a directory with save_to_disk: a Dataset's state.json names its Arrow
# files in order; a DatasetDict's dataset_dict.json names its splits, each a Dataset's directory.
HF_STATE, HF_INFO, HF_SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"
VAL_FRACTION = 0.05  # --val-fraction's default
INDEX_CHUNK = 1 << 20  # document offsets read at a time when the index is written
CHUNK_CHARS = 1 << 20  # text per task sent to a worker process
# A text file (one document) is read in pieces of about this many bytes, cut after a newline
# that a printable non-space character follows (_text_pieces): memory stays bounded for any file size.
TEXT_PIECE_BYTES = 16 << 20
ROWS_PER_BATCH = 4096  # Parquet rows read at a time
# pyarrow reads JSON Lines in blocks, and a record must fit in one: a document of up to this much
# JSON is read (the reader's own default, 1 MiB, refuses a long book as a "straddling object").
JSONL_BLOCK_BYTES = 64 << 20
JSONL_CHUNK_BYTES = 16 << 20  # whole lines parsed at a time (_jsonl_chunks): bounded memory
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
            dataset = _hf_dataset_files(Path(root))
            if dataset is not None:  # its Arrow files, not its JSON files as text
                found += dataset
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [Path(root) / n for n in sorted(names)
                      if not n.startswith(".") and (Path(root) / n).is_file()]
        if not found:
            raise ConfigError(f"input directory {path} holds no files (hidden ones are skipped)")
        files += found
    return files


def _walk_error(e: OSError) -> None:
    raise ConfigError(f"input directory {e.filename} cannot be read: {_reason(e)}")


def _json_file(file: Path, directory: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"input directory {directory}: its {file.name} cannot be read as JSON "
                          f"({str(e)[:200]})") from None


def _hf_dataset_files(directory: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face dataset that `save_to_disk` wrote into `directory`, in
    its order; None when it is not one. A DatasetDict is refused: which split trains and which
    validates is the user's to say."""
    if (directory / HF_SPLITS).is_file():
        splits = _json_file(directory / HF_SPLITS, directory)
        splits = splits.get("splits") if isinstance(splits, dict) else None
        splits = [s for s in splits if isinstance(s, str)] if isinstance(splits, list) else []
        train = "train" if "train" in splits else (splits or ["train"])[0]
        val = next((s for s in ("validation", "valid", "val", "test") if s in splits),
                   next((s for s in splits if s != train), None))
        example = f"{directory / train}" + (f" --val {directory / val}" if val else "")
        raise ConfigError(
            f"input directory {directory} is a Hugging Face DatasetDict (splits: "
            f"{', '.join(splits) or 'none named'}); give the directory of a split, e.g. {example}")
    if not ((directory / HF_STATE).is_file() and (directory / HF_INFO).is_file()):
        return None
    state = _json_file(directory / HF_STATE, directory)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries):
        raise ConfigError(
            f"input directory {directory} looks like a Hugging Face dataset ({HF_STATE}, "
            f"{HF_INFO}), but its {HF_STATE} names no Arrow files in \"_data_files\"")
    files = [directory / entry["filename"] for entry in entries]
    for file in files:
        _check_file(file)
    return files


def _kind(file: Path) -> str:
    suffix = file.suffix.lower()
    return ("jsonl" if suffix in JSONL_SUFFIXES else "parquet" if suffix in PARQUET_SUFFIXES else
            "arrow" if suffix in ARROW_SUFFIXES else "text")


def _jsonl_chunks(file: Path) -> Iterator[bytes]:
    """The file's whole lines, about JSONL_CHUNK_BYTES at a time. (pyarrow's own streaming
    reader reads far ahead of its consumer: a 5 GB file held 2.9 GB resident.) A line longer
    than JSONL_BLOCK_BYTES is refused, naming it, as the reader's block would refuse it."""
    try:
        with open(file, "rb") as f:
            lines, size = [], 0
            while line := f.readline(JSONL_BLOCK_BYTES + 1):
                if len(line) > JSONL_BLOCK_BYTES:
                    raise _JsonlTooLong(f"a line longer than {JSONL_BLOCK_BYTES:,} bytes")
                lines.append(line)
                size += len(line)
                if size >= JSONL_CHUNK_BYTES:
                    yield b"".join(lines)
                    lines, size = [], 0
            if lines:
                yield b"".join(lines)
    except OSError as e:
        raise ConfigError(f"input file {file} cannot be read: {_reason(e)}") from None


class _JsonlTooLong(Exception):
    """A JSON Lines record longer than the reader takes (named by _jsonl_bad_line)."""


def _jsonl_texts(file: Path, field: str) -> Iterator:
    import pyarrow as pa
    import pyarrow.json as pj

    # Only `field` is parsed, as a string: other fields are skipped, a number there is an error.
    options = pj.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]),
                              unexpected_field_behavior="ignore")
    read = pj.ReadOptions(block_size=JSONL_BLOCK_BYTES, use_threads=False)
    try:
        for chunk in _jsonl_chunks(file):
            table = pj.read_json(pa.py_buffer(chunk), read_options=read, parse_options=options)
            for column in table.column(0).chunks:
                yield column.to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError, _JsonlTooLong) as e:
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
    _check_text_column(file, parquet.schema_arrow, field)
    # A row group at a time (iter_batches reads ahead: 1.4 GB resident for a 0.6 GB file).
    batches = (batch for group in range(parquet.num_row_groups)
               for batch in parquet.read_row_group(group, columns=[field], use_threads=False)
               .to_batches(max_chunksize=ROWS_PER_BATCH))
    try:
        yield from _column_texts(file, field, (batch.column(0) for batch in batches))
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"input file {file} cannot be read as Parquet ({str(e)[:300]})") from None


def _arrow_texts(file: Path, field: str) -> Iterator:
    """An Arrow IPC stream (what `datasets` writes) or file, a record batch at a time: read
    through the file, not mapped, so that what was read is let go."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        source = pa.OSFile(str(file))
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"input file {file} cannot be read: {str(e)[:300]}") from None
    with source:
        try:
            reader = ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:
            try:
                source.seek(0)
                reader = ipc.open_file(source)
            except (pa.ArrowException, OSError) as e:
                raise ConfigError(f"input file {file} is not an Arrow stream or file "
                                  f"({str(e)[:300]})") from None
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        _check_text_column(file, reader.schema, field)
        try:
            yield from _column_texts(file, field, (batch.column(field) for batch in batches))
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"input file {file} cannot be read as Arrow "
                              f"({str(e)[:300]})") from None


def _check_text_column(file: Path, schema, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        raise ConfigError(f"input file {file} has no column {field!r} (--field); its columns: "
                          f"{', '.join(schema.names)}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"input file {file}: column {field!r} (--field) holds {kind}, not text")


def _column_texts(file: Path, field: str, columns) -> Iterator[list]:
    """Each column chunk's values as Python strings (None for null)."""
    row = 0  # of the chunk being read, for a message
    for column in columns:
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError:  # neither Parquet nor Arrow checks that strings are UTF-8
            bad = next(i for i in range(len(column)) if not _utf8(column[i]))
            raise ConfigError(f"input file {file}, row {row + bad + 1}: column {field!r} "
                              "(--field) holds bytes that are not UTF-8; a document must be "
                              "UTF-8 text") from None
        row += len(column)
        yield texts


def _utf8(value) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def _piece_cut(data: bytes) -> int:
    """The offset just after the last newline of `data` that a printable ASCII character other
    than a space follows (a line that starts a word), or -1."""
    at = len(data) - 1
    while (at := data.rfind(b"\n", 0, at)) >= 0:
        if 0x21 <= data[at + 1] <= 0x7E:
            return at + 1
    return -1


def _text_pieces(file: Path) -> Iterator[tuple[bytes, int]]:
    """A text file's bytes in pieces of about TEXT_PIECE_BYTES, each (bytes, its offset in the
    file), cut after a newline that a printable non-space ASCII character follows: tokenizers'
    pre-tokenizers split there (a newline is never merged into the word after it), so each piece
    encodes as it would inside the whole file. A file with no such newline is one piece."""
    try:
        with open(file, "rb") as f:
            carry, offset = b"", 0
            while block := f.read(TEXT_PIECE_BYTES):
                data = carry + block
                cut = _piece_cut(data)
                if cut <= 0:
                    carry = data
                    continue
                yield data[:cut], offset
                carry, offset = data[cut:], offset + cut
            if carry:
                yield carry, offset
    except OSError as e:
        raise ConfigError(f"input file {file} cannot be read: {_reason(e)}") from None


def _text_documents(file: Path, as_text: bool) -> Iterator[tuple[str | bytes, int, bool]]:
    """A text file as one document, in pieces (`_text_pieces`): (piece, its bytes, whether the
    document ends with it)."""
    previous = None
    for raw, offset in _text_pieces(file):
        if previous is not None:
            yield (*previous, False)
        if as_text:
            try:  # a leading byte-order mark is dropped
                raw_text = raw.decode("utf-8-sig" if offset == 0 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"input file {file} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                    f"{offset + e.start}); the tokenizer reads text") from None
            previous = (raw_text, len(raw))
        else:
            previous = (raw, len(raw))
    if previous is not None:  # an empty file is no document, as an empty record is none
        yield (*previous, True)


def documents(file: Path, field: str, as_text: bool) -> Iterator[tuple[str | bytes, int, bool]]:
    """(document or piece of one, its size in bytes, whether a document ends with it) for each
    non-empty document of `file`: bytes for the byte tokenizer, else str. A text file (one
    document) comes in pieces, so that a file of any size is read in bounded memory."""
    kind = _kind(file)
    if kind == "text":
        yield from _text_documents(file, as_text)
        return
    found = False
    reader = {"jsonl": _jsonl_texts, "parquet": _parquet_texts, "arrow": _arrow_texts}[kind]
    for texts in reader(file, field):
        for text in texts:
            if text:  # null and "" are no document
                found = True
                data = text.encode("utf-8")
                yield (text if as_text else data), len(data), True
    if not found:
        raise ConfigError(f"input file {file} holds no text in field {field!r} (--field names "
                          "the field of each record that holds the document)")


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
    """((ids, ids per piece), whether each piece ends a document, text bytes) per chunk, in
    order: encoded here without a pool,
    else by the pool's processes, at most two tasks per process in flight."""
    if pool is None:
        tok = tk.load(file)
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
        raise ConfigError(f"--out {out} cannot be inspected: {_reason(e)}") from None
    sources = {"train": collect_inputs(inputs),
               "val": collect_inputs(val_inputs) if val_inputs else []}
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
    itemsize = np.dtype(meta["dtype"]).itemsize
    if shard_bytes < itemsize:
        raise ConfigError(f"a shard of {shard_bytes} bytes holds no {meta['dtype']} id")
    unit = "bytes" if tokenizer is None else "tokens"
    nbytes, top, splits = 0, -1, {}
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
                    shard_tokens=shard_bytes // itemsize)
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

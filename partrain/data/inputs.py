"""The inputs of `partrain data prepare` (prepare.py), read as documents in bounded memory.

A non-empty text file is one document, read in pieces of TEXT_PIECE_BYTES cut where a line
starts a word (`_text_pieces`), so a file of any size is read in bounded memory; the pieces
encode as the whole file would for the bytes and for tokenizers that split at such a newline and
add nothing at a string's start (GPT-2-style ByteLevel BPE, add_prefix_space off), but not
exactly for others (`_text_pieces` says how); a JSON Lines line, a Parquet row or an Arrow
record is one (its `--field`, "text" by default): JSON Lines JSONL_CHUNK_BYTES of whole lines
at a time through pyarrow's JSON parser, Parquet a row group at a time through pyarrow.parquet,
Arrow a record batch at a time through pyarrow.ipc (pyarrow's own streaming readers read far
ahead of their consumer). A
directory stands for the files under it, recursively, in sorted order, hidden names skipped; the
suffix says the kind (.jsonl/.ndjson, .parquet, .arrow, anything else text). A directory that
`datasets.Dataset.save_to_disk` wrote (state.json, dataset_info.json, data-*.arrow) stands for
its Arrow files in state.json's order.

Refused rather than read (`input_files`): a partrain token dir, given or found under a directory
(its meta.json, shards and indexes are not text; a token dir written beside the text, as
`data prepare data/ --out data/tokens` does, is the case), a partrain run dir the same way (its
checkpoints, logs and metrics: `data prepare . --out tokens` in a project whose runs/ holds
runs), a compressed file (gzip, zstd, bzip2, xz: by its name or its first bytes; its bytes
would be tokenized as text), and a file read twice, whether given
twice, found under two inputs, or both an input and a --val input (a val split of training text),
under one name or two (a symbolic or a hard link: the same device and inode is the same file).
"""

import itertools
import json
import os
from pathlib import Path
from typing import Iterator

from partrain.config.frozen import CONFIG
from partrain.config.paths import what_is
from partrain.errors import ConfigError, reason

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
# What `datasets` writes into a directory with save_to_disk: a Dataset's state.json names its Arrow
# files in order; a DatasetDict's dataset_dict.json names its splits, each a Dataset's directory.
HF_STATE, HF_INFO, HF_SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"
# A text file (one document) is read in pieces of about this many bytes, cut after a newline
# between printable non-space characters (_text_pieces): bounded memory for any file size.
TEXT_PIECE_BYTES = 16 << 20
ROWS_PER_BATCH = 4096  # Parquet rows turned into Python strings at a time
# pyarrow reads JSON Lines in blocks, and a record must fit in one: a document of up to this much
# JSON is read (the reader's own default, 1 MiB, refuses a long book as a "straddling object").
JSONL_BLOCK_BYTES = 64 << 20
JSONL_CHUNK_BYTES = 16 << 20  # whole lines parsed at a time (_jsonl_chunks): bounded memory


def _check_file(file: Path) -> None:
    found = what_is(file)
    if found == "is a regular file":
        return
    # A pipe or device could be endless or read only once; a file can be read again.
    hint = "; save its contents to a file first" if found.startswith("is not a regular") else ""
    raise ConfigError(f"input file {file} {found}{hint}")


# Compressed files: by name, and by their first bytes (a .jsonl that is gzip inside). Read as
# they are, their compressed bytes would be tokenized as text. bzip2's "BZh" is text too: its
# block size digit and the magic of its first block (or of its end, empty) make it bzip2.
COMPRESSED = {"gzip": (".gz", ".tgz", ".gzip"), "zstd": (".zst", ".zstd", ".tzst"),
              "bzip2": (".bz2", ".tbz2"), "xz": (".xz", ".txz", ".lzma")}
DECOMPRESS = {"gzip": "gunzip", "zstd": "zstd -d", "bzip2": "bunzip2", "xz": "unxz"}


def _compression(file: Path) -> tuple[str, str] | None:
    """(format, how it shows: its name or its first bytes) of a compressed file, else None."""
    name = file.name.lower()
    for kind, suffixes in COMPRESSED.items():
        for suffix in suffixes:
            if name.endswith(suffix):
                return kind, f"its name ends in {suffix}"
    try:
        with open(file, "rb") as f:
            head = f.read(10)
    except OSError as e:
        raise ConfigError(f"input file {file} cannot be read: {reason(e)}") from None
    bzip2 = (head[:3] == b"BZh" and b"1" <= head[3:4] <= b"9"
             and head[4:10] in (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90"))
    for kind, found in (("gzip", head[:2] == b"\x1f\x8b"),
                        ("zstd", head[:4] == b"\x28\xb5\x2f\xfd"),
                        ("bzip2", bzip2), ("xz", head[:6] == b"\xfd7zXZ\x00")):
        if found:
            return kind, f"it starts with {kind}'s magic bytes"
    return None


def _refuse_compressed(file: Path, given: Path, flag: str) -> None:
    found = _compression(file)
    if found is None:
        return
    kind, why = found
    what = f"{flag} file {file}" + ("" if file == given else f" (under {flag} {given})")
    raise ConfigError(
        f"{what} is {kind}-compressed ({why}): data prepare reads text, JSON Lines, Parquet and "
        f"Arrow files as they are, and would tokenize the compressed bytes; decompress it "
        f"first ({DECOMPRESS[kind]} {file}) and give the decompressed file")


def collect_inputs(paths: list[Path], flag: str = "input") -> list[Path]:
    """The files the inputs stand for, in order: a directory's regular files recursively, in
    sorted order, hidden files and directories skipped. A partrain token dir, given or under a
    directory, is refused. `flag` names the inputs in messages ("input", "--val")."""
    files = []
    for path in paths:
        if not path.is_dir():
            _check_file(path)
            _refuse_token_dir_file(path, flag)
            _refuse_run_dir(path.parent, path, flag)
            _refuse_compressed(path, path, flag)
            files.append(path)
            continue
        found = []
        for root, dirs, names in os.walk(path, onerror=_walk_error):
            _refuse_token_dir(Path(root), path, flag)
            _refuse_run_dir(Path(root), path, flag)
            dataset = _hf_dataset_files(Path(root))
            if dataset is not None:  # its Arrow files, not its JSON files as text
                found += dataset
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            here = [Path(root) / n for n in sorted(names)
                    if not n.startswith(".") and (Path(root) / n).is_file()]
            for file in here:
                _refuse_compressed(file, path, flag)
            found += here
        if not found:
            raise ConfigError(f"input directory {path} holds no files (hidden ones are skipped)")
        files += found
    return files


def input_files(inputs: list[Path], val_inputs: list[Path]) -> tuple[list[Path], list[Path]]:
    """The files of the inputs and of the --val inputs (collect_inputs), each file once: one
    read twice (the same input given twice, a file also under a directory given, a --val input
    that is also an input) is refused, naming both inputs."""
    # Keyed by the file itself, (device, inode), not by its real path: a hard link
    # (`ln train.txt val.txt`) has a real path of its own and is the same text.
    seen: dict[tuple[int, int], tuple[str, Path, Path]] = {}  # -> (flag, input given, file)
    out = []
    for flag, given in (("input", inputs), ("--val", val_inputs)):
        files = []
        for path in given:
            for file in collect_inputs([path], flag):
                try:
                    st = os.stat(file)
                except OSError as e:
                    raise ConfigError(f"{flag} file {file} cannot be read: {reason(e)}") from None
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    raise ConfigError(_read_twice(seen[key], (flag, path, file)))
                seen[key] = (flag, path, file)
                files.append(file)
        out.append(files)
    return out[0], out[1]


def _read_twice(first: tuple[str, Path, Path], second: tuple[str, Path, Path]) -> str:
    """The message for a file that two inputs (or one, given twice) would read: each is
    (flag, input given, file)."""
    (flag1, given1, file1), (flag2, given2, file2) = first, second

    def named(flag, given, file):
        return f"{flag} {given}" + ("" if file == given else f" (its file {file})")

    def read_as(flag, given, file, other):
        if file == given:
            return f"{flag} {given}"
        return f"part of {flag} {given}" + ("" if file == other else f" (as {file})")

    if flag1 != flag2:
        move = f" (move {file2} out of {given1})" if file1 != given1 else ""
        return (f"{named(flag2, given2, file2)} is also read for training, as "
                f"{read_as(flag1, given1, file1, file2)}: a val split of the training text "
                f"measures nothing; give --val inputs that are not among the inputs{move}")
    if given1 == given2 and file1 == file2:
        return f"{flag1} {given1} is given twice: its text would be read twice; give it once"
    if given1 == given2:
        both = f"{flag1} {given1} holds {file1} and {file2}, which are the same file"
    elif file1 == given1 and file2 == given2:
        both = f"{flag2} {given2} is the same file as {flag1} {given1}"
    elif file2 == given2:
        both = f"{flag2} {given2} is also read as {read_as(flag1, given1, file1, file2)}"
    elif file1 == given1:
        both = f"{flag1} {given1} is also read as {read_as(flag2, given2, file2, file1)}"
    else:
        both = f"{named(flag1, given1, file1)} and {named(flag2, given2, file2)} are the same file"
    return f"{both}: its text would be read twice; give each file once"


def _token_dir_format(directory: Path) -> str | None:
    """The format of the partrain token dir `directory` is (its meta.json's "format"), or None."""
    meta = directory / "meta.json"
    try:
        # A token dir's meta.json is a few hundred bytes; a big one is some other file.
        if not meta.is_file() or meta.stat().st_size > 1 << 20:
            return None
        value = json.loads(meta.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError):
        return None
    found = value.get("format") if isinstance(value, dict) else None
    # Any version of partrain's format, a later one too (format.FORMATS are the ones read).
    return found if isinstance(found, str) and found.startswith("partrain-tokens/") else None


def _refuse_token_dir(directory: Path, given: Path, flag: str) -> None:
    found = _token_dir_format(directory)
    if found is None:
        return
    what = (f"{flag} directory {given} is a partrain token dir" if directory == given else
            f"{flag} directory {given} holds a partrain token dir, {directory}")
    raise ConfigError(
        f"{what} (its meta.json says format {found!r}); data prepare reads text, and would read "
        "the token dir's meta.json, shards and indexes as text; give the text files instead"
        + (f" (train on the token dir as it is: data=tokens data.path={directory})"
           if directory == given else f", or move the token dir out of {given}"))


def _refuse_token_dir_file(file: Path, flag: str) -> None:
    found = _token_dir_format(file.parent)
    if found is not None:
        raise ConfigError(
            f"{flag} file {file} is a file of the partrain token dir {file.parent} (its "
            f"meta.json says format {found!r}): data prepare reads text; give the text files "
            f"instead (train on the token dir as it is: data=tokens data.path={file.parent})")


# Beside its frozen config, what a launch writes into a run dir (launch/rundir.py,
# checkpoint/store.py).
RUN_DIR_ENTRIES = ("checkpoints", "metrics.jsonl", "logs")


def _is_run_dir(directory: Path) -> bool:
    """Whether `directory` is a partrain run dir: its frozen config and what a launch wrote."""
    try:
        return ((directory / CONFIG).is_file()
                and any((directory / entry).exists() for entry in RUN_DIR_ENTRIES))
    except OSError:
        return False


def _refuse_run_dir(directory: Path, given: Path, flag: str) -> None:
    if not _is_run_dir(directory):
        return
    if given == directory:
        what = f"{flag} directory {given} is a partrain run dir"
    elif given.is_dir():
        what = f"{flag} directory {given} holds a partrain run dir, {directory}"
    else:
        what = f"{flag} file {given} is a file of the partrain run dir {directory}"
    where = "" if given.is_file() or given == directory else f", or move the run dir out of {given}"
    written = ", ".join(e for e in RUN_DIR_ENTRIES if (directory / e).exists())
    raise ConfigError(
        f"{what} ({CONFIG} and {written}); "
        "data prepare reads text, and would read its checkpoints, logs and metrics as text; give "
        f"the text files instead{where}")


def _walk_error(e: OSError) -> None:
    raise ConfigError(f"input directory {e.filename} cannot be read: {reason(e)}")


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
        raise ConfigError(f"input file {file} cannot be read: {reason(e)}") from None


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
    """The offset just after the last newline of `data` between two printable ASCII characters
    other than a space (a line that ends in a word, then one that starts with one), or -1. A
    newline inside a run of whitespace is no cut: pre-tokenizers merge the run ("\n\n" is one
    token at the end of a piece, two before a word)."""
    at = len(data) - 1
    while (at := data.rfind(b"\n", 1, at)) >= 0:
        if 0x21 <= data[at + 1] <= 0x7E and 0x21 <= data[at - 1] <= 0x7E:
            return at + 1
    return -1


def _text_pieces(file: Path) -> Iterator[tuple[bytes, int]]:
    """A text file's bytes in pieces of about TEXT_PIECE_BYTES, each (bytes, its offset in the
    file), cut after a newline between printable non-space ASCII characters. A file with no such
    newline is one piece.

    Each piece is encoded as a string of its own. Byte-level pre-tokenizers (GPT-2's regex, with
    add_prefix_space off) split at that newline, merged neither into the word after it nor into
    other whitespace, so each piece encodes as it would inside the whole file. Not exactly so,
    at each cut (one per TEXT_PIECE_BYTES of a larger file; smaller files are one piece):
    - a tokenizer that acts at the start of a string (Metaspace with prepend_scheme "always" or
      "first", a Prepend normalizer, ByteLevel with add_prefix_space) adds its prefix (a "▁" or
      a space token) at the start of every piece, not only of the file;
    - a tokenizer that does not split at a newline (Metaspace splits at spaces; SentencePiece-
      style ones with no pre-tokenizer split nowhere) may merge across it in the whole file
      ("01\nline" one token), the pieces then end and start at the newline.
    A token or two differs per cut; the document and its end-of-text are unchanged. Not fixed:
    an exact cut would depend on the tokenizer (before a space for Metaspace, nowhere for some).
    For exact ids give such a file as records (JSON Lines, Parquet: a record is never cut)."""
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
        raise ConfigError(f"input file {file} cannot be read: {reason(e)}") from None


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

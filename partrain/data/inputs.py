"""The inputs of `partrain data prepare` (prepare.py), read as documents in bounded memory.

A non-empty text file is one document, read in pieces of TEXT_PIECE_BYTES cut where a line
starts a word (`_text_pieces`), so a file of any size is read in bounded memory; the pieces
encode as the whole file would for the bytes and for tokenizers that split at such a newline and
add nothing at a string's start (GPT-2-style ByteLevel BPE, add_prefix_space off), but not
exactly for others (`_text_pieces` says how); a JSON Lines line, a Parquet row or an Arrow
record is one (its `--field`, "text" by default): JSON Lines JSONL_CHUNK_BYTES of whole lines
at a time through pyarrow's JSON parser, Parquet a row group at a time through pyarrow.parquet,
Arrow a record batch at a time through pyarrow.ipc (pyarrow's own streaming readers read far
ahead of their consumer). The suffix says the kind (.jsonl/.ndjson, .parquet, .arrow,
anything else text).

Which files the inputs stand for (a directory's, a `datasets` save_to_disk's), and which are
refused rather than read, is input_paths.py's (`input_files`).
"""

import itertools
import json
from pathlib import Path
from typing import Iterator

from partrain.config.json_keys import KeyGivenTwice, once_each
from partrain.errors import ConfigError, reason

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
# A text file (one document) is read in pieces of about this many bytes, cut after a newline
# between printable non-space characters (_text_pieces): bounded memory for any file size. A
# piece goes to a tokenizer worker whole: one task's size (prepare.CHUNK_CHARS). At 16 MiB a BPE
# worker took 2.2 GB (the tokenizer's per-character alignments of one 16M-character string).
TEXT_PIECE_BYTES = 1 << 20
# A piece that found no such cut grows until this many pieces' bytes, then is cut anyway
# (_forced_cut): a CRLF or Cyrillic file had no cut at all and was read whole (11 GB of memory
# for 100 MB of text), each block copying the growing carry again.
MAX_CARRY_PIECES = 4
ROWS_PER_BATCH = 4096  # Parquet rows turned into Python strings at a time
# pyarrow reads JSON Lines in blocks, and a record must fit in one: a document of up to this much
# JSON is read (the reader's own default, 1 MiB, refuses a long book as a "straddling object").
JSONL_BLOCK_BYTES = 64 << 20
JSONL_CHUNK_BYTES = 16 << 20  # whole lines parsed at a time (_jsonl_chunks): bounded memory


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
            record = json.loads(line, object_pairs_hook=once_each)
        except RecursionError:
            return f"line {number}: JSON nested too deep"
        except KeyGivenTwice as e:  # pyarrow refuses it, naming a row counted from its block's start
            return f"line {number}: the key {e.args[0]!r} is given twice in one object"
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


def _word_byte(byte: int) -> bool:
    """Not ASCII whitespace or a control character: a printable character, or a byte of a
    UTF-8 character beyond ASCII (Cyrillic, CJK: every byte >= 0x80)."""
    return byte > 0x20 and byte != 0x7F


def _piece_cut(data: bytes) -> int:
    """The offset just after the last newline of `data` between two characters that are not
    whitespace (a line that ends in a word, then one that starts with one), or -1; in a CRLF
    file, between the "\r" and the "\n" of such a line end (GPT-2's regex splits "\r\nword" into
    "\r", "\n", "word": so do the two pieces). A newline inside a run of whitespace is no cut:
    pre-tokenizers merge the run ("\n\n" is one token at the end of a piece, two before a
    word)."""
    at = len(data) - 1
    while (at := data.rfind(b"\n", 1, at)) >= 0:
        if not _word_byte(data[at + 1]):
            continue
        if _word_byte(data[at - 1]):
            return at + 1
        if data[at - 1] == 0x0D and at >= 2 and _word_byte(data[at - 2]):
            return at
    return -1


def _forced_cut(data: bytes) -> int:
    """Where to cut a carry that found no clean cut in MAX_CARRY_PIECES pieces (a file of
    whitespace runs, one endless line): after its last newline, else its last space, else
    before its last UTF-8 character. The ids there may differ from the whole file's by a token
    or two (as _text_pieces says of every cut); the memory stays bounded."""
    for mark in (b"\n", b" "):
        at = data.rfind(mark)
        if at > 0:
            return at + 1
    at = len(data) - 1
    while at > 0 and 0x80 <= data[at] <= 0xBF:  # UTF-8 continuation bytes
        at -= 1
    return at if at > 0 else len(data)


def _text_pieces(file: Path) -> Iterator[tuple[bytes, int]]:
    """A text file's bytes in pieces of about TEXT_PIECE_BYTES, each (bytes, its offset in the
    file), cut after a newline between characters that are not whitespace (between "\r" and "\n"
    in a CRLF file). A piece that finds no such newline in MAX_CARRY_PIECES pieces' bytes is cut
    at its last newline, space or character (_forced_cut).

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
                if cut <= 0 and len(data) >= MAX_CARRY_PIECES * TEXT_PIECE_BYTES:
                    cut = _forced_cut(data)
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

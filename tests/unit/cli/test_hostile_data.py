"""Hostile and careless data input: token dirs whose meta.json lies or whose files are not what
it says (a directory, a fifo, a tokenizer the library cannot read), and `data prepare` given
inputs it must not read (a token dir, a link to a file it reads already, `--val` that is also
trained on, a compressed file) or an output it cannot write. The contract and the checks are test_hostile.py's
(tests/unit/cli/hostile.py); the rest of part two is test_hostile_io.py's.
"""

import os
from pathlib import Path

import numpy as np
import pytest

from tests.unit.cli.hostile import (
    Ctx,
    check_row,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    row,
)
from tests.unit.helpers import word_tokenizer


def _train_bin_is_a_dir(c: Ctx) -> str:
    path = Path(c.tokens("tok"))
    (path / "train.bin").unlink()
    (path / "train.bin").mkdir()
    return str(path)


def _val_bin_is_a_fifo(c: Ctx) -> str:
    path = Path(c.tokens("tok"))
    (path / "val.bin").unlink()
    c.fifo("tok/val.bin")
    return str(path)


def _tokens(**kwargs):
    return lambda c: ["launch", "--dry-run", "data=tokens",
                      "data.path=" + c.tokens("tok", **kwargs)]


def _tokenizer_dir(c: Ctx, tokenizer: str, name: str = "tok") -> str:
    """A byte-sized token dir whose meta.json names a tokenizer.json holding `tokenizer`."""
    path = c.tokens(name, meta={"tokenizer": "tokenizer.json"})
    c.file(f"{name}/tokenizer.json", tokenizer)
    return path


def _with_tokenizer(tokenizer: str):
    return lambda c: ["launch", "--dry-run", "data=tokens",
                      "data.path=" + _tokenizer_dir(c, tokenizer)]


ROWS_DATA = [
    row("tokens: data vocab above model.vocab_size",
        _tokens(dtype="uint16", vocab=1000, train=np.arange(600) % 1000),
        "model.vocab_size=256", "1000", "exceeds"),
    row("tokens: ids above meta vocab_size",
        _tokens(dtype="uint16", vocab=256, train=np.arange(600)),
        "data.path=", "token id 599", "vocab_size=256"),
    row("tokens: vocab_size too big for dtype", _tokens(vocab=70000),
        "data.path=", "vocab_size=70000", "dtype=uint8", "does not fit"),
    row("tokens: dtype does not match file size", _tokens(meta={"dtype": "uint16"}),
        "data.path=", "train.bin", "uint16", "1,200 bytes"),
    row("tokens: ids above max_token_id", _tokens(meta={"max_token_id": 100}),
        "data.path=", "max_token_id=100", "token id 199"),
    row("tokens: missing val.bin", _tokens(drop=["val.bin"]), "data.path=", "val.bin", "missing"),
    row("tokens: missing meta.json", _tokens(drop=["meta.json"]), "data.path=", "no meta.json"),
    row("tokens: meta.json nested 100000 deep", _tokens(raw_meta=b"[" * 100000),
        "data.path=", "not valid JSON"),
    row("tokens: other format", _tokens(meta={"format": "other/2"}),
        "data.path=", "'other/2'", "partrain-tokens/1"),
    row("tokens: vocab_size a string", _tokens(meta={"vocab_size": "256"}),
        "data.path=", "vocab_size='256'", "a string"),
    row("tokens: vocab_size NaN", _tokens(raw_meta=b'{"format": "partrain-tokens/1", "tokenizer": '
                                                 b'"bytes", "dtype": "uint8", "vocab_size": NaN, '
                                                 b'"train_tokens": 600, "val_tokens": 300}'),
        "data.path=", "vocab_size=nan", "non-finite"),
    row("tokens: train.bin is a directory", lambda c: ["launch", "--dry-run", "data=tokens",
                                                     "data.path=" + _train_bin_is_a_dir(c)],
        "data.path=", "train.bin", "directory"),
    row("tokens: val.bin is a FIFO", lambda c: ["launch", "--dry-run", "data=tokens",
                                              "data.path=" + _val_bin_is_a_fifo(c)],
        "data.path=", "val.bin", "not a regular file"),
    row("tokens: splits shorter than seq_len", _tokens(train=np.arange(10), val=np.arange(10)),
        "train.seq_len", "10 tokens", "fewer"),
    row("tokens: data.path is a file",
        lambda c: ["launch", "--dry-run", "data=tokens", "data.path=" + c.file("afile")],
        "data.path=", "afile", "not a token dir", "partrain data prepare"),
    row("tokens: no data.path", ["launch", "--dry-run", "data=tokens"],
        "data.source=tokens", "data.path"),
    # A launch trained beside these and copied them into the run dir, which sample and export
    # then refused: a run that could be neither sampled nor exported.
    row("tokens: tokenizer.json is garbage", _with_tokenizer("not a tokenizer\n"),
        "data.path=", "tok/tokenizer.json", "is not a tokenizer.json the tokenizers library reads",
        "put back"),
    row("tokens: tokenizer.json is JSON of another kind", _with_tokenizer('{"model": 3}'),
        "data.path=", "tok/tokenizer.json", "is not a tokenizer.json the tokenizers library reads"),
    row("tokens: tokenizer.json has no end-of-text token",
        _with_tokenizer(word_tokenizer(10, eot=False)),
        "data.path=", "tok/tokenizer.json", "no end-of-text token", "sample"),
    row("tokens: tokenizer.json bigger than vocab_size", _with_tokenizer(word_tokenizer(300)),
        "data.path=", "tok/tokenizer.json", "301 tokens", "vocab_size=256",
        "not the tokenizer these ids were made with"),
    row("tokens: a blend source's tokenizer.json is garbage",
        lambda c: ["launch", "--dry-run",
                   f"data.blend=[{{path: {_tokenizer_dir(c, '{}')}, weight: 1}}]"],
        "data.blend[0]", "tok/tokenizer.json",
        "is not a tokenizer.json the tokenizers library reads"),
    row("data.stdlib_max_bytes=0", ["launch", "--dry-run", "data.stdlib_max_bytes=0"],
        "data.stdlib_max_bytes", "0"),
]


def _prepare(*extra, out="out"):
    return lambda c: ["data", "prepare", c.text(), "--out", c.path(out), *extra]


def _text_beside_a_token_dir(c: Ctx) -> str:
    """data/ of text, and data/tokens that `data prepare data/ --out data/tokens` wrote."""
    from partrain.data.prepare import prepare_token_dir

    c.text("data/a.txt")
    c.text("data/b.txt", 3000)
    prepare_token_dir([c.root / "data"], c.root / "data" / "tokens", workers=1)
    return c.path("data")


def _project_with_a_run(c: Ctx) -> str:
    """A project folder: its text, and runs/r, a run dir a launch left (config, metrics and a
    checkpoint's file)."""
    c.text("proj/notes.txt")
    c.frozen("proj/runs/r/config.yaml")
    c.file("proj/runs/r/metrics.jsonl", '{"step": 1, "loss": 5.0}\n')
    c.file("proj/runs/r/checkpoints/step_00000001/__0_0.distcp", b"\x00\x01" * 64)
    return c.path("proj")


def _linked(c: Ctx) -> str:
    os.symlink("a.txt", c.root / "data" / "link.txt")
    return c.path("data", "link.txt")


def _hard_linked(c: Ctx, name: str = "val.txt") -> str:
    """A second name of in.txt (`ln in.txt val.txt`): its own real path, the same file."""
    os.link(c.root / "in.txt", c.root / name)
    return c.path(name)


def _compressed(c: Ctx, name: str, codec: str) -> str:
    """A file `name` holding JSON Lines compressed with `codec` (zstd: its frame's magic, then
    bytes; the standard library writes no zstd)."""
    import bz2
    import gzip
    import lzma

    lines = b"".join(b'{"text": "document %d"}\n' % i for i in range(200))
    data = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress,
            "zstd": lambda b: b"\x28\xb5\x2f\xfd" + os.urandom(64)}[codec](lines)
    return c.file(name, data)


def _prepare_compressed(name: str, codec: str, under: str | None = None):
    """data prepare of a compressed file, given or in directory `under` beside a text file."""
    def argv(c: Ctx):
        if under is None:
            return ["data", "prepare", c.text(), _compressed(c, name, codec), "--out",
                    c.path("out")]
        c.text(f"{under}/a.txt")
        _compressed(c, f"{under}/{name}", codec)
        return ["data", "prepare", c.path(under), "--out", c.path("out")]
    return argv


def _prepare_with_binary(c: Ctx):
    """A folder of code with a stray compiled file beside its text (a .pyc outside
    __pycache__): 78% of a newcomer's `data prepare $STDLIB/email` was bytecode, exit 0."""
    c.text("code/a.py")
    c.file("code/stray.pyc", b"\x6f\x0d\x0d\x0a\x00\x00\x00\x00" + bytes(range(256)))
    return ["data", "prepare", c.path("code"), "--out", c.path("out")]


ROWS_PREPARE = [
    row("prepare: a binary file under the input directory", _prepare_with_binary,
        "stray.pyc", "under input", "is not text (.pyc)"),
    row("prepare: out under a file",
        lambda c: ["data", "prepare", c.text(), "--out", c.file("afile") + "/out"],
        "--out", "afile/out", "is a file"),
    row("prepare: out is a file", lambda c: ["data", "prepare", c.text(), "--out", c.file("afile")],
        "--out", "afile", "existing file"),
    row("prepare: out not empty",
        lambda c: ["data", "prepare", c.text(), "--out", c.dir("full", a="a")],
        "--out", "full", "not empty"),
    row("prepare: out under /dev/null",
        lambda c: ["data", "prepare", c.text(), "--out", "/dev/null/x"],
        "--out", "/dev/null/x", "is a file"),
    row("prepare: out '.'", lambda c: ["data", "prepare", c.text(), "--out", "."],
        "--out", ".", "new directory"),
    row("prepare: out ''", lambda c: ["data", "prepare", c.text(), "--out", ""],
        "--out is empty", "--out ."),
    row("prepare: out name too long", _prepare(out="a" * 300), "--out", "a" * 300, "too long"),
    row("prepare: --val-fraction nan", _prepare("--val-fraction", "nan"),
        "--val-fraction=nan", "between 0 and 1"),
    row("prepare: --val-fraction inf", _prepare("--val-fraction", "inf"),
        "--val-fraction=inf", "between 0 and 1"),
    row("prepare: --val-fraction 2", _prepare("--val-fraction", "2"), "--val-fraction=2",
        "between 0 and 1"),
    row("prepare: --val-fraction -1", _prepare("--val-fraction", "-1"), "--val-fraction=-1",
        "between 0 and 1"),
    row("prepare: --val-fraction 0", _prepare("--val-fraction", "0"), "--val-fraction=0",
        "between 0 and 1"),
    row("prepare: --val-fraction abc", _prepare("--val-fraction", "abc"), "--val-fraction",
        "abc", "number"),
    row("prepare: input is an empty directory",
        lambda c: ["data", "prepare", c.dir("indir"), "--out", c.path("out")],
        "input directory", "indir", "holds no files"),
    row("prepare: input does not exist",
        lambda c: ["data", "prepare", c.path("missing.txt"), "--out", c.path("out")],
        "input file", "missing.txt", "does not exist"),
    row("prepare: input /dev/null",
        lambda c: ["data", "prepare", c.text(), "/dev/null", "--out", c.path("out")],
        "input file", "/dev/null", "not a regular file"),
    row("prepare: input is a FIFO",
        lambda c: ["data", "prepare", c.fifo("pipe.txt"), "--out", c.path("out")],
        "input file", "pipe.txt", "not a regular file"),
    row("prepare: input too small to split",
        lambda c: ["data", "prepare", c.file("tiny.txt", b"x"), "--out", c.path("out")],
        "hold 1 bytes", "--val-fraction=0.05", "at least 2"),
    row("prepare: no --out", lambda c: ["data", "prepare", c.text()], "--out", "Missing"),
    row("prepare: no inputs", lambda c: ["data", "prepare", "--out", c.path("out")], "INPUTS",
        "Missing"),
    row("data: unknown command", ["data", "bogus"], "bogus", "No such command"),
    # Read as text before: a token dir's meta.json, shards and indexes, exit 0.
    row("prepare: input holds the token dir prepare wrote there",
        lambda c: ["data", "prepare", _text_beside_a_token_dir(c), "--out", c.path("data/tokens2")],
        "input directory", "data holds a partrain token dir", "data/tokens",
        "'partrain-tokens/2'", "move the token dir out of"),
    row("prepare: input is a token dir",
        lambda c: ["data", "prepare", c.tokens("tok"), "--out", c.path("out")],
        "input directory", "tok is a partrain token dir", "'partrain-tokens/1'",
        "give the text files", "data.path="),
    row("prepare: input is a file of a token dir",
        lambda c: ["data", "prepare", c.tokens("tok") + "/train.bin", "--out", c.path("out")],
        "input file", "tok/train.bin", "is a file of the partrain token dir"),
    row("prepare: --val holds a token dir",
        lambda c: ["data", "prepare", c.text(), "--val", _text_beside_a_token_dir(c), "--out",
                   c.path("out")],
        "--val directory", "data holds a partrain token dir", "data/tokens"),
    # Read as text before: the run's checkpoint, its metrics and its config, exit 0.
    row("prepare: input holds a run dir",
        lambda c: ["data", "prepare", _project_with_a_run(c), "--out", c.path("out")],
        "input directory", "proj holds a partrain run dir", "runs/r", "checkpoints",
        "move the run dir out of"),
    row("prepare: input is a run dir",
        lambda c: ["data", "prepare", _project_with_a_run(c) + "/runs/r", "--out", c.path("out")],
        "input directory", "runs/r is a partrain run dir", "give the text files",
        absent=("move the run dir",)),
    row("prepare: input is a file of a run dir",
        lambda c: ["data", "prepare", _project_with_a_run(c) + "/runs/r/metrics.jsonl", "--out",
                   c.path("out")],
        "input file", "metrics.jsonl is a file of the partrain run dir", "runs/r"),
    row("prepare: --val holds a run dir",
        lambda c: ["data", "prepare", c.text(), "--val", _project_with_a_run(c), "--out",
                   c.path("out")],
        "--val directory", "proj holds a partrain run dir"),
    # Read before: the compressed bytes, tokenized as text, exit 0.
    row("prepare: a .jsonl.gz under an input dir", _prepare_compressed("part-000.jsonl.gz", "gzip",
                                                                       under="data"),
        "input file", "data/part-000.jsonl.gz", "under input", "gzip-compressed",
        "its name ends in .gz", "decompress it first", "gunzip"),
    row("prepare: a .zst input", _prepare_compressed("part.jsonl.zst", "zstd"),
        "input file", "part.jsonl.zst", "zstd-compressed", "ends in .zst", "zstd -d"),
    row("prepare: a .bz2 input", _prepare_compressed("part.txt.bz2", "bzip2"),
        "input file", "part.txt.bz2", "bzip2-compressed", "bunzip2"),
    row("prepare: a .xz --val input",
        lambda c: ["data", "prepare", c.text(), "--val", _compressed(c, "val.txt.xz", "xz"),
                   "--out", c.path("out")],
        "--val file", "val.txt.xz", "xz-compressed", "unxz"),
    row("prepare: a .jsonl that is gzip inside", _prepare_compressed("part.jsonl", "gzip"),
        "input file", "part.jsonl", "gzip-compressed", "starts with gzip's magic bytes"),
    row("prepare: a .txt that is zstd inside", _prepare_compressed("part.txt", "zstd", "data"),
        "input file", "data/part.txt", "zstd-compressed", "starts with zstd's magic bytes"),
    row("prepare: a file that is bzip2 inside", _prepare_compressed("part", "bzip2", "data"),
        "input file", "data/part", "bzip2-compressed", "magic bytes"),
    row("prepare: a file that is xz inside", _prepare_compressed("part.ndjson", "xz"),
        "input file", "part.ndjson", "xz-compressed", "magic bytes"),
    row("prepare: input given twice",
        lambda c: ["data", "prepare", c.text(), c.path("in.txt"), "--out", c.path("out")],
        "input", "in.txt is given twice", "read twice"),
    row("prepare: input dir given twice",
        lambda c: ["data", "prepare", c.dir("data", a="abc\n" * 50), c.path("data"), "--out",
                   c.path("out")],
        "input", "data is given twice", "read twice"),
    row("prepare: input file also under an input dir",
        lambda c: ["data", "prepare", c.dir("data", a="abc\n" * 50, b="def\n" * 50),
                   c.path("data", "b"), "--out", c.path("out")],
        "input", "data/b is also read as part of input", "read twice"),
    row("prepare: input and a link to it",
        lambda c: ["data", "prepare", c.text("data/a.txt"), _linked(c), "--out", c.path("out")],
        "input", "link.txt is the same file as input", "a.txt", "read twice"),
    row("prepare: --val is an input",
        lambda c: ["data", "prepare", c.text(), "--val", c.path("in.txt"), "--out", c.path("out")],
        "--val", "in.txt is also read for training", "measures nothing"),
    # Read before: a hard link has a real path of its own, and validation read training text.
    row("prepare: --val is a hard link to an input",
        lambda c: ["data", "prepare", c.text(), "--val", _hard_linked(c), "--out", c.path("out")],
        "--val", "val.txt is also read for training, as input", "in.txt", "measures nothing"),
    row("prepare: input and a hard link to it",
        lambda c: ["data", "prepare", c.text(), _hard_linked(c, "copy.txt"), "--out",
                   c.path("out")],
        "input", "copy.txt is the same file as input", "in.txt", "read twice"),
    row("prepare: --val is a file under an input dir",
        lambda c: ["data", "prepare", c.dir("data", a="abc\n" * 50, b="def\n" * 50), "--val",
                   c.path("data", "b"), "--out", c.path("out")],
        "--val", "data/b is also read for training, as part of input", "move",
        "out of"),
]


TABLE = [*ROWS_DATA, *ROWS_PREPARE]


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


def test_table_is_big_enough():
    assert len(TABLE) >= 35


# ------------------------------------------------------------------------------------------------
# Allowed by design (controls: the table's refusals are not refusals of everything)


def test_a_token_dir_with_a_tokenizer_the_library_reads_launches(run_main, tmp_path):
    # The control of the tokenizer rows: a small tokenizer of its own with an end-of-text token.
    path = _tokenizer_dir(Ctx(tmp_path, None), word_tokenizer(200))
    result = run_main("launch", "--dry-run", "data=tokens", f"data.path={path}")
    assert result.code == 0, result.stderr


def test_prepare_reads_text_that_starts_like_bzip2_as_text(run_main, tmp_path):
    # The control of the compressed rows: "BZh" begins bzip2's magic, and some text.
    (tmp_path / "a.txt").write_text("BZh9 is how a bzip2 file starts.\n" * 20)
    result = run_main("data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"))
    assert result.code == 0, result.stderr


@pytest.mark.parametrize("name, text", [
    # The control of the token-dir rows: a corpus's own meta.json is text like any other file.
    ("meta.json", '{"format": "my-corpus/1", "author": "me"}\n'),
    # The control of the run-dir rows: a config.yaml alone (no checkpoints, metrics or logs
    # beside it) is a user's file like any other.
    ("config.yaml", "train:\n  max_steps: 10\n"),
])
def test_prepare_reads_a_users_file_of_a_partrain_name_as_text(run_main, tmp_path, name, text):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("abc\n" * 200)
    (data / name).write_text(text)
    result = run_main("data", "prepare", str(data), "--out", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    assert '"files": 2' in (tmp_path / "out" / "meta.json").read_text()


def test_prepare_skips_a_folders_pycache(run_main, tmp_path):
    """The control of the binary row: a folder of Python code is its .py files; its
    __pycache__'s compiled files are skipped like hidden names."""
    code = tmp_path / "code"
    (code / "__pycache__").mkdir(parents=True)
    (code / "a.py").write_text("def f():\n    return 1\n" * 40)
    (code / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\x6f\x0d\x0d\x0a" + bytes(64))
    result = run_main("data", "prepare", str(code), "--out", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    assert "from 1 file(s)" in " ".join((result.stdout + result.stderr).split())

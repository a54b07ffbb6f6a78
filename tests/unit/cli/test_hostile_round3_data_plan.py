"""Hostile input, third round: `data prepare` and `plan --search`. Bounds on --workers, JSON Lines
and Parquet whose text is not UTF-8, hardware files whose numbers are not finite or out of range,
models no layout can split, --write-recipe paths that cannot be written, and paths that are a
directory, a symlink loop or a dangling link where a file is expected (said as what they are, not
"does not exist"). The contract and the checks are test_hostile.py's (tests/unit/cli/hostile.py):
exit 2, one `error:` line naming the flag or key, the value and the rule, no traceback, nothing
written or left running.
"""

import json
import multiprocessing
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from partrain.data.prepare import WORKERS_PER_CORE, default_workers
from partrain.plan.search import _divisors
from tests.unit.cli.hostile import (
    Ctx,
    assert_refused,
    assert_untouched,
    check_row,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    row,
    tree,
)
from tests.unit.data.corpus import train_bpe

BOUND = WORKERS_PER_CORE * default_workers()
NO_TEMP = (".partial", ".tmp-")  # a message names the user's path, never a temporary one


def _symlink(c: Ctx, name: str, target: str) -> str:
    path = c.root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    return str(path)


def _tokenizer(c: Ctx) -> str:
    path = c.root / "bpe" / "tokenizer.json"
    path.parent.mkdir()
    train_bpe(path)
    return str(path)


# ------------------------------------------------------------------------------------------------
# Bug 1: --workers had no upper bound (a huge N forked until the system refused, then hung)


def _prepare(*extra: str, tokenizer: bool = False):
    def build(c: Ctx) -> list[str]:
        more = ["--tokenizer", _tokenizer(c)] if tokenizer else []
        return ["data", "prepare", c.text(), "--out", c.path("out"), *more, *extra]
    return build


ROWS_WORKERS = [
    row("--workers 100000 with a tokenizer", _prepare("--workers", "100000", tokenizer=True),
        "--workers=100000", f"at most {BOUND}", "per core"),
    row("--workers one above the bound", _prepare("--workers", str(BOUND + 1)),
        f"--workers={BOUND + 1}", f"at most {BOUND}"),
    row("--workers 2**63", _prepare("--workers", str(2**63)), f"--workers={2**63}", "at most"),
    row("--workers of 5000 digits", _prepare("--workers", "9" * 5000), "--workers", "5,000 digits",
        "too large"),
    row("--workers 0", _prepare("--workers", "0"), "--workers=0", "at least 1"),
    row("--workers -1", _prepare("--workers", "-1"), "--workers=-1", "at least 1"),
    row("--workers 1.5", _prepare("--workers", "1.5"), "--workers", "'1.5'", "whole number"),
    row("--workers nan", _prepare("--workers", "nan"), "--workers", "'nan'", "whole number"),
    row("--workers ''", _prepare("--workers", ""), "--workers", "''", "whole number"),
]


# ------------------------------------------------------------------------------------------------
# Bug 2: JSON Lines (and Parquet) whose text is not UTF-8 gave a traceback


def _jsonl(content: bytes, name: str = "in.jsonl", tokenizer: bool = False):
    def build(c: Ctx) -> list[str]:
        more = ["--tokenizer", _tokenizer(c)] if tokenizer else []
        return ["data", "prepare", c.file(name, content), "--out", c.path("out"), *more]
    return build


GOOD = b'{"text": "fine"}\n'


def _parquet_not_utf8(c: Ctx) -> list[str]:
    # Parquet stores strings as bytes and does not check them: the second row is "b\xff".
    data = pa.py_buffer(b"okb\xff")
    offsets = pa.py_buffer(pa.array([0, 2, 4], type=pa.int32()).buffers()[1])
    column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, data])
    path = c.root / "in.parquet"
    pq.write_table(pa.table({"text": column}), path)
    return ["data", "prepare", str(path), "--out", c.path("out")]


ROWS_NOT_TEXT = [
    row("jsonl: byte 0xff in the text of line 2", _jsonl(GOOD + b'{"text": "a\xff\xfeb"}\n'),
        "in.jsonl", "line 2", "0xff", "not UTF-8"),
    row("jsonl: invalid UTF-8 on line 3, with a tokenizer",
        _jsonl(GOOD * 2 + b'{"text": "caf\xe9"}\n', tokenizer=True),
        "in.jsonl", "line 3", "0xe9", "not UTF-8"),
    row("jsonl: a truncated UTF-8 sequence at the end of a line",
        _jsonl(GOOD + b'{"text": "\xc3"}\n'), "in.jsonl", "line 2", "not UTF-8"),
    row("jsonl: UTF-16", _jsonl('{"text": "a"}\n'.encode("utf-16")),
        "in.jsonl", "line 1", "not UTF-8"),
    row("jsonl: an unpaired surrogate escape", _jsonl(GOOD + b'{"text": "a\\ud800b"}\n'),
        "in.jsonl", "line 2", "unpaired surrogate", "\\ud800"),
    row("jsonl: a number in the field on line 3", _jsonl(GOOD * 2 + b'{"text": 5}\n'),
        "in.jsonl", "line 3", "holds 5", "not a string"),
    row("jsonl: NaN in the field", _jsonl(b'{"text": NaN}\n'),
        "in.jsonl", "line 1", "holds nan", "not a string"),
    row("jsonl: an array line", _jsonl(GOOD + b"[1, 2]\n"), "in.jsonl", "line 2", "an array"),
    row("jsonl: a line cut short", _jsonl(GOOD + b'{"text": "a\n'), "in.jsonl", "line 2",
        "not JSON"),
    row("jsonl: a raw NUL inside a string", _jsonl(b'{"text": "a\x00b"}\n'), "in.jsonl",
        "line 1", "not JSON"),
    row("parquet: a row that is not UTF-8", _parquet_not_utf8, "in.parquet", "row 2",
        "not UTF-8"),
]


# ------------------------------------------------------------------------------------------------
# Bug 3: hardware files: nan/inf printed "nan GiB" at exit 0, inf or nan counts gave tracebacks

HW = {"gpus_per_node": "8", "memory_gib": "80", "peak_tflops": "989", "intra_node_gbps": "450",
      "inter_node_gbps": "50"}


def _hardware(**values: str):
    """plan --search on a hardware file of HW's keys, `values` (raw YAML) replacing them."""
    def build(c: Ctx) -> list[str]:
        text = "".join(f"{k}: {v}\n" for k, v in {**HW, **values}.items())
        return ["plan", "--search", "--gpus", "8", "--hardware", c.file("hw.yaml", text)]
    return build


def _hardware_at(make):
    return lambda c: ["plan", "--search", "--gpus", "8", "--hardware", make(c)]


def _alias_bomb(c: Ctx) -> str:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return c.file("hw.yaml", "\n".join([*lines, *(f"{k}: {v}" for k, v in HW.items())]) + "\n")


ROWS_HARDWARE = [
    row("hardware memory_gib .nan", _hardware(memory_gib=".nan"),
        "--hardware", "hw.yaml", "memory_gib=nan", "finite"),
    row("hardware memory_gib 1e999", _hardware(memory_gib="1e999"),
        "hw.yaml", "memory_gib=1e999", "finite"),
    row("hardware peak_tflops .inf", _hardware(peak_tflops=".inf"),
        "hw.yaml", "peak_tflops=inf", "finite"),
    row("hardware peak_tflops -.inf", _hardware(peak_tflops="-.inf"),
        "hw.yaml", "peak_tflops=-inf", "finite"),
    row("hardware gpus_per_node .inf", _hardware(gpus_per_node=".inf"),
        "hw.yaml", "gpus_per_node=inf", "finite"),
    row("hardware gpus_per_node .nan", _hardware(gpus_per_node=".nan"),
        "hw.yaml", "gpus_per_node=nan", "finite"),
    row("hardware gpus_per_node 1e999", _hardware(gpus_per_node="1e999"),
        "hw.yaml", "gpus_per_node=1e999", "finite"),
    row("hardware gpus_per_node 100000", _hardware(gpus_per_node="100000"),
        "hw.yaml", "gpus_per_node=100000", "at most 1024"),
    row("hardware gpus_per_node 0", _hardware(gpus_per_node="0"),
        "hw.yaml", "gpus_per_node=0", "positive"),
    row("hardware gpus_per_node 7.5", _hardware(gpus_per_node="7.5"),
        "hw.yaml", "gpus_per_node=7.5", "whole number"),
    row("hardware matmul_efficiency .nan", _hardware(matmul_efficiency=".nan"),
        "hw.yaml", "matmul_efficiency=nan", "finite"),
    row("hardware matmul_efficiency 1e-300", _hardware(matmul_efficiency="1e-300"),
        "hw.yaml", "matmul_efficiency=1e-300", "at least 0.001"),
    row("hardware intra_node_gbps 1e308", _hardware(intra_node_gbps="1.0e+308"),
        "hw.yaml", "intra_node_gbps=1e+308", "at most 1e+06"),
    row("hardware inter_node_gbps 'fast'", _hardware(inter_node_gbps="fast"),
        "hw.yaml", "inter_node_gbps=fast", "positive number", "not text"),
    row("hardware inter_node_gbps true", _hardware(inter_node_gbps="true"),
        "hw.yaml", "inter_node_gbps=True", "positive number"),
    row("hardware peak_tflops a list", _hardware(peak_tflops="[989]"),
        "hw.yaml", "peak_tflops=[989]", "positive number"),
    row("hardware name a list", _hardware(name="[a, b]"), "hw.yaml", "name=", "plain name"),
    row("hardware alias bomb", _hardware_at(_alias_bomb), "hw.yaml", "expands to more than"),
    row("--hardware is a directory", _hardware_at(lambda c: c.dir("hwdir")),
        "--hardware", "hwdir", "is a directory"),
    row("--hardware is a symlink loop", _hardware_at(lambda c: _symlink(c, "hw.yaml", "hw.yaml")),
        "--hardware", "hw.yaml", "symlink loop"),
    row("--hardware is a dangling link", _hardware_at(lambda c: _symlink(c, "hw.yaml", "gone")),
        "--hardware", "hw.yaml", "symbolic link to gone", "does not exist"),
    row("--hardware /dev/null", _hardware_at(lambda c: "/dev/null"),
        "--hardware", "/dev/null", "not a regular file"),
    row("--gpus-per-node 100000", ["plan", "--search", "--gpus", "8", "--gpus-per-node", "100000"],
        "--gpus-per-node=100000", "at most 1024"),
    row("--gpus 2**21", ["plan", "--search", "--gpus", str(2**21)], f"--gpus {2**21}",
        "at most 1,048,576"),
    row("--gpus 8e9 for a MoE model (ep's divisors of dp were counted one by one: it hung)",
        ["plan", "--search", "moe-tiny", "--gpus", "8000000000"], "--gpus 8000000000",
        "at most 1,048,576"),
    row("--gpus of 60 digits", ["plan", "--search", "--gpus", "8" * 60], "--gpus", "60 digits",
        "too large"),
]


# ------------------------------------------------------------------------------------------------
# Bug 4: a model no layout can split was "nothing fits" at exit 0, naming no key


def _search(*overrides: str, gpus: str = "8") -> list[str]:
    return ["plan", "--search", *overrides, "--gpus", gpus]


ROWS_NO_LAYOUT = [
    row("search: n_kv_heads does not divide n_heads",
        _search("model.n_heads=6", "model.n_kv_heads=4"),
        "model.n_kv_heads=4", "model.n_heads=6", "divide", absent=("nothing fits",)),
    row("search: n_heads does not divide dim", _search("model.n_heads=5", "model.n_kv_heads=5"),
        "model.n_heads=5", "model.dim=128", "divide"),
    row("search: odd head width", _search("model.dim=12", "model.n_heads=4", "model.n_kv_heads=2"),
        "model.dim / model.n_heads = 3", "even"),
    row("search: nothing divides the batch",
        _search("model.n_layers=1", "model.n_heads=1", "model.n_kv_heads=1", "train.seq_len=100",
                "train.global_batch_size=7"),
        "--gpus 8", "model.n_heads=1", "model.n_kv_heads=1", "model.n_layers=1",
        "train.seq_len=100", "train.global_batch_size=7"),
    row("search: n_kv_heads=0", _search("model.n_kv_heads=0"), "model.n_kv_heads=0", "at least 1"),
    row("search: n_layers=-1", _search("model.n_layers=-1"), "model.n_layers=-1", "at least 1"),
    row("search: moe n_experts=-2", _search("model.moe.n_experts=-2"), "model.moe.n_experts=-2",
        ">= 0"),
    row("search: seq_len above max_seq_len", _search("train.seq_len=4096"),
        "train.seq_len=4096", "model.max_seq_len=512"),
    row("search: norm_eps=nan", _search("model.norm_eps=nan"), "model.norm_eps=nan", "finite"),
    row("search: global_batch_size=0", _search("train.global_batch_size=0"),
        "train.global_batch_size=0", "at least 1"),
]


# ------------------------------------------------------------------------------------------------
# Bug 5: --write-recipe whose write fails named a temporary file (and could leave it)


def _write_to(make):
    return lambda c: [*_search(), "--write-recipe", make(c)]


ROWS_WRITE_RECIPE = [
    row("write-recipe in a missing directory", _write_to(lambda c: c.path("nodir", "best.yaml")),
        "--write-recipe", "nodir/best.yaml", "nodir does not exist", absent=NO_TEMP),
    row("write-recipe is a directory", _write_to(lambda c: c.dir("adir")),
        "--write-recipe", "adir", "is a directory", absent=NO_TEMP),
    row("write-recipe is an existing file", _write_to(lambda c: c.file("best.yaml")),
        "--write-recipe", "best.yaml", "exists", absent=NO_TEMP),
    row("write-recipe is a symlink loop", _write_to(lambda c: _symlink(c, "best.yaml", "best.yaml")),
        "--write-recipe", "best.yaml", "symlink loop", absent=NO_TEMP),
    row("write-recipe is a dangling link", _write_to(lambda c: _symlink(c, "best.yaml", "gone")),
        "--write-recipe", "best.yaml", "symbolic link to gone", absent=NO_TEMP),
    row("write-recipe under a file", _write_to(lambda c: c.file("afile") + "/best.yaml"),
        "--write-recipe", "afile/best.yaml", "afile is a regular file", absent=NO_TEMP),
    row("write-recipe ''", [*_search(), "--write-recipe", ""], "--write-recipe",
        "must name a new file"),
    row("write-recipe /dev/null", [*_search(), "--write-recipe", "/dev/null"],
        "--write-recipe", "/dev/null", "not a regular file"),
    row("write-recipe where the write itself fails (/proc)",
        [*_search(), "--write-recipe", "/proc/best.yaml"],
        "--write-recipe", "/proc/best.yaml", "cannot be written", "nothing was left behind",
        absent=NO_TEMP),
]


# ------------------------------------------------------------------------------------------------
# Bug 6: a directory, a symlink loop or a dangling link was "does not exist"


def _token_dir_with(name: str, target: str):
    """launch --dry-run on a token dir whose `name` is a symbolic link to `target`."""
    def build(c: Ctx) -> list[str]:
        path = Path(c.tokens("tok"))
        (path / name).unlink()
        os.symlink(target, path / name)
        return ["launch", "--dry-run", "data=tokens", f"data.path={path}"]
    return build


def _tokenizer_dir_holding_a_dir(c: Ctx) -> str:
    c.dir("tokdir")
    c.dir("tokdir/tokenizer.json")
    return c.path("tokdir")


ROWS_WHAT_IS_THERE = [
    row("prepare: input is a symlink loop",
        lambda c: ["data", "prepare", _symlink(c, "loop.txt", "loop.txt"), "--out", c.path("out")],
        "input file", "loop.txt", "symlink loop", absent=("does not exist",)),
    row("prepare: input is a dangling link",
        lambda c: ["data", "prepare", _symlink(c, "dangle.txt", "gone.txt"), "--out",
                   c.path("out")],
        "input file", "dangle.txt", "symbolic link to gone.txt"),
    row("prepare: input under a file",
        lambda c: ["data", "prepare", c.file("afile") + "/in.txt", "--out", c.path("out")],
        "input file", "afile/in.txt", "is a file, not a directory"),
    row("prepare: --tokenizer is a symlink loop",
        lambda c: ["data", "prepare", c.text(), "--out", c.path("out"), "--tokenizer",
                   _symlink(c, "tok.json", "tok.json")],
        "--tokenizer", "tok.json", "symlink loop", absent=("does not exist",)),
    row("prepare: --tokenizer dir whose tokenizer.json is a directory",
        lambda c: ["data", "prepare", c.text(), "--out", c.path("out"), "--tokenizer",
                   _tokenizer_dir_holding_a_dir(c)],
        "--tokenizer", "tokdir", "tokenizer.json is a directory"),
    row("prepare: --tokenizer dir whose tokenizer.json is a loop",
        lambda c: ["data", "prepare", c.text(), "--out", c.path("out"), "--tokenizer",
                   str(Path(_symlink(c, "tokdir/tokenizer.json", "tokenizer.json")).parent)],
        "--tokenizer", "tokdir", "tokenizer.json is a symlink loop"),
    row("tokens: data.path is a symlink loop",
        lambda c: ["launch", "--dry-run", "data=tokens", "data.path=" + _symlink(c, "tl", "tl")],
        "data.path=", "tl", "not a directory", "symlink loop"),
    row("tokens: data.path is a regular file",
        lambda c: ["launch", "--dry-run", "data=tokens", "data.path=" + c.file("afile")],
        "data.path=", "afile", "is a file, not a token dir", "partrain data prepare"),
    row("tokens: meta.json is a symlink loop", _token_dir_with("meta.json", "meta.json"),
        "data.path=", "meta.json", "symlink loop", absent=("no meta.json",)),
    row("tokens: val.bin is a dangling link", _token_dir_with("val.bin", "gone.bin"),
        "data.path=", "val.bin", "symbolic link to gone.bin"),
    row("tokens: train.bin is a symlink loop", _token_dir_with("train.bin", "train.bin"),
        "data.path=", "train.bin", "symlink loop"),
]

TABLE = [*ROWS_WORKERS, *ROWS_NOT_TEXT, *ROWS_HARDWARE, *ROWS_NO_LAYOUT, *ROWS_WRITE_RECIPE,
         *ROWS_WHAT_IS_THERE]


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------------
# Beyond the table: failures that need a disk or a system that refuses, and controls


def test_workers_the_system_refuses_stop_cleanly(run_main, tmp_path, monkeypatch):
    """fork fails after the first worker (EAGAIN, as when the process limit is reached): one
    message naming --workers, no worker left waiting, nothing written. Before, the message blamed
    --out and the exit hung on the started workers."""
    c = Ctx(tmp_path, monkeypatch)
    args = ["data", "prepare", c.text(), "--out", c.path("out"), "--tokenizer", _tokenizer(c),
            "--workers", "2"]
    real_fork, forks = os.fork, []

    def fork():
        forks.append(1)
        if len(forks) > 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_fork()

    before = tree(tmp_path)
    monkeypatch.setattr(os, "fork", fork)
    result = run_main(*args)
    monkeypatch.setattr(os, "fork", real_fork)
    assert_refused(result, ["--workers=2", "Resource temporarily unavailable", "fewer"],
                   absent=["--out"])
    assert not multiprocessing.active_children()
    assert_untouched(tmp_path, before)


def test_workers_at_the_bound_run(run_main, tmp_path, monkeypatch):
    c = Ctx(tmp_path, monkeypatch)
    result = run_main("data", "prepare", c.text(), "--out", c.path("out"), "--tokenizer",
                      _tokenizer(c), "--workers", str(BOUND))
    assert result.code == 0, result.stderr
    assert f"{BOUND} worker process(es)" in result.stdout
    assert not multiprocessing.active_children()


def test_a_jsonl_line_longer_than_a_block(run_main, tmp_path, monkeypatch):
    """A record longer than pyarrow's block is named by its line (the block made small here)."""
    monkeypatch.setattr("partrain.data.inputs.JSONL_BLOCK_BYTES", 1024)
    c = Ctx(tmp_path, monkeypatch)
    path = c.file("long.jsonl", GOOD + json.dumps({"text": "x" * 5000}).encode() + b"\n")
    before = tree(tmp_path)
    assert_refused(run_main("data", "prepare", path, "--out", c.path("out")),
                   ["long.jsonl", "line 2", "longer than 1,024 bytes"])
    assert_untouched(tmp_path, before)


def test_a_20_mb_jsonl_document_is_read(run_main, tmp_path, monkeypatch):
    """pyarrow's own 1 MiB block refused a document of some MiB as a "straddling object"."""
    c = Ctx(tmp_path, monkeypatch)
    path = c.file("book.jsonl", GOOD + json.dumps({"text": "y" * (20 << 20)}).encode() + b"\n")
    result = run_main("data", "prepare", path, "--out", c.path("out"))
    assert result.code == 0, result.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == len("fine") + 1 + (20 << 20)


def test_write_recipe_on_a_readonly_fs(readonly_fs, run_main, tmp_path):
    path = readonly_fs / "best.yaml"
    before = tree(tmp_path)
    assert_refused(run_main(*_search(), "--write-recipe", str(path)),
                   ["--write-recipe", str(path), "not writable", "read-only"], absent=NO_TEMP)
    assert_untouched(tmp_path, before)


def test_write_recipe_on_a_full_fs(full_fs, run_main, tmp_path):
    """The check before the search passes (the directory is writable); the write fails for want
    of room: PATH is named, and its temporary file is gone."""
    path = full_fs / "best.yaml"
    result = run_main(*_search(), "--write-recipe", str(path))
    assert_refused(result, ["--write-recipe", str(path), "No space left on device",
                            "nothing was left behind"], absent=NO_TEMP)
    assert list(full_fs.iterdir()) == []


def test_hardware_file_numbers_as_yaml_writes_them(run_main, tmp_path):
    """1e3 (no dot, a string to YAML 1.1) and 4.5e2 are numbers; the search runs."""
    path = tmp_path / "lab.yaml"
    path.write_text("gpus_per_node: 8\nmemory_gib: 8e1\npeak_tflops: 1e3\nintra_node_gbps: 4.5e2\n"
                    "inter_node_gbps: 50\nmatmul_efficiency: 0.5\n")
    result = run_main("plan", "--search", "--gpus", "8", "--hardware", str(path), "--json")
    assert result.code == 0, result.stderr
    hw = json.loads(result.stdout)["hardware"]
    assert (hw["memory_gib"], hw["peak_tflops"], hw["intra_node_gbps"]) == (80, 1000, 450)


def test_divisors_cost_the_same_for_any_size():
    assert _divisors(12, 100) == [1, 2, 3, 4, 6, 12]
    assert _divisors(12, 5) == [1, 2, 3, 4]
    assert _divisors(10**12, 8) == [1, 2, 4, 5, 8]  # sqrt(10**12) steps at most, not 10**12
    assert _divisors(1, 1) == [1]


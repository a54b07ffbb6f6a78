"""Hostile and careless input: a table that proves the exit-2 contract edge by edge.

Every row is an input a user can type by mistake or a file they can hand partrain: non-finite or
out-of-range numbers, unknown keys and group options, config files partrain cannot read, run dirs
it must not use, token dirs whose meta.json lies, bad flags and network settings, absurd sizes,
rich markup in user text, values of the wrong type. For each one the CLI must (DESIGN.md, exit
code 2):

- exit with code 2, with exactly one `error: ...` message on stderr and nothing on stdout;
- name the key or flag, the value as given and the rule: each row lists fragments that must
  appear (a tuple inside the list means any one of them); whitespace is collapsed, as rich wraps;
- show no traceback and no library internals (OmegaConf's `full_key:` / `object_type=` lines, the
  private copy a user's recipe is composed from);
- start nothing and write nothing: the test's directory is the same afterwards, entry by entry
  (it is the cwd, so a default `runs/...` would land in it, and it holds the system temp dir, so a
  temporary dir left behind shows too), and no process mentions it.

Rows run in-process through `run_main`; a few run as real `python -m partrain` subprocesses, all
started at once to keep the file fast. Rows marked xfail(strict=True) are inputs that still break
the contract; the reason says how.
"""

import dataclasses
import functools
import json
import os
import stat
import tempfile
import threading
import typing
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from partrain.config.schema import Config
from tests.integration.conftest import processes_mentioning
from tests.unit.helpers import finish, one_line, resolved, start_cli

# What a message for people must not show (see the module docstring).
INTERNALS = ("Traceback", "full_key:", "reference_type=", "object_type=", "partrain-recipe-")
RECIPE_HEAD = "defaults:\n  - config\n  - _self_\n"
MULTI_NODE = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29999", "parallel.dp=4"]
UNRESOLVABLE = "partrain-hostile.invalid"  # .invalid never resolves (RFC 2606)
ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_")  # a test run inside a job must not see its job


# ------------------------------------------------------------------------------------------------
# Inputs: files and directories that rows build in their test's directory


@functools.lru_cache(maxsize=None)
def frozen_text() -> str:
    """A run dir's config.yaml for the quickstart recipe: what `partrain show` prints."""
    cfg, _, _ = resolved()
    return OmegaConf.to_yaml(cfg)


def write_tokens(d: Path, *, dtype="uint8", vocab=256, train=None, val=None, meta=None,
                 drop=(), raw_meta: bytes | None = None) -> Path:
    """A token dir as `partrain data prepare` writes one, or lying in the ways asked for."""
    d.mkdir(parents=True)
    train = np.arange(600) % 200 if train is None else np.asarray(train)
    val = np.arange(300) % 200 if val is None else np.asarray(val)
    (d / "train.bin").write_bytes(train.astype(dtype).tobytes())
    (d / "val.bin").write_bytes(val.astype(dtype).tobytes())
    fields = {"format": "partrain-tokens/1", "tokenizer": "bytes", "dtype": dtype,
              "vocab_size": vocab, "train_tokens": len(train), "val_tokens": len(val),
              **(meta or {})}
    (d / "meta.json").write_bytes(raw_meta if raw_meta is not None else json.dumps(fields).encode())
    for name in drop:
        (d / name).unlink()
    return d


class Ctx:
    """What a row's argv builder gets: its test's directory and ways to fill it."""

    def __init__(self, root: Path, monkeypatch):
        self.root, self._monkeypatch = root, monkeypatch

    def path(self, *parts: str) -> str:
        return str(self.root.joinpath(*parts))

    def file(self, name: str, content: bytes | str = b"x\n") -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def dir(self, name: str, **files: str) -> str:
        path = self.root / name
        path.mkdir(parents=True)
        for file, text in files.items():
            (path / file).write_text(text)
        return str(path)

    def fifo(self, name: str) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return str(path)

    def recipe(self, name: str, body: str) -> str:
        return self.file(name, RECIPE_HEAD + body)

    def frozen(self, name: str, edit=None) -> str:
        text = frozen_text() if edit is None else edit(frozen_text())
        assert edit is None or text != frozen_text(), "the edit of the frozen config missed"
        return self.file(name, text)

    def tokens(self, name: str, **kwargs) -> str:
        return str(write_tokens(self.root / name, **kwargs))

    def text(self, name: str = "in.txt", size: int = 4000) -> str:
        return self.file(name, (b"def f(x):\n    return x + 1\n" * size)[:size])

    def setenv(self, **env: str) -> None:
        for name, value in env.items():
            self._monkeypatch.setenv(name, value)


def row(id: str, argv, *fragments, absent=(), xfail: str | None = None):
    """argv: a list, or a function of a Ctx that builds the inputs and returns the list."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(argv, fragments, absent, id=id, marks=marks)


def _schema_keys(kind) -> list[str]:
    """Keys of the schema whose declared type is `kind` or Optional[kind], found here (not with
    partrain's own helper, so that a key it misses is still covered)."""
    keys = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            declared = hints[f.name]
            if dataclasses.is_dataclass(declared):
                walk(declared, f"{prefix}{f.name}.")
            elif declared is kind or kind in typing.get_args(declared):
                keys.append(f"{prefix}{f.name}")

    walk(Config, "")
    return keys


FLOAT_KEYS = _schema_keys(float)


# ------------------------------------------------------------------------------------------------
# The table. Fragments: the key or flag, the value as the user gave it, a word of the rule.

def _rows_non_finite():
    """Family 1: every float key of the schema with nan, inf and -inf (Hydra parses them as
    floats; `show` validates)."""
    assert len(FLOAT_KEYS) >= 10, FLOAT_KEYS
    return [row(f"float-{key}={value}", ["show", f"{key}={value}"], f"{key}={value}", "finite")
            for key in FLOAT_KEYS for value in ("nan", "inf", "-inf")]


ROWS_FLOAT_RANGE = [
    row("optim.lr=0", ["show", "optim.lr=0"], "optim.lr=0", "positive"),
    row("optim.lr=1e-400 (underflows to 0)", ["show", "optim.lr=1e-400"], "optim.lr=", "positive"),
    row("optim.grad_clip=-1", ["show", "optim.grad_clip=-1"], "optim.grad_clip=-1", ">= 0"),
    row("optim.weight_decay=-0.1", ["show", "optim.weight_decay=-0.1"],
        "optim.weight_decay=-0.1", ">= 0"),
    row("optim.beta1=1", ["show", "optim.beta1=1"], "optim.beta1=1", "[0, 1)"),
    row("optim.eps=0", ["show", "optim.eps=0"], "optim.eps=0", "positive"),
    row("optim.min_lr_ratio=2", ["show", "optim.min_lr_ratio=2"], "optim.min_lr_ratio=2", "[0, 1]"),
    row("model.rope_theta=-1", ["show", "model.rope_theta=-1"], "model.rope_theta=-1", "positive"),
    row("data.val_fraction=0", ["show", "data.val_fraction=0"], "data.val_fraction=0", "between"),
]

ROWS_UNKNOWN_KEYS = [
    row("+train.max_step", ["show", "+train.max_step=50"], "train.max_step", "+train.max_step=50",
        "did you mean train.max_steps?"),
    row("train.max_step", ["show", "train.max_step=50"], "train.max_step=50",
        "did you mean train.max_steps?"),
    row("max_steps without section", ["show", "max_steps=3"], "max_steps=3",
        "did you mean train.max_steps?"),
    row("trian.seed", ["show", "trian.seed=1"], "trian.seed=1", "did you mean train.seed?"),
    row("+foo", ["show", "+foo=1"], "+foo=1", "unknown config key"),
    row("++foo", ["show", "++foo=1"], "++foo=1", "unknown config key"),
    row("+model.bar", ["show", "+model.bar=2"], "model.bar", "+model.bar=2", "unknown config key"),
    row("+train.seed (exists)", ["show", "+train.seed=3"], "train.seed", "train.seed=3", "already"),
    row("model=tinyy", ["show", "model=tinyy"], "model=tinyy", "not an option",
        "did you mean tiny?"),
    row("parallel=nosuch", ["show", "parallel=nosuch"], "parallel=nosuch", "not an option"),
    row("model= (empty)", ["show", "model="], "model=", "not an option"),
    row("model=null", ["show", "model=null"], ("model=null", "model=None"), "not an option"),
    row("model={a:1}", ["show", "model={a:1}"], "model=", "not an option"),
    row("hydra.run.dir", ["show", "hydra.run.dir=x"], "hydra.run.dir", "unknown config key"),
    row("sweep model=tiny,llama-1b", ["show", "model=tiny,llama-1b"], "model=tiny,llama-1b",
        "sweep"),
    row("grammar data.path=/x/[run1]", ["show", "data.path=/x/[run1]"], "data.path=/x/[run1]",
        "not understood"),
    row("grammar +=", ["show", "train.max_steps+=1"], "train.max_steps+=1", "not understood"),
    row("empty key =5", ["show", "=5"], "=5", "names no key"),
    row("delete ~train.seed", ["show", "~train.seed"], "~train.seed", "cannot be removed"),
    row("delete a group ~model", ["show", "~model"], "~model", "cannot be removed"),
    row("deepspeed keys with zero_stage=0", ["show", "+parallel.deepspeed.X=1"],
        "parallel.deepspeed", "parallel.zero_stage=0", "DeepSpeed"),
    row("deepspeed key contradicts zero_stage",
        ["show", "+parallel.deepspeed.zero_optimization.stage=2", "parallel.zero_stage=1"],
        "parallel.deepspeed.zero_optimization.stage=2", "contradicts"),
]


def _big_yaml(c: Ctx) -> str:
    return c.file("big.yaml", RECIPE_HEAD + ("# " + "x" * 100 + "\n") * 11000)


def _deep_yaml(c: Ctx) -> str:
    return c.file("deep.yaml", RECIPE_HEAD + "name: " + "[" * 50000 + "]" * 50000 + "\n")


def _frozen_with_bad_key(c: Ctx) -> str:
    return c.frozen("old-run/config.yaml",
                    lambda t: t.replace("\ntrain:\n", "\ntrain:\n  bogus_key: 1\n", 1))


ROWS_CONFIG_FILES = [
    row("yaml duplicate key",
        lambda c: ["show", c.recipe("dup.yaml", "train:\n  seed: 1\n  seed: 2\n")],
        "dup.yaml", "duplicate key 'seed'", "line 6"),
    row("yaml not UTF-8 (Latin-1)",
        lambda c: ["show", c.file("latin1.yaml", RECIPE_HEAD.encode() + b"name: caf\xe9\n")],
        "latin1.yaml", "not UTF-8", "0xe9"),
    row("yaml binary garbage",
        lambda c: ["show", c.file("garbage.yaml", bytes(range(256)) * 8)],
        "garbage.yaml", ("not UTF-8", "not valid YAML")),
    row("config is a directory (tmp_path)", lambda c: ["show", c.path()], "config file",
        "is a directory"),
    row("config is a directory named x.yaml", lambda c: ["show", c.dir("x.yaml")],
        "x.yaml", "is a directory"),
    row("yaml empty file", lambda c: ["show", c.file("empty.yaml", b"")],
        "empty.yaml", "defaults"),
    row("yaml list, not a mapping", lambda c: ["show", c.file("list.yaml", "- a\n- b\n")],
        "list.yaml", ("defaults", "mapping")),
    row("yaml without defaults",
        lambda c: ["show", c.file("nodefaults.yaml", "train:\n  seed: 1\n")],
        "nodefaults.yaml", "no defaults list"),
    row("yaml defaults: 5", lambda c: ["show", c.file("defs5.yaml", "defaults: 5\n")],
        "defs5.yaml", "defaults", "list"),
    row("yaml unknown key in a section",
        lambda c: ["show", c.recipe("unknown.yaml", "train:\n  max_step: 3\n")],
        "unknown.yaml", "train.max_step", "did you mean train.max_steps?"),
    row("yaml unknown top-level int key", lambda c: ["show", c.recipe("intkey.yaml", "1: x\n")],
        "intkey.yaml", "unknown config key 1"),
    row("yaml wrong type train: {seed: abc}",
        lambda c: ["show", c.recipe("wrongtype.yaml", "train: {seed: abc}\n")],
        "wrongtype.yaml", "train.seed", "'abc'", "Integer"),
    row("yaml section is a number (train: 5)",
        lambda c: ["show", c.recipe("trainint.yaml", "train: 5\n")],
        "trainint.yaml", "train", ("mapping", "section"), absent=("did you mean train?",)),
    row("yaml section is null (train: null)",
        lambda c: ["show", c.recipe("trainnull.yaml", "train: null\n")],
        "trainnull.yaml", "train", ("mapping", "section"), absent=("did you mean train?",)),
    row("yaml override model: tinyy",
        lambda c: ["show", c.file("override.yaml", "defaults:\n  - config\n  - override model: "
                                                   "tinyy\n  - _self_\n")],
        "override.yaml", "override model: tinyy", "did you mean tiny?"),
    row("yaml defaults model: tinyy (no override)",
        lambda c: ["show", c.file("defnoover.yaml", "defaults:\n  - config\n  - model: tinyy\n"
                                                    "  - _self_\n")],
        "defnoover.yaml", "tinyy", "not an option"),
    row("yaml defaults with an unknown group",
        lambda c: ["show", c.file("defgroup.yaml", "defaults:\n  - config\n  - nosuchgroup: x\n"
                                                   "  - _self_\n")],
        "defgroup.yaml", "nosuchgroup"),
    row("yaml tab indentation", lambda c: ["show", c.recipe("tab.yaml", "\tname: x\n")],
        "tab.yaml", "not valid YAML", "line 4"),
    row("yaml python tag",
        lambda c: ["show", c.recipe("tag.yaml", "x: !!python/object:os.system {}\n")],
        "tag.yaml", "not valid YAML", "python/object"),
    row("yaml list as a key", lambda c: ["show", c.recipe("listkey.yaml", "? [a, b]\n: x\n")],
        "listkey.yaml", "not valid YAML", "list or mapping"),
    row("yaml interpolation of a missing env variable",
        lambda c: ["show", c.recipe("interp.yaml", "name: ${oc.env:PARTRAIN_HOSTILE_NOPE}\n")],
        "interp.yaml", "name", "PARTRAIN_HOSTILE_NOPE", "not found"),
    row("yaml nested 50000 deep", lambda c: ["show", _deep_yaml(c)], "deep.yaml"),
    row("yaml over 1 MiB", lambda c: ["show", _big_yaml(c)], "big.yaml", "bytes", "at most"),
    row("config /dev/null", ["show", "/dev/null"], "/dev/null", "not a regular file"),
    row("config .yaml that does not exist", lambda c: ["show", c.path("nosuch.yaml")],
        "nosuch.yaml", "does not exist"),
    row("config .yml that does not exist", lambda c: ["show", c.path("nosuch.yml")],
        "nosuch.yml", "does not exist"),
    row("unknown recipe name", ["show", "quickstrat"], "quickstrat", "unknown recipe"),
    row("empty CONFIG argument", ["launch", "--dry-run", ""], "CONFIG", "empty"),
    row("frozen config with an unknown key", lambda c: ["show", _frozen_with_bad_key(c)],
        "old-run/config.yaml", "train.bogus_key", "unknown config key"),
    row("frozen config with overrides",
        lambda c: ["show", c.frozen("run/config.yaml"), "train.seed=3"],
        "run/config.yaml", "train.seed=3", "no overrides"),
    row("frozen config with a wrong type",
        lambda c: ["show", c.frozen("run/config.yaml",
                                    lambda t: t.replace("\n  seed: 0\n", "\n  seed: abc\n"))],
        "run/config.yaml", "train.seed", "'abc'", "Integer"),
    row("frozen config with a section that is a number",
        lambda c: ["show", c.frozen("run/config.yaml",
                                    lambda t: t.replace("\noptim:\n", "\noptim: 5\nxoptim:\n"))],
        "run/config.yaml", "optim", absent=("did you mean optim?",)),
    row("frozen config with nan", lambda c: ["show", c.frozen(
        "run/config.yaml", lambda t: t.replace("\n  lr: 0.003\n", "\n  lr: .nan\n"))],
        "optim.lr=nan", "finite"),
    row("token dir meta.json in Latin-1",
        lambda c: ["launch", "--dry-run", "data=tokens", "data.path=" + c.tokens(
            "tok", raw_meta='{"format": "partrain-tokens/1", "tokenizer": "bytés"}'.encode(
                "latin-1"))],
        "data.path=", "meta.json", "not UTF-8", "0xe9"),
]


def _run_dir_with_other_config(c: Ctx) -> str:
    c.frozen("other/config.yaml", lambda t: t.replace("\n  seed: 0\n", "\n  seed: 5\n"))
    return c.path("other")


def _run_dir_rows(command: list[str], name: str) -> list:
    return [
        row(f"{name} run dir under a file",
            lambda c: [*command, "--run-dir", c.file("afile") + "/run"],
            "--run-dir", "afile/run", "is a file"),
        row(f"{name} run dir is a file", lambda c: [*command, "--run-dir", c.file("afile")],
            "--run-dir", "afile", "existing file"),
        row(f"{name} run dir holds notes.txt",
            lambda c: [*command, "--run-dir", c.dir("notes", **{"notes.txt": "mine"})],
            "--run-dir", "notes", "not empty"),
        row(f"{name} run dir holds another config.yaml",
            lambda c: [*command, "--run-dir", _run_dir_with_other_config(c)],
            "--run-dir", "other", "not empty"),
        row(f"{name} run dir under /dev/null", [*command, "--run-dir", "/dev/null/run"],
            "--run-dir", "/dev/null/run", "is a file"),
        row(f"{name} run dir name too long",
            lambda c: [*command, "--run-dir", c.path("a" * 300, "run")],
            "--run-dir", "a" * 300, "too long"),
    ]


ROWS_RUN_DIRS = [
    *_run_dir_rows(["launch", "--dry-run"], "launch"),
    *_run_dir_rows(["slurm", "--nodes", "1", "--dry-run"], "slurm")[:4],
    row("launch run dir '' (the cwd, not empty)", ["launch", "--dry-run", "--run-dir", ""],
        "--run-dir", "not empty"),
    row("slurm bad value and a run dir",
        lambda c: ["slurm", "--nodes", "1", "--dry-run", "optim.lr=nan", "--run-dir",
                   c.path("run")],
        "optim.lr=nan", "finite"),
]


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
        "data.path=", "afile", "not a directory"),
    row("tokens: no data.path", ["launch", "--dry-run", "data=tokens"],
        "data.source=tokens", "data.path"),
    row("data.stdlib_max_bytes=0", ["launch", "--dry-run", "data.stdlib_max_bytes=0"],
        "data.stdlib_max_bytes", "0"),
]


def _prepare(*extra, out="out"):
    return lambda c: ["data", "prepare", c.text(), "--out", c.path(out), *extra]


ROWS_PREPARE = [
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
        "--out", "new directory"),
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
    row("prepare: input is a directory",
        lambda c: ["data", "prepare", c.dir("indir"), "--out", c.path("out")],
        "input file", "indir", "is a directory"),
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
    row("prepare: no files", lambda c: ["data", "prepare", "--out", c.path("out")], "files",
        "Missing"),
    row("data: unknown command", ["data", "bogus"], "bogus", "No such command"),
]

ROWS_NETWORK = [
    row("--local-addr not-an-ip",
        ["launch", "--dry-run", "--local-addr", "not-an-ip", *MULTI_NODE],
        "--local-addr", "not-an-ip", "not an IP address"),
    row("--rdzv-endpoint without port", ["launch", "--dry-run", *MULTI_NODE[:2],
                                         "--rdzv-endpoint", "127.0.0.1", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1", "HOST:PORT"),
    row("--rdzv-endpoint port 0", ["launch", "--dry-run", *MULTI_NODE[:2],
                                   "--rdzv-endpoint", "127.0.0.1:0", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:0", "1..65535"),
    row("--rdzv-endpoint port 70000", ["launch", "--dry-run", *MULTI_NODE[:2],
                                       "--rdzv-endpoint", "127.0.0.1:70000", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:70000", "1..65535"),
    row("--rdzv-endpoint without port, one node",
        ["launch", "--dry-run", "--rdzv-endpoint", "127.0.0.1"],
        "--rdzv-endpoint", "127.0.0.1", "HOST:PORT"),
    row("--rdzv-endpoint host does not resolve",
        ["launch", "--dry-run", *MULTI_NODE[:2], "--rdzv-endpoint", f"{UNRESOLVABLE}:29999",
         "parallel.dp=4"],
        "--rdzv-endpoint", UNRESOLVABLE, "does not resolve"),
    row("--ifname nosuchif0", ["launch", "--dry-run", "--ifname", "nosuchif0", *MULTI_NODE],
        "--ifname", "nosuchif0", "no such interface"),
    row("--nnodes 2 without --rdzv-endpoint", ["launch", "--dry-run", "--nnodes", "2",
                                               "parallel.dp=4"],
        "--nnodes=2", "--rdzv-endpoint"),
    row("--rdzv-endpoint without port, with --local-addr",
        ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1", "--local-addr",
         "127.0.0.1", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1", "HOST:PORT"),
    row("--rdzv-endpoint port 70000, with --ifname",
        ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:70000", "--ifname",
         "lo", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:70000", "1..65535"),
    row("--rdzv-endpoint port 0, with --local-addr and --ifname",
        ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr",
         "127.0.0.1", "--ifname", "lo", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:0", "1..65535"),
]

ROWS_MARKUP = [
    row("markup: data.path='/x/[run1]'", ["launch", "--dry-run", "data=tokens",
                                          "data.path='/x/[run1]'"],
        "data.path=/x/[run1]", "not a directory"),
    row("markup: run dir with [/x] under a file",
        lambda c: ["launch", "--dry-run", "--run-dir", c.file("afile") + "/[/x]"],
        "--run-dir", "afile/[/x]", "is a file"),
    row("markup: name='[bold]x'", ["show", "name='[bold]x'"], "name='[bold]x'", "plain name"),
    row("markup: --ifname [bold]x", ["launch", "--dry-run", "--ifname", "[bold]x", *MULTI_NODE],
        "--ifname [bold]x", "no such interface"),
]

ROWS_ABSURD = [
    row("show parallel.dp=1000000000", ["show", "parallel.dp=1000000000"],
        "parallel.dp=1000000000", "exceeds"),
    row("plan --world-size 1000000000", ["plan", "--world-size", "1000000000"],
        "--world-size", "1,000,000,000", "exceeds"),
    row("launch dp=2000 past the per-node cap",
        ["launch", "--dry-run", "parallel.dp=2000", "train.global_batch_size=null",
         "train.micro_batches=1"],
        ("parallel.dp=2000", "dp(2000)"), "1024"),
    row("show model.n_heads=1000000007", ["show", "model.n_heads=1000000007"],
        "model.n_heads=1000000007", "divide"),
    row("show train.seed=10**20", ["show", "train.seed=99999999999999999999"],
        "train.seed=99999999999999999999", "at most"),
    row("show collective_timeout_s=10**8", ["show", "launcher.collective_timeout_s=100000000"],
        "launcher.collective_timeout_s=100000000", "at most"),
    row("show pp_virtual_stages=10**9",
        ["show", "parallel.pp_virtual_stages=1000000000", "parallel.pp_schedule=interleaved_1f1b",
         "parallel.pp=2", "parallel.dp=1"],
        "pp_virtual_stages(1000000000)", "exceeds"),
    row("show model.dim=10**20 (beyond int64)",
        ["show", "model.dim=100000000000000000000", "model.n_heads=1", "model.n_kv_heads=1"],
        "model.dim=100000000000000000000"),
]

ROWS_BLAME = [
    row("blame parallel.dp=0", ["launch", "--dry-run", "parallel.dp=0"], "parallel.dp=0",
        "at least 1", absent=("--nproc-per-node",)),
    row("blame parallel.tp=0", ["launch", "--dry-run", "parallel.tp=0"], "parallel.tp=0",
        "at least 1", absent=("--nproc-per-node",)),
    row("blame parallel.dp=1.5", ["launch", "--dry-run", "parallel.dp=1.5"], "parallel.dp=1.5",
        "positive integer", absent=("--nproc-per-node",)),
    row("blame parallel.dp=abc", ["launch", "--dry-run", "parallel.dp=abc"], "parallel.dp=abc",
        "positive integer", absent=("--nproc-per-node",)),
    row("blame launcher.nproc_per_node=0", ["launch", "--dry-run", "launcher.nproc_per_node=0"],
        "launcher.nproc_per_node=0", "at least 1", absent=("--nproc-per-node",)),
    row("blame launcher.nnodes=0", ["launch", "--dry-run", "launcher.nnodes=0"],
        "launcher.nnodes=0", "at least 1", absent=("--nnodes",)),
    row("blame parallel.dp=auto without a world size", ["launch", "--dry-run", "parallel.dp=auto"],
        "parallel.dp=auto", "world size"),
    row("blame --nproc-per-node 3 against dp=2", ["launch", "--dry-run", "--nproc-per-node", "3"],
        "dp(2)", "world size 3", "--nproc-per-node"),
    row("blame --nnodes 3 against 2 ranks",
        ["launch", "--dry-run", "--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:29999"],
        "--nnodes=3", "spread evenly"),
]


def _slurm_env(c: Ctx, **override: str) -> None:
    c.setenv(**{"SLURM_JOB_ID": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
                "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_NTASKS_PER_NODE": "1", **override})


def _in_slurm(argv: list[str], **env: str):
    def build(c: Ctx) -> list[str]:
        _slurm_env(c, **env)
        return argv
    return build


ROWS_FLAGS = [
    row("--nproc-per-node abc", ["launch", "--dry-run", "--nproc-per-node", "abc"],
        "--nproc-per-node", "'abc'", "whole number"),
    row("--nproc-per-node 0", ["launch", "--dry-run", "--nproc-per-node", "0"],
        "--nproc-per-node=0", "at least 1"),
    row("--nproc-per-node -3", ["launch", "--dry-run", "--nproc-per-node", "-3"],
        "--nproc-per-node=-3", "at least 1"),
    row("--nproc-per-node 1.5", ["launch", "--dry-run", "--nproc-per-node", "1.5"],
        "--nproc-per-node", "'1.5'", "whole number"),
    row("--nproc-per-node ''", ["launch", "--dry-run", "--nproc-per-node", ""],
        "--nproc-per-node", "''", "whole number"),
    row("--nnodes -1", ["launch", "--dry-run", "--nnodes", "-1"], "--nnodes=-1", "at least 1"),
    row("--nnodes abc", ["launch", "--dry-run", "--nnodes", "abc"], "--nnodes", "'abc'",
        "whole number"),
    row("--node-rank 5 of 2 nodes", ["launch", "--dry-run", "--node-rank", "5", *MULTI_NODE],
        "--node-rank=5", "0..1"),
    row("--node-rank -1", ["launch", "--dry-run", "--node-rank", "-1"], "--node-rank=-1",
        "at least 0"),
    row("--node-rank 1 of 1 node", ["launch", "--dry-run", "--node-rank", "1"], "--node-rank=1",
        "0..0"),
    row("plan --world-size 0", ["plan", "--world-size", "0"], "--world-size=0", "at least 1"),
    row("plan --world-size abc", ["plan", "--world-size", "abc"], "--world-size", "'abc'",
        "whole number"),
    row("slurm --time bogus", ["slurm", "--time", "bogus", "--nodes", "1", "--dry-run"],
        "--time", "bogus", "time limit"),
    row("slurm --nodes 0", ["slurm", "--nodes", "0", "--dry-run"], "--nodes=0", "at least 1"),
    row("slurm --nodes abc", ["slurm", "--nodes", "abc", "--dry-run"], "--nodes", "'abc'",
        "whole number"),
    row("slurm without --nodes", ["slurm", "--dry-run"], "--nodes", "Missing"),
    row("slurm --gpus-per-node 0", ["slurm", "--nodes", "1", "--gpus-per-node", "0", "--dry-run"],
        "--gpus-per-node=0", "at least 1"),
    row("slurm --partition with a newline",
        ["slurm", "--nodes", "1", "--partition", "gpu\nrm -rf ~", "--dry-run"],
        "--partition", "control character"),
    row("slurm --sbatch-arg with a newline",
        ["slurm", "--nodes", "1", "--sbatch-arg", "--exclusive\n#SBATCH --x", "--dry-run"],
        "--sbatch-arg", "control character"),
    row("name=../../x", ["launch", "--dry-run", "name=../../x"], "name='../../x'", "plain name"),
    row("name of 129 characters", ["show", "name=" + "a" * 129], "a" * 129, "at most 128"),
    row("name=${oc.env:HOME}", ["show", "name=${oc.env:HOME}"], "name='", "plain name"),
    row("launch --bogus-flag", ["launch", "--bogus-flag"], "--bogus-flag", "No such option"),
    row("--dry-run=3", ["launch", "--dry-run=3"], "--dry-run", "does not take a value"),
    row("unknown command", ["bogus"], "bogus", "No such command"),
    row("show --help-me", ["show", "--help-me"], "--help-me", "No such option"),
    row("SLURM_NODEID=7 of 2 nodes", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                               SLURM_NODEID="7"),
        "SLURM_NODEID=7", "0..1", absent=("--node-rank",)),
    row("SLURM_NODEID=x", _in_slurm(["launch", "--dry-run", "parallel.dp=4"], SLURM_NODEID="x"),
        "SLURM_NODEID=x", "not a whole number"),
    row("SLURM_JOB_ID=abc", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                      SLURM_JOB_ID="abc"),
        "SLURM_JOB_ID=abc", "not a job number"),
    row("SLURM node list n[1-2", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                           SLURM_JOB_NODELIST="n[1-2"),
        "SLURM_JOB_NODELIST", "n[1-2", "not a SLURM node list"),
    row("SLURM 4 tasks per node", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                            SLURM_NTASKS_PER_NODE="4"),
        "4 tasks", "double launch"),
    row("SLURM node list does not resolve",
        _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                  SLURM_JOB_NODELIST=f"a.{UNRESOLVABLE},b.{UNRESOLVABLE}"),
        "SLURM_JOB_NODELIST", UNRESOLVABLE, "does not resolve"),
    row("under torchrun", lambda c: c.setenv(TORCHELASTIC_RUN_ID="5", LOCAL_RANK="0") or
        ["launch", "--dry-run"], "TORCHELASTIC_RUN_ID=5", "torchrun"),
]

ROWS_TYPES_AND_CHOICES = [
    row("type: train.seed=abc", ["show", "train.seed=abc"], "train.seed", "'abc'", "Integer"),
    row("type: model.n_layers=1.5", ["show", "model.n_layers=1.5"], "model.n_layers", "1.5",
        "Integer"),
    row("type: optim.lr=abc", ["show", "optim.lr=abc"], "optim.lr", "'abc'", "Float"),
    row("type: model.dim={a:1}", ["show", "model.dim={a:1}"], "model.dim", "'a'", "Integer"),
    row("type: parallel.sequence_parallel=maybe", ["show", "parallel.sequence_parallel=maybe"],
        "parallel.sequence_parallel", "'maybe'", "bool"),
    row("type: parallel.deepspeed=5", ["show", "parallel.deepspeed=5"], "parallel.deepspeed",
        "int", "Dict"),
    row("type: parallel.pp_layers=abc", ["show", "parallel.pp_layers=abc"],
        "parallel.pp_layers", "str", "list"),
    row("null: name=null", ["show", "name=null"], "name", "null", "not Optional"),
    row("null: train.seed=null", ["show", "train.seed=null"], "train.seed", "null",
        "not Optional"),
    row("null: train.micro_batch_size=null (two of three)",
        ["show", "train.micro_batch_size=null"], "train.micro_batch_size", "set two of"),
    row("interpolation: train.seed=${oc.env:...}",
        ["show", "train.seed=${oc.env:PARTRAIN_HOSTILE_NOPE}"], "train.seed",
        "PARTRAIN_HOSTILE_NOPE", "not found"),
    row("interpolation: train.seed=${nosuch.key}", ["show", "train.seed=${nosuch.key}"],
        "train.seed", "nosuch.key", "not found"),
    row("choice: parallel.pp_schedule=foo", ["show", "parallel.pp_schedule=foo"],
        "parallel.pp_schedule=foo", "not one of"),
    row("choice: train.dtype=true", ["show", "train.dtype=true"],
        ("train.dtype=true", "train.dtype=True"), "not one of"),
    row("choice: launcher.device=tpu", ["show", "launcher.device=tpu"], "launcher.device=tpu",
        "not one of"),
    row("choice: data.source=web", ["show", "data.source=web"], "data.source=web", "not one of"),
    row("choice: parallel.offload_optimizer=disk",
        ["show", "parallel.offload_optimizer=disk", "parallel.zero_stage=1"],
        "parallel.offload_optimizer=disk", "not one of"),
    row("choice: parallel.zero_stage=4", ["show", "parallel.zero_stage=4"],
        "parallel.zero_stage=4", "0 (DDP), 1, 2 or 3"),
    row("choice: optim.name=sgd", ["show", "optim.name=sgd"], "optim.name=sgd", "adamw"),
    row("rule: offload_optimizer=cpu at zero_stage=0", ["show", "parallel.offload_optimizer=cpu"],
        "parallel.offload_optimizer=cpu", "zero_stage >= 1"),
    row("rule: nvme offload without a path",
        ["show", "parallel.offload_optimizer=nvme", "parallel.zero_stage=1"],
        "parallel.offload_nvme_path", "nvme"),
    row("rule: fp16 without ZeRO", ["show", "train.dtype=fp16"], "train.dtype=fp16",
        "zero_stage >= 1"),
    row("rule: pp_layers=[0,4]", ["show", "parallel.pp_layers=[0,4]", "parallel.pp=2",
                                  "parallel.dp=1"],
        "parallel.pp_layers=[0, 4]", "positive"),
    row("rule: batch triple inconsistent", ["show", "train.micro_batches=3"],
        "micro_batches(3)", "train.global_batch_size=16", "!="),
    row("rule: tp=3 on llama-70b", ["show", "model=llama-70b", "parallel.tp=3"],
        "parallel.tp=3", "model.n_heads=64", "divide"),
    *[row(f"negative: {key}={value}", ["show", f"{key}={value}"], f"{key}={value}", rule)
      for key, value, rule in [
          ("train.max_steps", -1, "at least 1"), ("model.vocab_size", -5, "at least 1"),
          ("data.stdlib_max_bytes", -1, "at least 1"), ("launcher.rdzv_timeout_s", 0, "at least 1"),
          ("train.micro_batch_size", -2, "at least 1"), ("train.eval_batches", 0, "at least 1")]],
]

def _symlink(c: Ctx, name: str, target: str) -> str:
    os.symlink(target, c.root / name)
    return c.path(name)


def _run_dir_with_fifo_config(c: Ctx) -> str:
    c.dir("run")
    c.fifo("run/config.yaml")
    return c.path("run")


# Found by a second, reviewing pass over the first table's fixes.
ROWS_SECOND_PASS = [
    row("CONFIG path too long", ["show", "c" * 300 + ".yaml"], "c" * 40, "too long"),
    row("CONFIG bare name too long", ["show", "c" * 300], "c" * 40, "too long"),
    row("data.path too long", ["launch", "--dry-run", "data=tokens", "data.path=/" + "a" * 5000],
        "a" * 40, "too long"),
    row("prepare input too long", lambda c: ["data", "prepare", "c" * 300, "--out", c.path("o")],
        "c" * 40, "too long"),
    row("escaped interpolation name=\\${x}", ["show", "name=\\${x}"], "name=${x}", "interpolation"),
    row("yaml defaults without config", lambda c: ["show", c.file("nc.yaml", "defaults: [_self_]\n")],
        "nc.yaml", "defaults", "config"),
    row("yaml defaults empty", lambda c: ["show", c.file("ne.yaml", "defaults: []\n")],
        "ne.yaml", "defaults", "config"),
    row("yaml _self_ before config",
        lambda c: ["show", c.file("sf.yaml", "defaults: [_self_, config]\nname: x\n")],
        "sf.yaml", "_self_", "config"),
    row("yaml defaults option is a list",
        lambda c: ["show", c.file("ol.yaml", "defaults:\n  - config\n  - override model: "
                                             "[tiny, llama-1b]\n  - _self_\n")],
        "ol.yaml", "override model", "one name"),
    row("yaml defaults option is null",
        lambda c: ["show", c.file("on.yaml", "defaults:\n  - config\n  - override model: null\n"
                                             "  - _self_\n")],
        "on.yaml", "override model: null", "one name"),
    row("pp_layers nested lists", ["show", "parallel.pp=2", "parallel.pp_layers=[[1],[2]]"],
        "parallel.pp_layers=[[1], [2]]", "whole block counts"),
    row("run dir is a symlink loop", lambda c: ["launch", "--dry-run", "--run-dir",
                                                _symlink(c, "loop", "loop")],
        "--run-dir", "loop", "symbolic link"),
    row("run dir is a dangling symlink", lambda c: ["launch", "--dry-run", "--run-dir",
                                                    _symlink(c, "dangle", "nowhere/run")],
        "--run-dir", "dangle", "symbolic link"),
    row("run dir whose config.yaml is a FIFO",
        lambda c: ["launch", "--dry-run", "--run-dir", _run_dir_with_fifo_config(c)],
        "--run-dir", "not empty"),
    row("SLURM_JOB_ID of 5000 digits", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                                  SLURM_JOB_ID="9" * 5000),
        "SLURM_JOB_ID", "job number"),
    row("SLURM_JOB_ID with a path", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                               SLURM_JOB_ID="1/../../etc"),
        "SLURM_JOB_ID", "1/../../etc", "job number"),
    row("SLURM node list of 10**8 nodes",
        _in_slurm(["launch", "--dry-run", "parallel.dp=4"], SLURM_JOB_NODELIST="n[1-99999999]"),
        "SLURM_JOB_NODELIST", "more than"),
    row("!!binary under parallel.deepspeed",
        lambda c: ["show", c.recipe("bin.yaml", "parallel:\n  zero_stage: 1\n  deepspeed:\n"
                                                "    x: !!binary aGVsbG8=\n")],
        "bin.yaml", "bytes", "quote"),
    row("a date as the name", lambda c: ["show", c.recipe("date.yaml", "name: 2024-01-01\n")],
        "date.yaml", "date", "quote"),
    row("n_heads a huge prime, tp=3", ["show", "model.n_heads=2305843009213693951",
                                       "model.n_kv_heads=2305843009213693951",
                                       "model.dim=4611686018427387902", "parallel.tp=3"],
        "parallel.tp=3", "model.n_heads=2305843009213693951"),
    row("pp of 4096 stages", ["plan", "parallel.pp=4096", "model.n_layers=4096",
                              "--world-size", "8192"],
        "pp(4096)", "exceeds"),
    row("+model=tiny adds a group twice", ["show", "+model=tiny"], "+model=tiny", "model=tiny"),
    row("model@foo=tiny", ["show", "model@foo=tiny"], "model@foo=tiny", "GROUP=OPTION"),
    row("--sbatch-arg contradicts --nodes",
        lambda c: ["slurm", "--nodes", "1", "--sbatch-arg=--nodes=3", "--dry-run",
                   "--run-dir", c.path("run")], "--nodes=3", "contradicts"),
    row("--sbatch-arg=-", lambda c: ["slurm", "--nodes", "1", "--sbatch-arg=-", "--dry-run",
                                     "--run-dir", c.path("run")], "--sbatch-arg", "'-'"),
    row("--partition ''", lambda c: ["slurm", "--nodes", "1", "--partition", "", "--dry-run",
                                     "--run-dir", c.path("run")], "--partition=''", "empty"),
    row("--ifname ''", ["launch", "--dry-run", *MULTI_NODE, "--ifname", ""], "--ifname ''",
        "empty"),
    row("--rdzv-endpoint [::1:29500", ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint",
                                       "[::1:29500", "parallel.dp=4"],
        "--rdzv-endpoint", "[::1:29500", "HOST:PORT"),
    row("plan --world-size names itself", ["plan", "--world-size", "4"],
        "--world-size=4", "!= world size 4"),
]

TABLE = [*_rows_non_finite(), *ROWS_FLOAT_RANGE, *ROWS_UNKNOWN_KEYS, *ROWS_CONFIG_FILES,
         *ROWS_RUN_DIRS, *ROWS_DATA, *ROWS_PREPARE, *ROWS_NETWORK, *ROWS_MARKUP, *ROWS_ABSURD,
         *ROWS_BLAME, *ROWS_FLAGS, *ROWS_TYPES_AND_CHOICES, *ROWS_SECOND_PASS]


# ------------------------------------------------------------------------------------------------
# The checks


def assert_refused(result, fragments, absent=()) -> None:
    """Exit 2, one `error:` message naming what it must, nothing else printed."""
    shown = f"exit {result.code}\n--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
    assert result.code == 2, shown
    for internal in INTERNALS:
        assert internal not in result.stdout + result.stderr, shown
    assert result.stdout == "", shown
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error:"), shown
    assert sum(line.startswith("error:") for line in lines) == 1, shown
    message = one_line(result.stderr)
    for fragment in fragments:
        options = (fragment,) if isinstance(fragment, str) else fragment
        assert any(option in message for option in options), f"{options} not in: {message}"
    for fragment in absent:
        assert fragment not in message, f"{fragment!r} in: {message}"


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: (kind, size, mtime) for files, kind for the rest. Directories'
    own times are left out: a temporary entry made and removed again is allowed."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            entries[os.path.relpath(path, root)] = \
                (kind, st.st_size, st.st_mtime_ns) if stat.S_ISREG(kind) else (kind,)
    return entries


def assert_untouched(root: Path, before: dict) -> None:
    after = tree(root)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), \
        f"written: added {added}, removed {removed}, changed {changed}"
    assert not (root / "runs").exists()
    assert processes_mentioning(str(root)) == []


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """cwd = tmp_path (a default run dir would land in tmp_path/runs), the temp dir inside it,
    and no scheduler environment inherited from whoever runs the tests."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIXES):
            monkeypatch.delenv(name)
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    monkeypatch.setenv("TMPDIR", str(systmp))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    args = argv(Ctx(tmp_path, monkeypatch)) if callable(argv) else list(argv)
    before = tree(tmp_path)
    result = run_main(*args)
    assert_refused(result, fragments, absent)
    assert_untouched(tmp_path, before)


def test_table_is_big_enough():
    assert len(TABLE) >= 90


# ------------------------------------------------------------------------------------------------
# Disks that refuse writes (root ignores chmod: a real read-only or full tmpfs)

COMMANDS = [pytest.param(["launch", "--dry-run"], id="launch"),
            pytest.param(["slurm", "--nodes", "1", "--dry-run"], id="slurm")]


@pytest.mark.parametrize("command", COMMANDS)
def test_run_dir_on_readonly_fs(command, readonly_fs, run_main, tmp_path):
    run_dir = readonly_fs / "run"
    before = tree(tmp_path)
    assert_refused(run_main(*command, "--run-dir", str(run_dir)),
                   ["--run-dir", str(run_dir), "read-only"])
    assert_untouched(tmp_path, before)


@pytest.mark.parametrize("command", COMMANDS)
def test_run_dir_on_full_fs(command, full_fs, run_main, tmp_path):
    run_dir = full_fs / "deeper" / "run"
    before = tree(tmp_path)
    assert_refused(run_main(*command, "--run-dir", str(run_dir)),
                   ["--run-dir", str(run_dir), "bytes free"])
    assert_untouched(tmp_path, before)


def test_prepare_on_readonly_fs(readonly_fs, run_main, tmp_path, monkeypatch):
    text = Ctx(tmp_path, monkeypatch).text()
    out = readonly_fs / "tokens"
    before = tree(tmp_path)
    assert_refused(run_main("data", "prepare", text, "--out", str(out)),
                   ["--out", str(out), "Read-only file system"])
    assert_untouched(tmp_path, before)


@pytest.mark.parametrize("full_fs", [0, 8192], indirect=True)
def test_prepare_on_full_fs(full_fs, run_main, tmp_path, monkeypatch):
    """With 8 KiB of room the first file is written in part before the disk fills."""
    text = Ctx(tmp_path, monkeypatch).text(size=40000)
    out = full_fs / "a" / "tokens"
    before = tree(tmp_path)
    assert_refused(run_main("data", "prepare", text, "--out", str(out)),
                   ["--out", str(out), "No space left on device", "nothing was left behind"])
    assert_untouched(tmp_path, before)
    assert list(full_fs.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# Allowed by design (controls: the table's refusals are not refusals of everything)


def test_deepspeed_takes_free_keys(run_main):
    result = run_main("show", "+parallel.deepspeed.X=1", "parallel.zero_stage=1")
    assert result.code == 0, result.stderr
    assert "X: 1" in result.stdout


def test_dry_run_into_an_empty_run_dir_writes_nothing(run_main, tmp_path):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    result = run_main("launch", "--dry-run", "--run-dir", str(run_dir))
    assert result.code == 0, result.stderr
    assert list(run_dir.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# As a user runs it: `python -m partrain` in a subprocess, all started at once


def _bomb_yaml(c: Ctx) -> str:
    """600 bytes of YAML whose aliases expand to 10**9 list items, inside parallel.deepspeed
    (the one key that takes anything)."""
    lines = [RECIPE_HEAD.rstrip("\n"), "parallel:", "  zero_stage: 1", "  deepspeed:",
             "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return c.file("bomb.yaml", "\n".join(lines) + "\n")


SUBPROCESS_CASES = {
    "launch-bad-value-with-run-dir": (
        lambda c: ["launch", "optim.lr=nan", "--run-dir", c.path("run")],
        ["optim.lr=nan", "finite"], None),
    "show-non-utf8-config": (
        lambda c: ["show", c.file("latin1.yaml", RECIPE_HEAD.encode() + b"name: caf\xe9\n")],
        ["latin1.yaml", "not UTF-8", "0xe9"], None),
    "launch-nproc-per-node-abc": (
        lambda c: ["launch", "--nproc-per-node", "abc", "--run-dir", c.path("run")],
        ["--nproc-per-node", "'abc'", "whole number"], None),
    "launch-run-dir-under-a-file": (
        lambda c: ["launch", "--run-dir", c.file("afile") + "/run"],
        ["--run-dir", "afile/run", "is a file"], None),
    "launch-lying-token-dir": (
        lambda c: ["launch", "data=tokens", "--run-dir", c.path("run"), "data.path=" + c.tokens(
            "tok", dtype="uint16", vocab=256, train=np.arange(600))],
        ["data.path=", "token id 599", "vocab_size=256"], None),
    "prepare-out-under-a-file": (
        lambda c: ["data", "prepare", c.text(), "--out", c.file("afile") + "/out"],
        ["--out", "afile/out", "is a file"], None),
    "launch-node-rank-1-bad-endpoint-with-local-addr": (
        lambda c: ["launch", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                   "127.0.0.1:70000", "--local-addr", "127.0.0.1", "parallel.dp=4",
                   "launcher.rdzv_timeout_s=5", "--run-dir", c.path("run")],
        ["--rdzv-endpoint", "127.0.0.1:70000", "1..65535"], None),
    "show-yaml-alias-bomb": (
        lambda c: ["show", _bomb_yaml(c)],
        ["bomb.yaml", "100,000 values", "aliases"], None),
}
SUBPROCESS_TIMEOUT_S = 60
BOMB_TIMEOUT_S = 30
SUBPROCESS_TEST = "test_refused_as_a_user_runs_it"


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
    """The selected subprocess cases, started when the module starts so that they run beside the
    in-process rows: each with its inputs in its own directory (its cwd and TMPDIR), and killed
    at its deadline. Their tests, at the end of the file, collect the results."""
    cases = [item.callspec.params["case"] for item in request.session.items
             if getattr(item, "originalname", None) == SUBPROCESS_TEST]
    procs, timers = {}, []
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(ENV_PREFIXES):
                mp.delenv(name)
        for case in cases:
            root = tmp_path_factory.mktemp(case)
            (root / "systmp").mkdir()
            mp.setenv("TMPDIR", str(root / "systmp"))
            argv = SUBPROCESS_CASES[case][0](Ctx(root, mp))
            before = tree(root)
            proc = start_cli(*argv, cwd=root)
            timer = threading.Timer(BOMB_TIMEOUT_S if "bomb" in case else SUBPROCESS_TIMEOUT_S,
                                    proc.kill)
            timer.daemon = True
            timer.start()
            timers.append(timer)
            procs[case] = (proc, root, before)
    yield procs
    for timer in timers:
        timer.cancel()
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=[pytest.mark.xfail(strict=True, reason=xfail)] if xfail else [])
    for case, (_, _, xfail) in SUBPROCESS_CASES.items()])
def test_refused_as_a_user_runs_it(case, started):
    """A process killed at its deadline exits -9, which fails like any other wrong code."""
    proc, root, before = started[case]
    result = finish(proc, timeout=SUBPROCESS_TIMEOUT_S + 10)
    assert_refused(result, SUBPROCESS_CASES[case][1])
    assert_untouched(root, before)

"""Shared pieces of the hostile-input tables (test_hostile.py: config; test_hostile_io.py: run
dirs, flags, the environment; test_hostile_data.py: token dirs and `data prepare`;
test_hostile_disks.py, test_hostile_subprocess.py): what a row builds in its test's directory,
and the checks every row must pass. The tables' module docstrings say what they prove."""

import dataclasses
import functools
import json
import os
import stat
import tempfile
import typing
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from partrain.config.schema import Config
from tests.integration.conftest import processes_mentioning
from tests.unit.helpers import one_line, resolved

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



def check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch) -> None:
    """One row: build its inputs, run the CLI in-process, and check the contract."""
    args = argv(Ctx(tmp_path, monkeypatch)) if callable(argv) else list(argv)
    before = tree(tmp_path)
    result = run_main(*args)
    assert_refused(result, fragments, absent)
    assert_untouched(tmp_path, before)

"""`partrain data prepare` of byte tokens (`prepare_token_dir` without --tokenizer; the
tokenizer is test_prepare.py's): the token dir it writes and its refusals, in-process and through
the CLI, with nothing left behind. `text_files` is tests/unit/conftest.py's."""

import errno
import json
import os
from pathlib import Path

import pytest

from partrain.data import prepare as prepare_module
from partrain.data.prepare import prepare_token_dir
from partrain.data.tokens import load_tokens
from partrain.errors import ConfigError
from tests.unit.helpers import one_line, quick

# `prepare_token_dir` in-process.

def test_prepare_token_dir_round_trip(tmp_path, text_files):
    out = tmp_path / "tok"
    meta = prepare_token_dir(text_files, out, 0.1)
    stream = b"\n".join(f.read_bytes() for f in text_files)
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json", "train-00000.bin", "train.idx.npy", "val-00000.bin", "val.idx.npy"]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format"] == "partrain-tokens/2" and meta["vocab_size"] == 256
    assert meta["train_tokens"] + meta["val_tokens"] == len(stream)
    assert meta["val_tokens"] == len(stream) - int(len(stream) * 0.9)
    # No temp dir left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "tok"]

    splits = load_tokens(quick("data.source=tokens", f"data.path={out}").data)
    assert splits.vocab_size == 256
    assert splits.train.tobytes() + splits.val.tobytes() == stream
    assert len(splits.train) == meta["train_tokens"]


def test_prepare_into_an_existing_empty_dir(tmp_path, text_files):
    out = tmp_path / "empty"
    out.mkdir()
    meta = prepare_token_dir(text_files, out, 0.5)
    assert (out / "meta.json").is_file()
    assert meta["val_tokens"] > 0


def test_prepare_missing_input_file(tmp_path, text_files):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match="input file .*nope.txt does not exist"):
        prepare_token_dir([text_files[0], missing], tmp_path / "tok", 0.1)
    assert not (tmp_path / "tok").exists()


def test_prepare_refuses_a_non_empty_out(tmp_path, text_files):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        prepare_token_dir(text_files, out, 0.1)
    assert (out / "keep.txt").read_text() == "mine"


def test_prepare_refuses_an_out_that_is_a_file(tmp_path, text_files):
    out = tmp_path / "a-file"
    out.write_text("x")
    with pytest.raises(ConfigError):
        prepare_token_dir(text_files, out, 0.1)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, float("nan"), float("inf"),
                                      float("-inf")])
def test_prepare_bad_val_fraction(tmp_path, text_files, fraction):
    with pytest.raises(ConfigError, match=f"--val-fraction={fraction} must be between 0 and 1"):
        prepare_token_dir(text_files, tmp_path / "tok", fraction)


def test_prepare_too_little_text(tmp_path):
    small = tmp_path / "small.txt"
    small.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="3 bytes"):
        prepare_token_dir([small], tmp_path / "tok", 0.1)


def test_prepare_records_the_max_token_id(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"abc\n" * 100)
    meta = prepare_token_dir([text], tmp_path / "tok", 0.1)
    assert meta["max_token_id"] == ord("c")
    assert json.loads((tmp_path / "tok" / "meta.json").read_text())["max_token_id"] == ord("c")


# `partrain data prepare` through the CLI (in-process).

def test_cli_data_prepare(run_main, tmp_path, text_files):
    out = tmp_path / "tok"
    result = run_main("data", "prepare", *map(str, text_files), "--out", str(out),
                      "--val-fraction", "0.2")
    assert result.code == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    text = one_line(result.stdout.splitlines()[-1])
    assert f"{meta['train_tokens']:,} train" in text
    assert f"{meta['val_tokens']:,} val tokens" in text
    assert text.startswith("wrote ")
    assert "data=tokens" in text
    assert meta["val_tokens"] == sum(f.stat().st_size for f in text_files) + 1 - meta["train_tokens"]


def test_cli_data_prepare_error_is_exit_2(run_main, tmp_path, text_files):
    result = run_main("data", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "t"))
    assert result.code == 2
    assert "nope.txt does not exist" in result.stderr
    assert not (tmp_path / "t").exists()


# `partrain data prepare` where --out cannot be written or the input cannot be read: exit 2,
# one message, and nothing left behind (no --out, no `.NAME.tmp-*`, no parent made for it).

def _prepare(run_main, files, out, *more):
    result = run_main("data", "prepare", *map(str, files), "--out", str(out), *more)
    assert result.code == 2, result.stdout
    assert "Traceback" not in result.stderr
    return one_line(result.stderr)


def test_prepare_out_under_a_file(run_main, tmp_path, text_files):
    out = tmp_path / "file.txt" / "out"
    (tmp_path / "file.txt").write_text("mine")
    message = _prepare(run_main, text_files, out)
    assert f"--out {out}: {tmp_path / 'file.txt'} is a file, not a directory" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "file.txt"]
    assert (tmp_path / "file.txt").read_text() == "mine"


@pytest.mark.parametrize("under", ["tok", "a/b/tok"])
def test_prepare_on_a_read_only_file_system(run_main, readonly_fs, text_files, under):
    out = readonly_fs / under
    message = _prepare(run_main, text_files, out)
    assert f"--out {out} cannot be written: Read-only file system (" in message
    assert "nothing was left behind" in message
    assert list(readonly_fs.iterdir()) == []


@pytest.mark.parametrize("full_fs, step", [
    (0, "writing train-00000.bin"), (4096, "writing train.idx.npy"),
    (8192, "writing val-00000.bin"), (16384, "writing val.idx.npy"),
], indirect=["full_fs"])
@pytest.mark.parametrize("under", ["tok", "a/b/tok"])
def test_prepare_on_a_full_disk(run_main, full_fs, text_files, step, under):
    # ~2 KB of text, each file in a 4 KiB page of the tmpfs: train-00000.bin, the document starts
    # streamed beside it (for train.idx.npy), the val tail cut into val-00000.bin, train.idx.npy,
    # then val.idx.npy (the starts file is removed before meta.json is written).
    out = full_fs / under
    message = _prepare(run_main, text_files, out)
    assert f"--out {out} cannot be written: No space left on device ({step}); nothing was left behind" in message
    assert list(full_fs.iterdir()) == []  # no .tok.tmp-*, no half-written dir, no a/b


def test_prepare_interrupted_leaves_nothing(tmp_path, text_files, monkeypatch):
    real_open = open

    def interrupted(file, *args, **kwargs):
        if str(file).endswith("val-00000.bin"):
            raise KeyboardInterrupt
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "open", interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        prepare_token_dir(text_files, tmp_path / "new" / "tok", 0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_prepare_creates_missing_parents(tmp_path, text_files):
    out = tmp_path / "a" / "b" / "tok"
    prepare_token_dir(text_files, out, 0.1)
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json", "train-00000.bin", "train.idx.npy", "val-00000.bin", "val.idx.npy"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["tok"]


@pytest.mark.parametrize("target", ["file", "empty-dir", "missing"])
def test_prepare_refuses_an_out_that_is_a_symlink(run_main, tmp_path, text_files, target):
    pointed = tmp_path / "target"
    if target == "file":
        pointed.write_text("mine")
    elif target == "empty-dir":
        pointed.mkdir()
    out = tmp_path / "link"
    out.symlink_to(pointed)
    message = _prepare(run_main, text_files, out)
    assert f"--out {out} is a symbolic link (to {pointed}); give a new directory, not a link" in message
    assert out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["a.txt", "b.txt", "link"] + ([] if target == "missing" else ["target"]))
    if target == "file":
        assert pointed.read_text() == "mine"


@pytest.mark.parametrize("out", [".", ".."])
def test_prepare_refuses_the_current_or_parent_dir(run_main, tmp_path, text_files, monkeypatch, out):
    here = tmp_path / "empty" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    message = _prepare(run_main, text_files, out)
    assert f"--out {out} must name a new directory, not the current or a parent one" in message
    assert here.is_dir() and list(here.iterdir()) == []


def test_prepare_input_that_is_an_empty_directory(run_main, tmp_path, text_files):
    folder = tmp_path / "folder"
    (folder / ".hidden").mkdir(parents=True)
    (folder / ".hidden" / "a.txt").write_text("skipped")
    (folder / ".b.txt").write_text("skipped")
    message = _prepare(run_main, [text_files[0], folder], tmp_path / "tok")
    assert (f"input directory {folder} holds no files (hidden ones and __pycache__ folders are "
            "skipped)") in message
    assert not (tmp_path / "tok").exists()


def test_a_directorys_links_are_followed_once_and_a_broken_one_is_refused(tmp_path):
    """A linked folder inside an input directory was skipped without a word (os.walk does not
    follow links), and so was a broken link; a link back up is read once, not in a loop."""
    from partrain.data.input_paths import collect_inputs

    tree, shared = tmp_path / "tree", tmp_path / "shared"
    (tree / "a").mkdir(parents=True)
    shared.mkdir()
    (tree / "a" / "one.txt").write_text("alpha")
    (shared / "two.txt").write_text("beta")
    (tree / "linked").symlink_to(shared)
    (tree / "a" / "up").symlink_to(tree)  # a loop
    assert [p.relative_to(tree).as_posix() for p in collect_inputs([tree])] == [
        "a/one.txt", "linked/two.txt"]
    (tree / "broken.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(ConfigError) as e:
        collect_inputs([tree])
    assert (f"input file {tree / 'broken.txt'} (under input {tree}) is a symbolic link to "
            f"{tmp_path / 'gone.txt'}, which does not exist") in str(e.value)


def test_prepare_input_that_is_a_pipe(run_main, tmp_path, text_files):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    message = _prepare(run_main, [fifo], tmp_path / "tok")
    assert f"input file {fifo} is not a regular file (a pipe, socket or device)" in message
    assert not (tmp_path / "tok").exists()


def test_prepare_input_that_cannot_be_read(run_main, tmp_path, text_files, monkeypatch):
    import builtins

    from partrain.data import inputs

    def denied(path, *args, **kwargs):  # the inputs' open()
        if Path(path) == text_files[1]:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(inputs, "open", denied, raising=False)
    message = _prepare(run_main, text_files, tmp_path / "tok")
    assert f"input file {text_files[1]} cannot be read: Permission denied" in message
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "1"])
def test_prepare_val_fraction_through_the_cli(run_main, tmp_path, text_files, value):
    message = _prepare(run_main, text_files, tmp_path / "tok", "--val-fraction", value)
    assert f"--val-fraction={float(value)} must be between 0 and 1 (exclusive)" in message
    assert not (tmp_path / "tok").exists()


def test_prepare_val_fraction_too_small_for_a_val_split(tmp_path, text_files):
    with pytest.raises(ConfigError) as info:
        prepare_token_dir(text_files, tmp_path / "tok", 1e-9)
    assert str(info.value) == ("the input files hold 1921 bytes; --val-fraction=1e-09 splits them "
                               "into 1920 train and 1 val tokens, and each split needs at least 2")
    assert not (tmp_path / "tok").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGHUP", "SIGHUP-under-nohup"])
def test_a_stop_signal_mid_prepare_leaves_nothing_and_no_worker(tmp_path, stop):
    """A real `partrain data prepare` with two tokenizer processes, stopped by SIGTERM (a job
    runner) or SIGHUP (a closed terminal) while it encodes: it ended at once (their default
    action), leaving its temporary directory and both workers blocked forever on a pipe. Now as
    on Ctrl-C: exit 130, nothing left, no process of it alive. Under `nohup` (SIGHUP ignored)
    the signal is still ignored, and the prepare finishes."""
    import signal
    import subprocess
    import sys
    import time

    from tests.unit.data.corpus import train_bpe

    train_bpe(tmp_path / "tokenizer.json")
    line = "the quick brown fox jumps over the lazy dog, again and again, 0123456789.\n"
    (tmp_path / "big.txt").write_text(line * (24_000_000 // len(line)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain", "data", "prepare", str(tmp_path / "big.txt"), "--out",
         str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tokenizer.json"), "--workers", "2"],
        cwd=Path(__file__).parents[3], start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
        if stop.endswith("nohup") else None)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the workers are encoding
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(getattr(signal, stop.split("-")[0]))
        _, err = proc.communicate(timeout=120)
        if stop.endswith("nohup"):
            assert proc.returncode == 0, err
            assert (tmp_path / "out" / "meta.json").is_file()
            return
        assert proc.returncode == 130, err
        assert "Traceback" not in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "tokenizer.json"]
        for _ in range(100):  # its tokenizer processes end with it
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("a process of the stopped prepare is still alive")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

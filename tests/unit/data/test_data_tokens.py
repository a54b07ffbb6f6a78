"""Token streams (partrain/data/tokens.py: `load_tokens`, `check_data`): the stdlib corpus and
prepared token dirs, and their errors: corrupt dirs, ids that the meta.json or the model do not
allow, files partrain cannot read. `text_files` is tests/unit/conftest.py's."""

import errno
import json
import os

import numpy as np
import pytest

from partrain.data import token_files
from partrain.data.prepare import prepare_token_dir
from partrain.data.token_files import SAMPLE_BLOCK, SAMPLE_BLOCKS, sample_max_token_id
from partrain.data.tokens import check_data, load_tokens
from partrain.errors import ConfigError
from tests.unit.helpers import one_line, quick

# The stdlib corpus.

def test_stdlib_corpus_loads():
    cfg = quick("data.stdlib_max_bytes=400000")
    splits = load_tokens(cfg.data)
    assert splits.vocab_size == 256
    assert len(splits.train) + len(splits.val) == 400_000
    assert len(splits.val) > 0 and len(splits.train) > len(splits.val)
    assert abs(len(splits.val) / 400_000 - cfg.data.val_fraction) < 1e-3
    assert splits.train.dtype == np.uint8
    assert b"def " in splits.train.tobytes()  # real Python source
    assert "stdlib" in splits.description


def test_stdlib_corpus_is_the_same_every_time():
    cfg = quick("data.stdlib_max_bytes=100000")
    a, b = load_tokens(cfg.data), load_tokens(cfg.data)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)


def test_stdlib_default_corpus_is_big_enough_for_quickstart():
    cfg = quick()
    description = check_data(cfg)
    assert "stdlib" in description


# Prepared token dirs.

@pytest.fixture
def token_dir(tmp_path, text_files):
    out = tmp_path / "tok"
    prepare_token_dir(text_files, out, 0.1)
    return out


def _tokens_cfg(path, *more):
    return quick("data.source=tokens", f"data.path={path}", *more)


def _edit_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt, fragment", [
    (lambda p: (p / "meta.json").write_text("{not json"), "meta.json is not valid JSON"),
    (lambda p: (p / "meta.json").unlink(), "no meta.json"),
    (lambda p: (p / "meta.json").write_text("[1, 2]"), "format is [1, 2]"),
    (lambda p: _edit_meta(p, format="other/9"), "format is 'other/9'"),
    (lambda p: _edit_meta(p, dtype="float32"), "dtype='float32'"),
    (lambda p: _edit_meta(p, vocab_size=0), "vocab_size=0"),
    (lambda p: _edit_meta(p, train_tokens="many"), "train_tokens='many'"),
    (lambda p: (p / "val-00000.bin").unlink(), "val-00000.bin is missing"),
    (lambda p: (p / "train-00000.bin").write_bytes((p / "train-00000.bin").read_bytes()[:-1]),
     "train-00000.bin has"),
    (lambda p: (p / "val.idx.npy").unlink(), "val.idx.npy is missing"),
    (lambda p: _edit_meta(p, format="partrain-tokens/1"), "train.bin is missing"),
    (lambda p: _edit_meta(p, dtype="uint16"), "of uint16"),
])
def test_corrupt_token_dir_is_a_config_error(token_dir, corrupt, fragment):
    corrupt(token_dir)
    cfg = _tokens_cfg(token_dir)
    with pytest.raises(ConfigError) as info:
        load_tokens(cfg.data)
    assert fragment in str(info.value)
    assert f"data.path={token_dir}" in str(info.value)
    with pytest.raises(ConfigError):
        check_data(cfg)


def test_meta_without_tokenizer(token_dir):
    meta = json.loads((token_dir / "meta.json").read_text())
    del meta["tokenizer"]
    (token_dir / "meta.json").write_text(json.dumps(meta))
    try:
        splits = load_tokens(_tokens_cfg(token_dir).data)
    except ConfigError as e:
        assert "tokenizer" in str(e)  # a clear error is one acceptable fix
    else:
        assert len(splits.train) == meta["train_tokens"]  # reading it anyway is the other


def test_check_data_accepts_a_prepared_dir(token_dir):
    description = check_data(_tokens_cfg(token_dir, "train.seq_len=32"))
    assert str(token_dir) in description


def test_check_data_tokens_needs_a_path():
    with pytest.raises(ConfigError, match="data.source=tokens needs data.path"):
        check_data(quick("data.source=tokens"))


def test_check_data_path_must_be_a_dir(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        check_data(_tokens_cfg(tmp_path / "nope"))


def test_check_data_rejects_vocab_larger_than_model():
    cfg = quick("data.stdlib_max_bytes=100000", "model.vocab_size=128")
    with pytest.raises(ConfigError) as info:
        check_data(cfg)
    assert "vocab_size=256 exceeds model.vocab_size=128" in str(info.value)
    check_data(quick("data.stdlib_max_bytes=100000", "model.vocab_size=256"))


def test_check_data_rejects_too_short_val_split():
    # 4000 bytes, 5% held out = 200 tokens: fine for seq_len 128, too short for 256.
    check_data(quick("data.stdlib_max_bytes=4000", "train.seq_len=128"))
    with pytest.raises(ConfigError) as info:
        check_data(quick("data.stdlib_max_bytes=4000", "train.seq_len=256"))
    assert "the val split has 200 tokens, fewer than train.seq_len + 1 = 257" in str(info.value)


def test_check_data_rejects_too_short_train_split(token_dir):
    meta = json.loads((token_dir / "meta.json").read_text())
    with pytest.raises(ConfigError) as info:
        check_data(_tokens_cfg(token_dir, f"train.seq_len={meta['train_tokens']}"))
    assert f"the train split has {meta['train_tokens']:,} tokens" in str(info.value)


# Data that lies: ids that the meta.json or the model do not allow, found before any process.

def _write_token_dir(path, train, val, dtype, vocab_size, **extra):
    """A token dir written by hand, as another tool (or a mistake) might write one."""
    path.mkdir()
    np.asarray(train, dtype=dtype).tofile(path / "train.bin")
    np.asarray(val, dtype=dtype).tofile(path / "val.bin")
    meta = {"format": "partrain-tokens/1", "tokenizer": "test", "dtype": dtype,
            "vocab_size": vocab_size, "train_tokens": len(train), "val_tokens": len(val), **extra}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _refused(cfg) -> str:
    """The one message of the ConfigError that both load_tokens and check_data raise."""
    with pytest.raises(ConfigError) as info:
        load_tokens(cfg.data)
    with pytest.raises(ConfigError) as again:
        check_data(cfg)
    assert str(again.value) == str(info.value)
    return str(info.value)


@pytest.mark.parametrize("split, index", [("train", 0), ("train", 77), ("train", 99), ("val", 40)])
def test_an_id_at_or_above_vocab_size_is_refused(tmp_path, split, index):
    ids = {"train": np.full(100, 7), "val": np.full(50, 7)}
    ids[split][index] = 300
    path = _write_token_dir(tmp_path / "tok", ids["train"], ids["val"], "uint16", 256)
    message = _refused(_tokens_cfg(path, "train.seq_len=16"))
    assert message == (
        f"data.path={path}: {split}.bin holds token id 300 (at index {index}), not below "
        "meta.json vocab_size=256; every id must be < vocab_size (is dtype=uint16 right?)")


def test_an_id_equal_to_vocab_size_is_refused_and_one_below_is_not(tmp_path):
    train = np.arange(100) % 10
    train[5] = 9
    ok = _write_token_dir(tmp_path / "ok", train, np.zeros(50), "uint8", 10)
    check_data(_tokens_cfg(ok, "train.seq_len=16"))
    train[5] = 10
    bad = _write_token_dir(tmp_path / "bad", train, np.zeros(50), "uint8", 10)
    assert "token id 10 (at index 5), not below meta.json vocab_size=10" in _refused(
        _tokens_cfg(bad, "train.seq_len=16"))


def test_a_wrong_dtype_in_meta_is_found_by_the_ids(token_dir):
    # Byte tokens declared as uint16, with token counts that match the sizes: each pair of
    # bytes reads as one id far above 256.
    meta = json.loads((token_dir / "meta.json").read_text())
    for split in ("train", "val"):
        data = (token_dir / f"{split}-00000.bin").read_bytes()
        (token_dir / f"{split}-00000.bin").write_bytes(data[:len(data) // 2 * 2])
        meta[f"{split}_tokens"] = len(data) // 2
        meta[f"{split}_shards"] = [len(data) // 2]
    del meta["max_token_id"]
    meta["dtype"] = "uint16"
    (token_dir / "meta.json").write_text(json.dumps(meta))
    message = _refused(_tokens_cfg(token_dir, "train.seq_len=16"))
    assert f"data.path={token_dir}: train-00000.bin holds token id " in message
    assert "not below meta.json vocab_size=256; every id must be < vocab_size" in message
    assert "is dtype=uint16 right?" in message


def test_a_recorded_max_token_id_is_checked_against_the_ids(token_dir):
    _edit_meta(token_dir, max_token_id=100)  # the text holds 0xff bytes
    message = _refused(_tokens_cfg(token_dir, "train.seq_len=16"))
    assert message.startswith(f"data.path={token_dir}: train-00000.bin holds token id 255 (at index ")
    assert "above meta.json max_token_id=100; every id must be <= max_token_id" in message


@pytest.mark.parametrize("max_token_id, fragment", [
    (256, "max_token_id=256 is not below vocab_size=256; every token id must be < vocab_size"),
    (-1, "max_token_id=-1 must be a non-negative integer"),
    (True, "max_token_id=True must be a non-negative integer, not a boolean"),
    (255.0, "max_token_id=255.0 must be a non-negative integer, not a decimal number"),
    ("255", "max_token_id='255' must be a non-negative integer, not a string"),
    (None, "max_token_id=None must be a non-negative integer, not null"),
])
def test_a_bad_recorded_max_token_id_is_refused(token_dir, max_token_id, fragment):
    _edit_meta(token_dir, max_token_id=max_token_id)
    assert _refused(_tokens_cfg(token_dir)) == f"data.path={token_dir}: meta.json {fragment}"


def test_a_dir_without_max_token_id_is_still_read(token_dir):
    meta = json.loads((token_dir / "meta.json").read_text())
    del meta["max_token_id"]
    (token_dir / "meta.json").write_text(json.dumps(meta))
    assert str(token_dir) in check_data(_tokens_cfg(token_dir, "train.seq_len=32"))


@pytest.mark.parametrize("dtype, vocab_size, needs", [
    ("uint8", 1000, "uint16"), ("uint8", 257, "uint16"), ("uint16", 65537, "uint32"),
])
def test_a_vocab_size_beyond_the_dtype_is_refused(tmp_path, dtype, vocab_size, needs):
    path = _write_token_dir(tmp_path / "tok", np.zeros(100), np.zeros(50), dtype, vocab_size)
    ids = np.iinfo(dtype).max + 1
    assert _refused(_tokens_cfg(path)) == (
        f"data.path={path}: meta.json vocab_size={vocab_size} does not fit dtype={dtype}, which "
        f"holds ids 0..{ids - 1} (vocab_size <= {ids}); ids of this vocabulary need {needs}")


@pytest.mark.parametrize("dtype, vocab_size", [("uint8", 256), ("uint16", 65536), ("uint32", 256)])
def test_a_vocab_size_within_the_dtype_is_accepted(tmp_path, dtype, vocab_size):
    path = _write_token_dir(tmp_path / "tok", np.arange(100) % 256, np.zeros(50), dtype,
                            vocab_size, max_token_id=99)
    cfg = _tokens_cfg(path, "train.seq_len=16", f"model.vocab_size={max(vocab_size, 256)}")
    assert str(path) in check_data(cfg)


def test_ids_that_fit_the_data_but_not_the_model_are_refused(tmp_path):
    path = _write_token_dir(tmp_path / "tok", np.arange(100) + 200, np.zeros(50), "uint16", 512,
                            max_token_id=299)
    load_tokens(_tokens_cfg(path).data)  # the dir itself is consistent
    with pytest.raises(ConfigError) as info:
        check_data(_tokens_cfg(path, "train.seq_len=16", "model.vocab_size=256"))
    assert "the data's vocab_size=512 exceeds model.vocab_size=256" in str(info.value)


def test_the_id_sample_is_bounded_and_covers_both_ends():
    class Huge:
        """A 1e12-id split that counts the ids read from it."""
        read = 0

        def __len__(self):
            return 10**12

        def __getitem__(self, s):
            n = s.stop - s.start
            Huge.read += n
            chunk = np.zeros(n, dtype=np.uint32)
            if s.stop == 10**12:
                chunk[-1] = 7  # the very last id
            return chunk

    assert sample_max_token_id(Huge()) == (7, 10**12 - 1)
    assert Huge.read == SAMPLE_BLOCKS * SAMPLE_BLOCK
    # Shorter than the sample: every id is read.
    ids = np.zeros(SAMPLE_BLOCKS * SAMPLE_BLOCK, dtype=np.uint8)
    ids[12345] = 3
    assert sample_max_token_id(ids) == (3, 12345)


@pytest.mark.parametrize("index", [0, -1])
def test_a_big_sparse_split_is_checked_at_both_ends(tmp_path, index):
    # 256 MiB of uint16 zeros without writing them (a sparse file): the check reads the sample
    # only; an id past the vocabulary at the first or last position is found.
    path = _write_token_dir(tmp_path / "tok", np.zeros(100), np.zeros(50), "uint16", 1000)
    n = 128 << 20
    with open(path / "train.bin", "r+b") as f:
        f.truncate(2 * n)
        f.seek(2 * (n - 1 if index == -1 else 0))
        f.write(np.array([4000], dtype="<u2").tobytes())
    _edit_meta(path, train_tokens=n)
    message = _refused(_tokens_cfg(path, "model.vocab_size=1000"))
    assert f"train.bin holds token id 4000 (at index {n - 1 if index == -1 else 0})" in message


# Files partrain cannot read: a ConfigError naming the file, never a UnicodeDecodeError.

def _replace_with_dir(file):
    file.unlink()
    file.mkdir()


def _replace_with_fifo(file):
    file.unlink()
    os.mkfifo(file)


@pytest.mark.parametrize("corrupt, fragment", [
    (lambda p: (p / "meta.json").write_bytes(
        '{"format": "partrain-tokens/1", "tokenizer": "café"}'.encode("latin-1")),
     "meta.json is not UTF-8 text (byte 0xe9 at offset 49); it must be JSON in UTF-8"),
    (lambda p: (p / "meta.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
     "meta.json is not UTF-8 text (byte 0x89 at offset 0)"),
    (lambda p: (p / "meta.json").write_bytes(b"\x00\x01\x02"), "meta.json is not valid JSON"),
    (lambda p: (p / "meta.json").write_text("[" * 100_000), "meta.json is not valid JSON"),
    (lambda p: _replace_with_dir(p / "meta.json"), "meta.json is a directory, not a file"),
    (lambda p: _replace_with_fifo(p / "meta.json"),
     "meta.json is not a regular file (a pipe, socket or device)"),
    (lambda p: _replace_with_dir(p / "train-00000.bin"),
     "train-00000.bin is a directory, not a file"),
    (lambda p: _replace_with_fifo(p / "val-00000.bin"),
     "val-00000.bin is not a regular file (a pipe, socket or device)"),
    (lambda p: _replace_with_dir(p / "train.idx.npy"), "train.idx.npy is a directory, not a file"),
])
def test_a_file_partrain_cannot_read_is_a_config_error(token_dir, corrupt, fragment):
    corrupt(token_dir)
    message = _refused(_tokens_cfg(token_dir))
    assert message.startswith(f"data.path={token_dir}: ")
    assert fragment in message


def test_an_unreadable_meta_json_is_a_config_error(token_dir, monkeypatch):
    # Root reads through permission bits, so the refusal is simulated where the file is opened.
    real_open = open

    def denied(file, *args, **kwargs):
        if str(file).endswith("meta.json"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(token_files, "open", denied, raising=False)
    assert _refused(_tokens_cfg(token_dir)) == (
        f"data.path={token_dir}: meta.json cannot be read: Permission denied")


def test_a_meta_json_with_a_byte_order_mark_is_read(token_dir):
    meta = (token_dir / "meta.json").read_bytes()
    (token_dir / "meta.json").write_bytes(b"\xef\xbb\xbf" + meta)
    assert str(token_dir) in check_data(_tokens_cfg(token_dir, "train.seq_len=32"))


@pytest.mark.parametrize("key", ["vocab_size", "train_tokens", "val_tokens"])
@pytest.mark.parametrize("value, shown, kind", [
    (True, "True", "a boolean"),
    (1.5, "1.5", "a decimal number"),
    (256.0, "256.0", "a decimal number"),
    ("256", "'256'", "a string"),
    (float("nan"), "nan", "a non-finite number"),
    (float("inf"), "inf", "a non-finite number"),
    (None, "None", "null"),
    ([256], "[256]", "a list"),
])
def test_a_non_integer_count_in_meta_is_refused(token_dir, key, value, shown, kind):
    _edit_meta(token_dir, **{key: value})  # json.dumps writes NaN and Infinity as such
    assert _refused(_tokens_cfg(token_dir)) == (
        f"data.path={token_dir}: meta.json {key}={shown} must be a positive integer, not {kind}")


def test_check_data_error_through_the_cli_is_exit_2(run_main, tmp_path):
    ids = np.full(100, 7)
    ids[50] = 300
    path = _write_token_dir(tmp_path / "tok", ids, np.zeros(50), "uint16", 256)
    run_dir = tmp_path / "run"
    result = run_main("launch", "data=tokens", f"data.path={path}", "train.seq_len=16",
                      "--run-dir", str(run_dir), "--dry-run")
    assert result.code == 2
    assert "Traceback" not in result.stderr
    assert "train.bin holds token id 300 (at index 50)" in one_line(result.stderr)
    assert not run_dir.exists()

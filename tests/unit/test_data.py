"""Data: the global batch of a step depends only on (seed, step); dp ranks and micro-batches slice
it without changing it. Token streams: the stdlib corpus and prepared token dirs, and their
errors."""

import errno
import json
import os

import numpy as np
import pytest
import torch

from partrain.data import prepare as prepare_module
from partrain.data import tokens as tokens_module
from partrain.data.batches import global_batch_rows, rank_micro_batches
from partrain.data.prepare import prepare_token_dir
from partrain.data.tokens import (
    SAMPLE_BLOCK,
    SAMPLE_BLOCKS,
    check_data,
    load_tokens,
    sample_max_token_id,
)
from partrain.errors import ConfigError
from tests.unit.helpers import one_line, quick

SEQ_LEN = 32
GLOBAL = 16


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(123).integers(0, 256, size=5000).astype(np.uint8)


def test_global_batch_rows_deterministic_for_seed_and_step():
    a = global_batch_rows(10_000, 5, 16, 64, seed=1)
    b = global_batch_rows(10_000, 5, 16, 64, seed=1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (16,)


def test_global_batch_rows_differ_across_steps_seeds_and_splits():
    base = global_batch_rows(10_000, 5, 16, 64, seed=1)
    assert not np.array_equal(base, global_batch_rows(10_000, 6, 16, 64, seed=1))
    assert not np.array_equal(base, global_batch_rows(10_000, 5, 16, 64, seed=2))
    assert not np.array_equal(base, global_batch_rows(10_000, 5, 16, 64, seed=1, split="val"))


def test_global_batch_rows_stay_in_bounds():
    n, seq = 300, 100
    starts = np.concatenate([global_batch_rows(n, s, 64, seq, seed=0) for s in range(20)])
    assert starts.min() >= 0
    assert starts.max() + seq + 1 <= n
    # The last possible window is reachable (endpoint inclusive) over many draws.
    assert starts.max() == n - seq - 1
    # Exactly seq_len + 1 tokens: only one window fits.
    assert set(global_batch_rows(seq + 1, 0, 8, seq, seed=0)) == {0}


def _whole(tokens, step, dp, micro_batch_size, seed=0, split="train"):
    """Concatenate every dp rank's micro-batches in (dp rank, micro-batch) order."""
    xs, ys, shapes = [], [], []
    for dp_rank in range(dp):
        micro = rank_micro_batches(tokens, step, global_batch_size=GLOBAL,
                                   micro_batch_size=micro_batch_size, dp=dp, dp_rank=dp_rank,
                                   seq_len=SEQ_LEN, seed=seed, split=split)
        assert len(micro) == GLOBAL // (dp * micro_batch_size)
        for x, y in micro:
            shapes.append(tuple(x.shape))
            xs.append(x)
            ys.append(y)
    assert set(shapes) == {(micro_batch_size, SEQ_LEN)}
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("dp, micro_batch_size", [
    (1, 4), (1, 1), (2, 8), (2, 2), (4, 4), (4, 1), (8, 2), (16, 1),
])
@pytest.mark.parametrize("step", [1, 7])
def test_every_split_sees_the_same_global_batch(tokens, dp, micro_batch_size, step):
    ref_x, ref_y = _whole(tokens, step, dp=1, micro_batch_size=GLOBAL)
    x, y = _whole(tokens, step, dp, micro_batch_size)
    assert torch.equal(x, ref_x)
    assert torch.equal(y, ref_y)


def test_batch_is_the_windows_at_the_drawn_starts(tokens):
    starts = global_batch_rows(len(tokens), 3, GLOBAL, SEQ_LEN, seed=0)
    (x, y), = rank_micro_batches(tokens, 3, global_batch_size=GLOBAL, micro_batch_size=GLOBAL,
                                 dp=1, dp_rank=0, seq_len=SEQ_LEN, seed=0)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    for row, s in enumerate(starts):
        np.testing.assert_array_equal(x[row].numpy(), tokens[s:s + SEQ_LEN])
        np.testing.assert_array_equal(y[row].numpy(), tokens[s + 1:s + SEQ_LEN + 1])


def test_targets_are_inputs_shifted_by_one(tokens):
    for x, y in rank_micro_batches(tokens, 2, global_batch_size=GLOBAL, micro_batch_size=4, dp=2,
                                   dp_rank=1, seq_len=SEQ_LEN, seed=0):
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_dp_ranks_get_disjoint_slices(tokens):
    a = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=8, dp=2,
                           dp_rank=0, seq_len=SEQ_LEN, seed=0)
    b = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=8, dp=2,
                           dp_rank=1, seq_len=SEQ_LEN, seed=0)
    assert not torch.equal(a[0][0], b[0][0])


def test_steps_and_splits_give_different_batches(tokens):
    one, = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1,
                              dp_rank=0, seq_len=SEQ_LEN, seed=0)
    two, = rank_micro_batches(tokens, 2, global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1,
                              dp_rank=0, seq_len=SEQ_LEN, seed=0)
    val, = rank_micro_batches(tokens, 1, global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1,
                              dp_rank=0, seq_len=SEQ_LEN, seed=0, split="val")
    assert not torch.equal(one[0], two[0])
    assert not torch.equal(one[0], val[0])


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
def text_files(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes(("first file, with some text é\n" * 40).encode())
    b.write_bytes(b"second file\x00\xff bytes too\n" * 30)
    return [a, b]


def test_prepare_token_dir_round_trip(tmp_path, text_files):
    out = tmp_path / "tok"
    meta = prepare_token_dir(text_files, out, 0.1)
    stream = b"\n".join(f.read_bytes() for f in text_files)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format"] == "partrain-tokens/1" and meta["vocab_size"] == 256
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
    (lambda p: (p / "val.bin").unlink(), "val.bin is missing"),
    (lambda p: (p / "train.bin").write_bytes((p / "train.bin").read_bytes()[:-1]),
     "train.bin has"),
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


def test_prepare_records_the_max_token_id(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"abc\n" * 100)
    meta = prepare_token_dir([text], tmp_path / "tok", 0.1)
    assert meta["max_token_id"] == ord("c")
    assert json.loads((tmp_path / "tok" / "meta.json").read_text())["max_token_id"] == ord("c")


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
        data = (token_dir / f"{split}.bin").read_bytes()
        (token_dir / f"{split}.bin").write_bytes(data[:len(data) // 2 * 2])
        meta[f"{split}_tokens"] = len(data) // 2
    del meta["max_token_id"]
    meta["dtype"] = "uint16"
    (token_dir / "meta.json").write_text(json.dumps(meta))
    message = _refused(_tokens_cfg(token_dir, "train.seq_len=16"))
    assert f"data.path={token_dir}: train.bin holds token id " in message
    assert "not below meta.json vocab_size=256; every id must be < vocab_size" in message
    assert "is dtype=uint16 right?" in message


def test_a_recorded_max_token_id_is_checked_against_the_ids(token_dir):
    _edit_meta(token_dir, max_token_id=100)  # the text holds 0xff bytes
    message = _refused(_tokens_cfg(token_dir, "train.seq_len=16"))
    assert message.startswith(f"data.path={token_dir}: train.bin holds token id 255 (at index ")
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
    (lambda p: _replace_with_dir(p / "train.bin"), "train.bin is a directory, not a file"),
    (lambda p: _replace_with_fifo(p / "val.bin"),
     "val.bin is not a regular file (a pipe, socket or device)"),
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

    monkeypatch.setattr(tokens_module, "open", denied, raising=False)
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
    (0, "writing train.bin"), (4096, "writing val.bin"), (8192, "writing meta.json"),
], indirect=["full_fs"])
@pytest.mark.parametrize("under", ["tok", "a/b/tok"])
def test_prepare_on_a_full_disk(run_main, full_fs, text_files, step, under):
    # ~2 KB of text: train.bin takes one 4 KiB page of the tmpfs, val.bin another.
    out = full_fs / under
    message = _prepare(run_main, text_files, out)
    assert f"--out {out} cannot be written: No space left on device ({step}); nothing was left behind" in message
    assert list(full_fs.iterdir()) == []  # no .tok.tmp-*, no half-written dir, no a/b


def test_prepare_interrupted_leaves_nothing(tmp_path, text_files, monkeypatch):
    real_open = open

    def interrupted(file, *args, **kwargs):
        if str(file).endswith("val.bin"):
            raise KeyboardInterrupt
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "open", interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        prepare_token_dir(text_files, tmp_path / "new" / "tok", 0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_prepare_creates_missing_parents(tmp_path, text_files):
    out = tmp_path / "a" / "b" / "tok"
    prepare_token_dir(text_files, out, 0.1)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
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
    assert f"input directory {folder} holds no files (hidden ones are skipped)" in message
    assert not (tmp_path / "tok").exists()


def test_prepare_input_that_is_a_pipe(run_main, tmp_path, text_files):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    message = _prepare(run_main, [fifo], tmp_path / "tok")
    assert f"input file {fifo} is not a regular file (a pipe, socket or device)" in message
    assert not (tmp_path / "tok").exists()


def test_prepare_input_that_cannot_be_read(run_main, tmp_path, text_files, monkeypatch):
    real_read_bytes = type(text_files[1]).read_bytes

    def denied(self):
        if self == text_files[1]:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(type(text_files[1]), "read_bytes", denied)
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

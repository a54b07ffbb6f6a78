"""Data: the global batch of a step depends only on (seed, step); dp ranks and micro-batches slice
it without changing it. Token streams: the stdlib corpus and prepared token dirs, and their
errors."""

import json

import numpy as np
import pytest
import torch

from partrain.data import (check_data, global_batch_rows, load_tokens, prepare_token_dir,
                           rank_micro_batches)
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


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
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
    (lambda p: (p / "val.bin").unlink(), "val.bin has no file"),
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
    assert f"the train split has {meta['train_tokens']} tokens" in str(info.value)


# `partrain data prepare` through the CLI (in-process).

def test_cli_data_prepare(run_main, tmp_path, text_files):
    out = tmp_path / "tok"
    result = run_main("data", "prepare", *map(str, text_files), "--out", str(out),
                      "--val-fraction", "0.2")
    assert result.code == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    text = one_line(result.stdout)
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

"""Epochs and blends (partrain/data/sampler.py): every sequence once per epoch, each source within
one sample of its share, and the batch of a step a function of (seed, step) alone: the same
computed fresh (a resume) as in an uninterrupted run, and the same rows for every dp split."""

import json
import shutil

import numpy as np
import pytest
import torch

from partrain.data import sampler as sampler_module
from partrain.data.batches import sampler_micro_batches
from partrain.data.prepare import prepare_token_dir
from partrain.data.sampler import (
    BlendSchedule,
    Mixture,
    RandomWindows,
    build_batches,
    check_sources,
)
from partrain.errors import ConfigError
from tests.unit.helpers import validated, word_tokenizer

SEQ = 8
GLOBAL = 12


def _epochs(tokens, seed=3, global_batch_size=GLOBAL):
    return Mixture([tokens], [1.0], ["data.path=x"], order="epochs", blend=False,
                   global_batch_size=global_batch_size, seq_len=SEQ, seed=seed)


def _blend(streams, weights, order="epochs", seed=0, global_batch_size=6, seq_len=4):
    return Mixture(streams, weights, [f"data.blend[{k}] (d{k})" for k in range(len(streams))],
                   order=order, blend=True, global_batch_size=global_batch_size,
                   seq_len=seq_len, seed=seed)


def _gather(sampler, step, dp, micro):
    """Every dp rank's micro-batches of a step, concatenated in (dp rank, micro-batch) order."""
    xs, ys = [], []
    for rank in range(dp):
        for x, y in sampler_micro_batches(sampler, step, micro_batch_size=micro, dp=dp,
                                          dp_rank=rank):
            assert tuple(x.shape) == (micro, sampler.seq_len)
            xs.append(x)
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


# Epochs of one stream: 30 sequences of 8 (+ 1) tokens; 3 tokens past the last are never read.
TOKENS = np.arange(30 * SEQ + 4, dtype=np.int64)
N = 30


def test_every_sequence_once_per_epoch_over_steps_and_dp_ranks():
    sampler = _epochs(TOKENS)
    ids, orders = [], []
    for step in range(1, 11):  # 120 samples: 4 epochs of 30, steps straddling their ends
        x, y = _gather(sampler, step, dp=2, micro=3)
        first = x[:, 0].numpy()
        assert (first % SEQ == 0).all()
        for row, start in zip(range(len(x)), first):
            assert torch.equal(x[row], torch.arange(start, start + SEQ))
            assert torch.equal(y[row], torch.arange(start + 1, start + SEQ + 1))
        ids += list(first // SEQ)
    for epoch in range(4):
        order = ids[epoch * N:(epoch + 1) * N]
        assert sorted(order) == list(range(N)), f"epoch {epoch + 1}: {order}"
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 4  # shuffled anew each epoch


def test_epoch_metric_and_the_steps_an_epoch_begins():
    sampler = _epochs(TOKENS)
    begun = {step: sampler.epochs_begun(step) for step in range(1, 11)}
    assert {s: lines for s, lines in begun.items() if lines} == {
        3: ["data.path=x: epoch 2 begins at step 3"],  # sample 30 is in step 3 (24..35)
        6: ["data.path=x: epoch 3 begins at step 6"],
        8: ["data.path=x: epoch 4 begins at step 8"]}
    assert sampler.report(1) == {"epoch": 0.4}
    assert sampler.report(5) == {"epoch": 2.0}
    assert sampler.report(6) == {"epoch": 2.4}


@pytest.mark.parametrize("step", [1, 3, 9])
def test_a_fresh_sampler_resumes_exactly_on_any_dp(step):
    ongoing = _epochs(TOKENS)
    for s in range(1, step):
        ongoing.rows(s)
    ref = _gather(ongoing, step, dp=1, micro=GLOBAL)
    for dp, micro in ((1, 12), (1, 4), (2, 6), (2, 3), (4, 3), (4, 1)):
        x, y = _gather(_epochs(TOKENS), step, dp, micro)  # fresh: a resume at `step`
        assert torch.equal(x, ref[0]) and torch.equal(y, ref[1]), (dp, micro)


def test_epochs_depend_on_the_seed():
    a, b = _epochs(TOKENS, seed=1), _epochs(TOKENS, seed=2)
    assert not np.array_equal(a.rows(1)[1], b.rows(1)[1])
    np.testing.assert_array_equal(a.rows(1)[1], _epochs(TOKENS, seed=1).rows(1)[1])


def test_the_random_default_is_the_windows_of_before():
    from partrain.data.batches import rank_micro_batches

    tokens = np.random.default_rng(1).integers(0, 256, size=3000).astype(np.uint8)
    random = RandomWindows(tokens, global_batch_size=GLOBAL, seq_len=SEQ, seed=5, split="train")
    for step in (1, 4):
        x, y = _gather(random, step, dp=2, micro=2)
        before = rank_micro_batches(tokens, step, global_batch_size=GLOBAL, micro_batch_size=2,
                                    dp=2, dp_rank=0, seq_len=SEQ, seed=5)
        before += rank_micro_batches(tokens, step, global_batch_size=GLOBAL, micro_batch_size=2,
                                     dp=2, dp_rank=1, seq_len=SEQ, seed=5)
        assert torch.equal(x, torch.cat([b[0] for b in before]))
        assert torch.equal(y, torch.cat([b[1] for b in before]))
    assert random.report(1) == {} and random.epochs_begun(1) == []


# Blends.

WEIGHTS = [(0.5, 0.3, 0.2), (0.7, 0.3), (1.0, 1.0, 1.0), (3.0, 0.001, 1.5),
           (0.1234567, 0.3, 0.6)]  # the last: period 10,234,567, walked rather than tabled


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_each_source_is_within_one_sample_of_its_share_for_every_prefix(weights):
    batch, steps = 8, 2000
    schedule = BlendSchedule(weights)
    assert schedule.periodic == (weights != WEIGHTS[-1])
    src = np.concatenate([schedule.lookup((s - 1) * batch, batch)[0]
                          for s in range(1, steps + 1)])
    share = np.asarray(weights) / sum(weights)
    counts = np.cumsum(src[:, None] == np.arange(len(weights)), axis=0)
    n = np.arange(1, len(src) + 1)[:, None]
    gap = np.abs(counts - share * n)
    assert gap.max() < 1, f"{gap.max()} at sample {gap.max(axis=1).argmax()}"


@pytest.mark.parametrize("weights", WEIGHTS[:4], ids=str)
def test_the_period_table_is_the_walk(weights, monkeypatch):
    tabled = BlendSchedule(weights)
    monkeypatch.setattr(sampler_module, "MAX_PERIOD", 0)
    walked = BlendSchedule(weights)
    assert not walked.periodic
    for g0, n in ((0, 50), (50, 37), (1000, 64), (10, 5), (123_457, 300)):  # back: a new walk
        for a, b in zip(tabled.lookup(g0, n), walked.lookup(g0, n)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("weights", [(2.0,), (0.7, 0.3), (0.5, 0.3, 0.2), (1.0, 1.0, 1.0),
                                     (0.1234567, 0.3, 0.6)], ids=str)
def test_the_three_source_walk_is_the_general_one(weights):
    fast, general = BlendSchedule(weights), BlendSchedule(weights)
    for schedule in (fast, general):
        schedule._restart()
    for n in (1, 999, 5000):
        assert fast._walk3(n, record=True) == general._walk_any(n, record=True)
        assert (fast.D, fast.counts, fast.at) == (general.D, general.counts, general.at)


def test_a_sources_samples_are_numbered_in_order_and_counted():
    schedule = BlendSchedule((0.5, 0.3, 0.2))
    src, idx, counts = schedule.lookup(0, 1000)
    for k in range(3):
        np.testing.assert_array_equal(idx[src == k], np.arange((src == k).sum()))
    np.testing.assert_array_equal(counts, np.bincount(src, minlength=3))
    assert list(counts) == [500, 300, 200]
    assert list(src[:10]) == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]  # the period of (5, 3, 2)


# Three sources of 5, 7 and 11 sequences; each token says its source (thousands) and offset.
LENGTHS = (5, 7, 11)
STREAMS = [np.arange(n * 4 + 1, dtype=np.int64) + 1000 * k for k, n in enumerate(LENGTHS)]


def _per_source(sampler, steps, dp=1, micro=6):
    """Each source's sequence ids, in the global order of the samples."""
    seen = {k: [] for k in range(len(LENGTHS))}
    for step in range(1, steps + 1):
        x, _ = _gather(sampler, step, dp, micro)
        for first in x[:, 0].tolist():
            source, offset = divmod(first, 1000)
            assert offset % 4 == 0
            seen[source].append(offset // 4)
    return seen


def test_each_source_reads_its_own_epochs():
    sampler = _blend(STREAMS, (0.5, 0.3, 0.2))
    seen = _per_source(sampler, steps=40)  # 240 samples: 120, 72, 48
    assert [len(v) for v in seen.values()] == [120, 72, 48]
    for k, ids in seen.items():
        n = LENGTHS[k]
        for e in range(len(ids) // n):
            assert sorted(ids[e * n:(e + 1) * n]) == list(range(n)), (k, e)
    assert sampler.report(40) == {"epoch": [24.0, round(72 / 7, 6), round(48 / 11, 6)]}


def test_a_sources_next_epoch_is_logged_at_its_step():
    sampler = _blend(STREAMS, (0.5, 0.3, 0.2))
    src, idx, _ = BlendSchedule((0.5, 0.3, 0.2)).lookup(0, 6 * 20)
    expected = sorted(
        (int(g) // 6 + 1, f"data.blend[{k}] (d{k}): epoch {int(i) // LENGTHS[k] + 1} begins at "
                          f"step {int(g) // 6 + 1}")
        for g, (k, i) in enumerate(zip(src, idx)) if i and i % LENGTHS[k] == 0)
    got = sorted((step, line) for step in range(1, 21) for line in sampler.epochs_begun(step))
    assert got == expected and len(got) > 10


@pytest.mark.parametrize("order", ["epochs", "random"])
def test_a_blend_resumes_exactly_on_any_dp(order):
    ongoing = _blend(STREAMS, (0.5, 0.3, 0.2), order=order)
    for step in range(1, 33):
        ongoing.rows(step)
    ref = _gather(ongoing, 33, dp=1, micro=6)
    for dp, micro in ((1, 3), (2, 3), (2, 1), (3, 2), (6, 1)):
        fresh = _blend(STREAMS, (0.5, 0.3, 0.2), order=order)
        x, y = _gather(fresh, 33, dp, micro)
        assert torch.equal(x, ref[0]) and torch.equal(y, ref[1]), (dp, micro)


def test_random_order_stays_in_each_source():
    sampler = _blend(STREAMS, (0.5, 0.3, 0.2), order="random")
    for step in range(1, 30):
        src, starts = sampler.rows(step)
        for k, s in zip(src, starts):
            assert 0 <= s <= len(STREAMS[k]) - 5
        assert sampler.epochs_begun(step) == []


# Token dirs: validation, the data check, and the samplers a worker builds.

def _token_dir(tmp_path, name, text):
    source = tmp_path / f"{name}.txt"
    source.write_text(text)
    out = tmp_path / name
    prepare_token_dir([source], out, 0.5, workers=1)
    return out


@pytest.fixture
def dirs(tmp_path):
    a = _token_dir(tmp_path, "a", "the quick brown fox jumps over the lazy dog. " * 20)
    b = _token_dir(tmp_path, "b", "def main():\n    return 42\n" * 40)
    return a, b


def _config(*blend, more=()):
    entries = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in blend)
    cfg, _, _ = validated(f"data.blend=[{entries}]", "train.seq_len=32", *more)
    return cfg


def test_a_blend_reads_token_dirs_and_passes_the_data_check(dirs):
    cfg = _config((dirs[0], 0.7), (dirs[1], 0.3), more=["data.sampling=epochs"])
    assert cfg.data.source == "tokens" and cfg.data.path is None
    assert check_sources(cfg) == f"a blend of 2 token dirs ({dirs[0]} 70.0%, {dirs[1]} 30.0%)"
    batches = build_batches(cfg.data, cfg.train)
    assert "a blend of 2 token dirs" in batches.description
    src, _ = batches.train.rows(1)
    assert sorted(set(src.tolist())) == [0, 1]
    val_src, val_starts = batches.val.rows(0)
    again = build_batches(cfg.data, cfg.train).val.rows(0)  # fixed validation batches
    np.testing.assert_array_equal(val_starts, again[1])
    assert abs((val_src == 0).mean() - 0.7) <= 1 / len(val_src)
    x, y = _gather(batches.train, 2, dp=2, micro=cfg.train.global_batch_size // 2)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_a_missing_source_is_named(dirs, tmp_path):
    cfg = _config((dirs[0], 1), (tmp_path / "nowhere", 1))
    with pytest.raises(ConfigError) as info:
        check_sources(cfg)
    assert f"data.blend[1].path={tmp_path / 'nowhere'} does not exist" in str(info.value)


def test_a_bad_source_is_named_with_the_data_checks_reason(dirs, tmp_path):
    (tmp_path / "notokens").mkdir()
    cfg = _config((dirs[0], 1), (tmp_path / "notokens", 1))
    with pytest.raises(ConfigError) as info:
        check_sources(cfg)
    assert str(info.value).startswith("data.blend[1]: ") and "meta.json" in str(info.value)


def _retokenize(path, name, file_text=None):
    meta = json.loads((path / "meta.json").read_text())
    meta["tokenizer"] = name
    (path / "meta.json").write_text(json.dumps(meta))
    if file_text is not None:
        (path / "tokenizer.json").write_text(file_text)


def test_sources_of_two_tokenizers_are_refused_naming_both(dirs, tmp_path):
    other = tmp_path / "c"
    shutil.copytree(dirs[1], other)
    _retokenize(other, "llama3-bpe")
    cfg = _config((dirs[0], 1), (other, 1))
    with pytest.raises(ConfigError) as info:
        check_sources(cfg)
    message = str(info.value)
    for fragment in (f"data.blend[0] ({dirs[0]})", "with bytes", f"data.blend[1] ({other})",
                     "with llama3-bpe", "one tokenizer"):
        assert fragment in message, message


def test_two_different_tokenizer_files_are_two_tokenizers(dirs, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(dirs[0], one)
    shutil.copytree(dirs[1], two)
    _retokenize(one, "tokenizer.json", word_tokenizer(100, prefix="one"))
    _retokenize(two, "tokenizer.json", word_tokenizer(100, prefix="two"))
    with pytest.raises(ConfigError) as info:
        check_sources(_config((one, 1), (two, 1)))
    assert str(info.value).count("tokenizer.json (sha256 ") == 2
    _retokenize(two, "tokenizer.json", word_tokenizer(100, prefix="one"))
    check_sources(_config((one, 1), (two, 1)))


def _word_dir(tmp_path, name, tokenizer, *options):
    """A token dir of word ids made with `tokenizer` (a tokenizer.json) and prepare's options."""
    source = tmp_path / f"{name}.txt"
    source.write_text(" ".join(f"w{i % 90}" for i in range(400)))
    out = tmp_path / name
    prepare_token_dir([source], out, 0.5, tokenizer=tokenizer, workers=1, **dict(options))
    return out


def test_one_tokenizer_file_with_two_end_of_text_tokens_is_refused_naming_both(tmp_path):
    # Only tokenizer.json's digest was compared: a blend whose sources end documents with
    # different ids passed, and the model learned two separators.
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(word_tokenizer(100))
    plain = _word_dir(tmp_path, "plain", tokenizer)
    other = _word_dir(tmp_path, "other", tokenizer, ("eot", "w99"))
    more = ["model.vocab_size=128"]
    with pytest.raises(ConfigError) as info:
        check_sources(_config((plain, 1), (other, 1), more=more))
    message = str(info.value)
    for fragment in (f"data.blend[0] ({plain})", "'<|endoftext|>' (id 100)",
                     f"data.blend[1] ({other})", "'w99' (id 99)", "--eot '<|endoftext|>'"):
        assert fragment in message, message
    same = _word_dir(tmp_path, "same", tokenizer, ("eot", "<|endoftext|>"))
    assert check_sources(_config((plain, 1), (same, 1), more=more)).startswith("a blend of 2")


def test_one_tokenizer_file_with_two_vocab_sizes_is_refused_naming_both(tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(word_tokenizer(100))
    one, two = _word_dir(tmp_path, "one", tokenizer), _word_dir(tmp_path, "two", tokenizer)
    meta = json.loads((two / "meta.json").read_text())
    meta["vocab_size"] = 120  # as a prepare that sized it otherwise wrote it
    (two / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as info:
        check_sources(_config((one, 1), (two, 1), more=["model.vocab_size=128"]))
    message = str(info.value)
    for fragment in (f"data.blend[0] ({one}) has meta.json vocab_size=101",
                     f"data.blend[1] ({two}) vocab_size=120"):
        assert fragment in message, message


@pytest.mark.parametrize("blend, fragments", [
    ("[]", ["data.blend=[]", "names no source"]),
    ("[{path: /a, weight: 0}]", ["data.blend[0].weight=0.0", "positive finite"]),
    ("[{path: /a, weight: 1}, {path: /b, weight: -2}]", ["data.blend[1].weight=-2.0"]),
    ("[{path: /a, weight: .inf}]", ["data.blend[0].weight=inf"]),
    ("[{path: /a, weight: .nan}]", ["data.blend[0].weight=nan"]),
    ("[{weight: 1}]", ["data.blend[0].path=null", "names no token dir"]),
    ("[{path: /a, weight: 1e308}, {path: /b, weight: 1e308}]", ["sum to infinity"]),
])
def test_a_bad_blend_is_refused_naming_the_key_and_rule(blend, fragments):
    with pytest.raises(ConfigError) as info:
        validated(f"data.blend={blend}")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_blend_and_a_data_path_are_refused_together():
    with pytest.raises(ConfigError) as info:
        validated("data.path=/x", "data.blend=[{path: /y, weight: 1}]")
    assert "data.path=/x and data.blend both name the training data" in str(info.value)
    cfg, _, _ = validated("data.blend=[{path: /y}]")  # weight 1 by default
    assert cfg.data.blend[0].weight == 1.0


def test_an_unknown_sampling_is_refused():
    with pytest.raises(ConfigError) as info:
        validated("data.sampling=shuffle")
    assert "data.sampling=shuffle is not one of: random, epochs" in str(info.value)


def test_hydra_reads_a_blend_override_as_written():
    from tests.unit.helpers import compose

    cfg = compose("data.blend=[{path: /data/web-1, weight: 0.7}, {path: /data/code}]",
                  "data.sampling=epochs")
    assert [(e.path, e.weight) for e in cfg.data.blend] == [("/data/web-1", 0.7),
                                                            ("/data/code", 1.0)]
    with pytest.raises(ConfigError) as info:
        compose("data.blend=[{pth: /data/web}]")
    assert "pth" in str(info.value)


def test_the_step_line_shows_the_epoch():
    from partrain.observe.metrics import format_step

    rec = {"step": 5, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0,
           "step_time_s": 0.1}
    assert "epoch" not in format_step(rec)
    assert "  epoch 1.37" in format_step({**rec, "epoch": 1.37})
    assert "  epochs 0.52/1.37" in format_step({**rec, "epoch": [0.52, 1.37]})

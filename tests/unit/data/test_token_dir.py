"""The token dir of format 2 (partrain/data/format.py): the document index `data prepare` writes
for every kind of input (Hugging Face datasets saved with save_to_disk among them), shard files
read as one sequence, a val split from its own inputs, a format 1 dir still read, and nothing
left behind by an interrupted prepare. `text_files` is tests/unit/conftest.py's."""

import json
import multiprocessing

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from partrain.data import prepare as prepare_module
from partrain.data import tokenizer as tokenizer_module
from partrain.data.prepare import prepare_token_dir
from partrain.data.tokens import ShardedTokens, check_data, load_tokens
from partrain.errors import ConfigError
from tests.unit.data.corpus import DOCS, train_bpe
from tests.unit.helpers import one_line, quick


def _load(out):
    return load_tokens(quick("data.source=tokens", f"data.path={out}").data)


def _save_to_disk(directory, texts, files=2, order=None):
    """A Dataset directory as `datasets.Dataset.save_to_disk` writes one: Arrow IPC streams of a
    `text` column (and another), dataset_info.json and state.json naming the files in `order`."""
    directory.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    per = -(-len(texts) // files)
    for i, name in enumerate(names):
        part = texts[i * per:(i + 1) * per]
        table = pa.table({"id": list(range(len(part))), "text": pa.array(part, pa.large_string())})
        with ipc.new_stream(str(directory / name), table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
    (directory / "dataset_info.json").write_text(json.dumps(
        {"features": {"id": {"dtype": "int64", "_type": "Value"},
                      "text": {"dtype": "large_string", "_type": "Value"}}}))
    listed = [names[i] for i in (order or range(files))]
    (directory / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": n} for n in listed], "_fingerprint": "f", "_split": None}))
    return [t for i in (order or range(files)) for t in texts[i * per:(i + 1) * per]]


@pytest.fixture
def inputs(tmp_path):
    """Inputs of every kind and the documents they hold, in the order prepare reads them: text
    files (an empty one is no document), JSON Lines (null and "" skipped), a saved dataset whose
    state.json lists its files out of name order (and a cache file it does not list)."""
    root = tmp_path / "in"
    (root / "text").mkdir(parents=True)
    (root / "text" / "a.txt").write_text(DOCS[0])
    (root / "text" / "b.txt").write_text("")
    (root / "text" / "c.txt").write_text(DOCS[1])
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in [DOCS[2], None, "", DOCS[3]]))
    saved = _save_to_disk(root / "hf", DOCS[4:14], order=[1, 0])
    (root / "hf" / "cache-0123.arrow").write_bytes(b"not listed in state.json")
    return [root / "text", jsonl, root / "hf"], [DOCS[0], DOCS[1], DOCS[2], DOCS[3], *saved]


def _split_starts(starts, cut):
    """Document starts of a sequence cut at `cut`: train's, and val's from 0."""
    starts = np.asarray(starts)
    val = starts[starts >= cut] - cut
    return starts[starts < cut], val if len(val) and val[0] == 0 else np.r_[0, val]


def test_the_index_marks_each_document_of_every_kind_of_input_bytes(tmp_path, inputs):
    paths, docs = inputs
    meta = prepare_token_dir(paths, tmp_path / "tok", 0.3)
    raw = [d.encode() for d in docs]
    stream = b"\n".join(raw)
    # Byte tokens: document i starts after the newline that ends document i - 1.
    starts = np.cumsum([0] + [len(r) + 1 for r in raw[:-1]])
    splits = _load(tmp_path / "tok")
    assert np.asarray(splits.train).tobytes() + np.asarray(splits.val).tobytes() == stream
    cut = meta["train_tokens"]
    train, val = _split_starts(starts, cut)
    np.testing.assert_array_equal(splits.train_docs, train)
    np.testing.assert_array_equal(splits.val_docs, val)
    assert splits.train_docs.dtype == np.int64
    assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val))
    assert meta["files"] == 6  # a.txt, b.txt (empty), c.txt, docs.jsonl, two Arrow files
    for i, start in enumerate(train):  # each document's bytes begin where the index says
        assert np.asarray(splits.train[start:start + 8]).tobytes() == raw[i][:8]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_index_marks_each_document_of_every_kind_of_input_tokenizer(tmp_path, inputs, workers):
    paths, docs = inputs
    path = tmp_path / "tokenizer.json"
    tok = train_bpe(path)
    eot = tok.token_to_id("<|endoftext|>")
    meta = prepare_token_dir(paths, tmp_path / "tok", 0.25, tokenizer=path, workers=workers)
    encoded = [tok.encode(d, add_special_tokens=False).ids + [eot] for d in docs]
    starts = np.cumsum([0] + [len(e) for e in encoded[:-1]])
    splits = _load(tmp_path / "tok")
    ids = np.concatenate([np.asarray(splits.train), np.asarray(splits.val)])
    assert ids.tolist() == [i for e in encoded for i in e]
    train, val = _split_starts(starts, meta["train_tokens"])
    np.testing.assert_array_equal(splits.train_docs, train)
    np.testing.assert_array_equal(splits.val_docs, val)
    ends = np.r_[splits.train_docs[1:], len(splits.train)] - 1
    assert (np.asarray(splits.train)[ends[:-1]] == eot).all()  # each document ends with its eot
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("shard_bytes, tokenizer", [(256, False), (101, True), (1 << 30, False)])
def test_shards_read_as_one_sequence(tmp_path, text_files, shard_bytes, tokenizer):
    path = None
    if tokenizer:  # text_files hold bytes that are not UTF-8
        path = tmp_path / "tokenizer.json"
        train_bpe(path)
        text_files = [tmp_path / "one.txt", tmp_path / "two.txt"]
        text_files[0].write_text("".join(DOCS[:30]))
        text_files[1].write_text("".join(DOCS[30:]))
    out = tmp_path / "tok"
    meta = prepare_token_dir(text_files, out, 0.15, tokenizer=path, workers=1,
                             shard_bytes=shard_bytes)
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        sizes = [(out / f"{split}-{i:05d}.bin").stat().st_size
                 for i in range(len(meta[f"{split}_shards"]))]
        assert sizes == [n * itemsize for n in meta[f"{split}_shards"]]
        assert max(sizes) <= shard_bytes and sum(sizes) == meta[f"{split}_tokens"] * itemsize
    assert not (out / f"train-{len(meta['train_shards']):05d}.bin").exists()
    splits = _load(out)
    several = shard_bytes < 1000
    assert (len(meta["train_shards"]) > 3) == several
    for split, tokens in (("train", splits.train), ("val", splits.val)):
        whole = np.concatenate([np.fromfile(out / f"{split}-{i:05d}.bin", dtype=meta["dtype"])
                                for i in range(len(meta[f"{split}_shards"]))])
        n = len(whole)
        assert len(tokens) == n == meta[f"{split}_tokens"]
        assert isinstance(tokens, ShardedTokens) == (len(meta[f"{split}_shards"]) > 1)
        assert tokens.dtype == np.dtype(meta["dtype"])
        np.testing.assert_array_equal(np.asarray(tokens), whole)
        bounds = np.cumsum(meta[f"{split}_shards"])
        for a in sorted({0, 1, *(bounds - 1).tolist(), *(bounds - 3).tolist(), n // 2}):
            for b in (a + 1, a + 2, a + 5, a + 300, n):
                got = tokens[a:b]
                assert isinstance(got, np.ndarray)
                np.testing.assert_array_equal(got, whole[a:b])
    # The train split's ids and then the val split's are the whole stream, as before shards.
    if not tokenizer:
        stream = b"\n".join(f.read_bytes() for f in text_files)
        assert np.asarray(splits.train).tobytes() + np.asarray(splits.val).tobytes() == stream


def test_sharded_tokens_index_like_an_array():
    whole = np.arange(20, dtype=np.uint16) * 3
    tokens = ShardedTokens([whole[:5], whole[5:7], whole[7:8], whole[8:]])
    assert len(tokens) == 20 and tokens.shape == (20,) and tokens.ndim == 1
    for a in range(-22, 23):
        for b in range(-22, 23):
            for step in (None, 1, 2, -1, -3):
                np.testing.assert_array_equal(tokens[a:b:step], whole[a:b:step])
    for i in range(-20, 20):
        assert tokens[i] == whole[i] and tokens[np.int64(i)] == whole[i]
    picks = np.array([19, 0, 5, 6, 7, -1, 4])
    np.testing.assert_array_equal(tokens[picks], whole[picks])
    for bad in (20, -21):
        with pytest.raises(IndexError):
            tokens[bad]
    np.testing.assert_array_equal(np.asarray(tokens, dtype=np.int64), whole.astype(np.int64))


def _write_v1(path, train, val, dtype="uint16", **extra):
    """A format 1 token dir, as partrain wrote them before format 2: train.bin, val.bin."""
    path.mkdir()
    np.asarray(train, dtype=dtype).tofile(path / "train.bin")
    np.asarray(val, dtype=dtype).tofile(path / "val.bin")
    meta = {"format": "partrain-tokens/1", "tokenizer": "bytes", "dtype": dtype,
            "vocab_size": 300, "train_tokens": len(train), "val_tokens": len(val), **extra}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_a_format_1_dir_still_loads_its_documents_from_the_eot_id(tmp_path):
    train = [5, 1, 2, 0, 3, 0, 0, 4, 4, 7]
    path = _write_v1(tmp_path / "eot", train, [1, 0, 2, 0], tokenizer="tokenizer.json", eot_id=0)
    (path / "tokenizer.json").write_text("{}")
    splits = _load(path)
    np.testing.assert_array_equal(splits.train, train)
    np.testing.assert_array_equal(splits.train_docs, [0, 4, 6, 7])
    np.testing.assert_array_equal(splits.val_docs, [0, 2])  # none after the last id
    assert splits.train_docs.dtype == np.int64
    # Without an eot_id (bytes, joined by newlines) each split is one document.
    plain = _load(_write_v1(tmp_path / "bytes", train, [1, 2], dtype="uint8", vocab_size=256))
    np.testing.assert_array_equal(plain.train_docs, [0])
    np.testing.assert_array_equal(plain.val_docs, [0])
    assert "bytes" in check_data(quick("data.source=tokens", f"data.path={tmp_path / 'bytes'}",
                                       "train.seq_len=1"))


def test_the_stdlib_corpus_has_a_document_per_file():
    splits = load_tokens(quick("data.stdlib_max_bytes=400000").data)
    for tokens, docs in ((splits.train, splits.train_docs), (splits.val, splits.val_docs)):
        assert docs[0] == 0 and (np.diff(docs) > 0).all() and docs[-1] < len(tokens)
        assert (tokens[docs[1:] - 1] == ord("\n")).all()
    assert len(splits.train_docs) > 10


def test_val_from_its_own_inputs(tmp_path, text_files):
    a, b = text_files
    meta = prepare_token_dir([a], tmp_path / "tok", val_inputs=[b], shard_bytes=500)
    splits = _load(tmp_path / "tok")
    assert np.asarray(splits.train).tobytes() == a.read_bytes()
    assert np.asarray(splits.val).tobytes() == b.read_bytes()
    np.testing.assert_array_equal(splits.train_docs, [0])
    np.testing.assert_array_equal(splits.val_docs, [0])
    assert meta["val_sources"] == [str(b)] and "val_fraction" not in meta
    assert meta["files"] == 2 and len(meta["train_shards"]) == 3


def test_val_with_a_val_fraction_is_refused(tmp_path, text_files):
    with pytest.raises(ConfigError) as info:
        prepare_token_dir(text_files[:1], tmp_path / "tok", 0.1, val_inputs=text_files[1:])
    assert str(info.value) == (
        "--val-fraction=0.1 and --val: the val split is made either from the --val inputs or "
        "from a fraction of the inputs; give one of the two")
    assert not (tmp_path / "tok").exists()
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"^the --val input files hold 1 bytes; the val split "
                       "needs at least 2$"):
        prepare_token_dir(text_files, tmp_path / "tok", val_inputs=[tiny])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "tiny.txt"]


def test_val_through_the_cli(run_main, tmp_path, text_files):
    a, b = map(str, text_files)
    c = tmp_path / "c.txt"
    c.write_bytes(text_files[0].read_bytes())  # the same text as a, another file
    result = run_main("data", "prepare", a, "--val", b, "--val", str(c), "--out",
                      str(tmp_path / "tok"))
    assert result.code == 0, result.stderr
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["val_sources"] == [b, str(c)]
    assert meta["val_tokens"] == len(text_files[1].read_bytes()) + 1 + len(c.read_bytes())
    refused = run_main("data", "prepare", a, "--val", b, "--val-fraction", "0.05",
                       "--out", str(tmp_path / "other"))
    assert refused.code == 2 and "Traceback" not in refused.stderr
    assert "--val-fraction=0.05 and --val: the val split is made either from the --val inputs" \
        in one_line(refused.stderr)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("workers, error", [(1, KeyboardInterrupt), (2, RuntimeError)])
def test_a_prepare_interrupted_in_the_encoder_leaves_nothing(tmp_path, monkeypatch, workers, error):
    path = tmp_path / "tokenizer.json"
    train_bpe(path)
    texts = [tmp_path / f"t{k}.jsonl" for k in range(3)]
    for text in texts:
        text.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    real, calls = tokenizer_module.encode, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise error("stopped")
        return real(*args)

    monkeypatch.setattr(tokenizer_module, "encode", failing)
    monkeypatch.setattr(prepare_module, "CHUNK_CHARS", 100)  # a task per document or two
    with pytest.raises(error):
        prepare_token_dir(texts, tmp_path / "new" / "tok", 0.1, tokenizer=path,
                          workers=workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["t0.jsonl", "t1.jsonl", "t2.jsonl", "tokenizer.json"]
    assert not multiprocessing.active_children()


def test_arrow_inputs_and_their_refusals(tmp_path):
    # An Arrow file in the IPC file format (as pyarrow's new_file writes) reads as well.
    table = pa.table({"body": ["one", None, "two"], "n": [1, 2, 3]})
    single = tmp_path / "table.arrow"
    with ipc.new_file(str(single), table.schema) as writer:
        writer.write_table(table)
    val = tmp_path / "val.arrow"
    val.write_bytes(single.read_bytes())
    prepare_token_dir([single], tmp_path / "tok", field="body", val_inputs=[val])
    splits = _load(tmp_path / "tok")
    assert np.asarray(splits.train).tobytes() == b"one\ntwo"
    np.testing.assert_array_equal(splits.train_docs, [0, 4])

    def refusal(inputs, **options) -> str:
        with pytest.raises(ConfigError) as info:
            prepare_token_dir(inputs, tmp_path / "out", 0.1, **options)
        assert not (tmp_path / "out").exists()
        return str(info.value)

    assert refusal([single]) == f"input file {single} has no column 'text' (--field); its columns: body, n"
    assert refusal([single], field="n") == f"input file {single}: column 'n' (--field) holds int64, not text"
    fake = tmp_path / "fake.arrow"
    fake.write_text("not arrow")
    assert refusal([fake]).startswith(f"input file {fake} is not an Arrow stream or file (")
    # A DatasetDict: which split is which is the user's to say.
    dd = tmp_path / "dd"
    _save_to_disk(dd / "train", DOCS[:4])
    _save_to_disk(dd / "test", DOCS[4:8])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert refusal([dd]) == (f"input directory {dd} is a Hugging Face DatasetDict (splits: train, "
                             f"test); give the directory of a split, e.g. {dd / 'train'} --val "
                             f"{dd / 'test'}")
    assert refusal([tmp_path]).startswith(f"input directory {dd} is a Hugging Face DatasetDict")
    prepare_token_dir([dd / "train"], tmp_path / "dd-tok", val_inputs=[dd / "test"])
    splits = _load(tmp_path / "dd-tok")
    assert np.asarray(splits.val).tobytes() == "\n".join(DOCS[4:8]).encode()
    assert len(splits.train_docs) == 4 and len(splits.val_docs) == 4
    broken = tmp_path / "broken"
    _save_to_disk(broken, DOCS[:2])
    (broken / "state.json").write_text(json.dumps({"_data_files": []}))
    assert "names no Arrow files" in refusal([broken])


@pytest.fixture
def token_dir(tmp_path, text_files):
    out = tmp_path / "tok"
    prepare_token_dir(text_files, out, 0.1, shard_bytes=512)
    return out


@pytest.mark.parametrize("index, fragment", [
    (np.array([0, 5, 5, 9]), "train.idx.npy: offset 2 (5) does not come after offset 1 (5)"),
    (np.array([1, 5]), "train.idx.npy: its first offset is 1, not 0"),
    (np.array([0, 10**9]), "train.idx.npy: its last offset 1,000,000,000 is not within"),
    (np.array([0.0, 5.0]), "train.idx.npy holds float64 of shape (2,)"),
    (np.zeros((1, 2), dtype=np.int64), "holds int64 of shape (1, 2)"),
])
def test_a_bad_document_index_is_refused(token_dir, index, fragment):
    np.save(token_dir / "train.idx.npy", index)
    meta = json.loads((token_dir / "meta.json").read_text())
    meta["train_documents"] = len(index)
    (token_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as info:
        _load(token_dir)
    assert str(info.value).startswith(f"data.path={token_dir}: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize("edit, fragment", [
    (lambda m: m.update(train_documents=99), "train.idx.npy holds 2 document offsets, but "
                                             "meta.json train_documents=99"),
    (lambda m: m.update(train_shards=[1, 2]), "meta.json train_shards adds up to 3 ids, but "
                                              "train_tokens="),
    (lambda m: m.update(val_shards="many"), "meta.json val_shards='many' must be a non-empty list"),
    (lambda m: m.update(train_shards=m["train_shards"] + [0]), "must be a non-empty list of "
                                                               "positive integers"),
    (lambda m: m.update(train_shards=[m["train_tokens"]]), "train-00000.bin has 512 bytes, but "
                                                           "meta.json says"),
])
def test_a_meta_json_that_does_not_match_the_shards_is_refused(token_dir, edit, fragment):
    meta = json.loads((token_dir / "meta.json").read_text())
    edit(meta)
    (token_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as info:
        _load(token_dir)
    assert fragment in str(info.value)


def test_an_id_past_the_vocabulary_names_its_shard(token_dir):
    meta = json.loads((token_dir / "meta.json").read_text())
    del meta["max_token_id"]
    meta["vocab_size"] = 200  # the text holds bytes up to 255
    (token_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"train-0000\d\.bin holds token id 2\d\d \(at index \d+"):
        _load(token_dir)


def test_a_file_of_a_token_dir_or_a_saved_dataset_as_data_path(tmp_path, token_dir):
    for name in ("train-00001.bin", "val.idx.npy"):
        with pytest.raises(ConfigError, match="is a file of a token dir; give the directory"):
            check_data(quick("data.source=tokens", f"data.path={token_dir / name}"))
    saved = tmp_path / "saved"
    _save_to_disk(saved, DOCS[:2])
    with pytest.raises(ConfigError) as info:
        check_data(quick("data.source=tokens", f"data.path={saved}"))
    assert "is a Hugging Face dataset (save_to_disk), not a token dir" in str(info.value)
    assert "partrain data prepare" in str(info.value)

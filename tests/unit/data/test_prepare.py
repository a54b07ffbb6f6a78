"""`partrain data prepare --tokenizer`: a BPE tokenizer trained here with the `tokenizers` library,
inputs in every kind (text files, a directory tree, JSON Lines, Parquet written with pyarrow), the
ids checked against the tokenizer's own encoding of each document, and the refusals. Large
files read in pieces are test_prepare_pieces.py's."""

import json
import multiprocessing

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from partrain.data.format import vocab_to_use
from partrain.data.prepare import prepare_token_dir
from partrain.data.tokens import check_data, load_tokens
from partrain.errors import ConfigError
from tests.unit.data.corpus import DOCS, read_ids, refusal, train_bpe
from tests.unit.helpers import one_line, quick

@pytest.mark.parametrize("workers", [1, 2])
def test_every_kind_of_input_is_tokenized_in_order(tmp_path, bpe, corpus, workers):
    path, tok = bpe
    inputs, docs = corpus
    meta = prepare_token_dir(inputs, tmp_path / "tok", 0.1, tokenizer=path, workers=workers)
    eot = tok.token_to_id("<|endoftext|>")
    expected = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eot]]
    meta, ids = read_ids(tmp_path / "tok")
    assert ids.tolist() == expected
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size() == 300
    assert (meta["eot_token"], meta["eot_id"], meta["files"]) == ("<|endoftext|>", eot, 5)
    assert meta["max_token_id"] == max(expected)
    assert meta["text_bytes"] == sum(len(d.encode()) for d in docs)
    assert meta["train_tokens"] == int(len(expected) * 0.9)
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == path.read_bytes()
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>"
    assert not multiprocessing.active_children()  # the pool is gone


def test_a_big_vocabulary_is_stored_as_uint32_and_the_model_must_cover_it(tmp_path, corpus):
    path = tmp_path / "big.json"
    tok = train_bpe(path, extra=[f"<extra_{i}>" for i in range(70_000)])
    inputs, docs = corpus
    prepare_token_dir(inputs[:1], tmp_path / "tok", 0.5, tokenizer=path, workers=1)
    meta, ids = read_ids(tmp_path / "tok")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == tok.get_vocab_size() > 65536
    cfg = quick("data.source=tokens", f"data.path={tmp_path / 'tok'}", "train.seq_len=8", "parallel.tp=2")
    with pytest.raises(ConfigError) as info:
        check_data(cfg)
    # 70,300 rounded up to a multiple of 128 * tp = 256.
    assert f"use model.vocab_size={vocab_to_use(meta['vocab_size'], 2)}" in str(info.value)
    assert vocab_to_use(70_300, 2) == 70_400 and vocab_to_use(70_300, 1) == 70_400
    assert vocab_to_use(256, 1) == 256 and vocab_to_use(300, 4) == 512
    cfg.model.vocab_size = vocab_to_use(meta["vocab_size"], 2)
    assert "tokenizer.json" in check_data(cfg)
    assert load_tokens(cfg.data).train.dtype == np.uint32


def test_a_vocabulary_with_a_gap_is_sized_by_its_highest_id(tmp_path):
    # 1,000 words and <|endoftext|> at id 70000: 1,001 tokens, but ids up to 70000. Sized by the
    # count, the dir was uint16 and the end-of-text id wrapped to 4464 (numpy 1) or raised a
    # bare OverflowError (numpy 2).
    vocab = {f"w{i}": i for i in range(1000)} | {"<|endoftext|>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert tok.get_vocab_size(with_added_tokens=True) == 1001
    (tmp_path / "a.txt").write_text("w1 w2 w3 " * 40)
    (tmp_path / "b.txt").write_text("w4 w5 " * 40)
    meta = prepare_token_dir([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "tok", 0.5,
                             tokenizer=path, workers=1)
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_001, 70_000)
    _, ids = read_ids(tmp_path / "tok")
    assert ids.tolist() == [1, 2, 3] * 40 + [70_000] + [4, 5] * 40 + [70_000]
    assert meta["max_token_id"] == 70_000
    cfg = quick("data.source=tokens", f"data.path={tmp_path / 'tok'}", "train.seq_len=8",
                f"model.vocab_size={vocab_to_use(70_001)}")
    assert "tokenizer.json" in check_data(cfg)
    # sample draws from the logits of ids below the tokenizer's vocab_size: the end-of-text too.
    from partrain.data.tokenizer import TextTokenizer
    assert TextTokenizer(tmp_path / "tok").vocab_size == 70_001


def test_an_id_too_big_for_the_dtype_is_refused_not_wrapped():
    from partrain.data.tokenizer import encode

    vocab = {"a": 0, "b": 1, "<|endoftext|>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    ids, sizes = encode(tok, 70_000, "uint32", ["a b", "b"])
    assert ids.tolist() == [0, 1, 70_000, 1, 70_000] and sizes.tolist() == [3, 2]
    with pytest.raises(ConfigError, match="id 70000.*dtype=uint16"):
        encode(tok, 70_000, "uint16", ["a b"])


@pytest.mark.parametrize("workers", [1, 2])
def test_end_of_text_in_a_documents_text_is_text(tmp_path, bpe, workers):
    # The separator's text inside a document got the separator's id: two documents in the
    # token stream where the document index has one, and masking let them attend across it.
    path, tok = bpe
    eot = tok.token_to_id("<|endoftext|>")
    docs = [f"{d.strip()} <|endoftext|> and on\n" if i % 3 == 0 else d
            for i, d in enumerate(DOCS)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "val.txt").write_text("val text <|endoftext|> still val\n")
    prepare_token_dir([jsonl], tmp_path / "tok", tokenizer=path, workers=workers,
                      val_inputs=[tmp_path / "val.txt"])
    meta, ids = read_ids(tmp_path / "tok")
    train = ids[:meta["train_tokens"]]
    assert (train == eot).sum() == len(docs) == meta["train_documents"]
    assert (ids[meta["train_tokens"]:] == eot).sum() == 1 == meta["val_documents"]
    starts = np.load(tmp_path / "tok" / "train.idx.npy")
    assert starts[0] == 0 and (train[starts[1:] - 1] == eot).all()  # a start after each separator
    assert train[-1] == eot


def test_the_cli_prints_throughput_and_the_vocab_to_use(run_main, tmp_path, bpe, corpus):
    path, _ = bpe
    out = tmp_path / "tok"
    result = run_main("data", "prepare", *map(str, corpus[0]), "--tokenizer", str(path.parent),
                      "--out", str(out), "--workers", "2")
    assert result.code == 0, result.stderr
    text = one_line(result.stdout)
    assert "from 5 file(s)" in text and "MB/s" in text and "tokens/s" in text
    assert "2 worker process(es)" in text
    assert f"data.path={out} model.vocab_size=384" in text


def test_eot_comes_from_the_flag_then_the_tokenizer_config(tmp_path, bpe, corpus):
    path, tok = bpe
    text = corpus[0][:1]
    flag, configured = tok.id_to_token(100), tok.id_to_token(101)  # two merges of the vocabulary
    prepare_token_dir(text, tmp_path / "flag", 0.5, tokenizer=path, eot=flag, workers=1)
    meta, ids = read_ids(tmp_path / "flag")
    assert (meta["eot_token"], meta["eot_id"], ids[-1]) == (flag, 100, 100)
    own = tmp_path / "own"
    own.mkdir()
    (own / "tokenizer.json").write_bytes(path.read_bytes())
    (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": configured},
                                                            "chat_template": "kept"}))
    prepare_token_dir(text, tmp_path / "cfg", 0.5, tokenizer=own, workers=1)
    meta, ids = read_ids(tmp_path / "cfg")
    assert (meta["eot_token"], ids[-1]) == (configured, 101)
    # The source's own tokenizer_config.json travels with the tokenizer.
    assert json.loads((tmp_path / "cfg" / "tokenizer_config.json").read_text())["chat_template"] == "kept"


def test_refusals_name_the_input_and_the_rule(tmp_path, bpe):
    path, _ = bpe
    good = tmp_path / "good.txt"
    good.write_text(DOCS[0] * 10)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    assert refusal(tmp_path, [good, latin], tokenizer=path) == (
        f"input file {latin} is not UTF-8 text (byte 0xe9 at offset 3); the tokenizer reads text")
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": "a"}\n{"text": 5}\n')
    assert refusal(tmp_path, [numbers]).startswith(
        f"input file {numbers} is not JSON Lines with a string field 'text' in every object (")
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "a"}\n')
    assert refusal(tmp_path, [other], tokenizer=path) == (
        f"input file {other} holds no text in field 'text' (--field names the field of each "
        "record that holds the document)")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), table)
    assert refusal(tmp_path, [table], tokenizer=path) == (
        f"input file {table} has no column 'text' (--field); its columns: body, n")
    assert refusal(tmp_path, [table], field="n") == (
        f"input file {table}: column 'n' (--field) holds int64, not text")
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    assert refusal(tmp_path, [fake]).startswith(f"input file {fake} is not a Parquet file (")
    assert refusal(tmp_path, [good], tokenizer=tmp_path / "none.json") == (
        f"--tokenizer {tmp_path / 'none.json'} does not exist")
    assert refusal(tmp_path, [good], tokenizer=tmp_path) == (
        f"--tokenizer {tmp_path}: the directory holds no tokenizer.json")
    assert refusal(tmp_path, [good], tokenizer=good).startswith(
        f"--tokenizer {good} is not a tokenizer.json the tokenizers library reads (")
    assert refusal(tmp_path, [good], tokenizer=path, eot="<|nope|>") == (
        f"--eot '<|nope|>' is not a token of --tokenizer {path}")
    assert refusal(tmp_path, [good], eot="x").startswith("--eot 'x' needs --tokenizer")
    assert refusal(tmp_path, [good], tokenizer=path, workers=0) == "--workers=0 must be at least 1"


def test_a_tokenizer_without_an_end_of_text_token_is_refused(tmp_path):
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "wl.json"))
    text = tmp_path / "a.txt"
    text.write_text("a a a a")
    assert "no end-of-text token found" in refusal(tmp_path, [text], tokenizer=tmp_path / "wl.json")
    assert "--eot TOKEN" in refusal(tmp_path, [text], tokenizer=tmp_path / "wl.json")


def test_a_failure_with_workers_running_leaves_nothing(tmp_path, bpe):
    """The bad file comes after enough text for the pool to have started and written."""
    path, _ = bpe
    big, more = tmp_path / "big.txt", tmp_path / "more.txt"
    big.write_text("".join(DOCS) * 800)  # > 2 chunks of 1 MiB
    more.write_text("".join(DOCS) * 800)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff")
    assert "is not UTF-8 text" in refusal(tmp_path, [big, more, bad], tokenizer=path, workers=2)
    assert not multiprocessing.active_children()


def test_bytes_read_directories_and_records_too(tmp_path, corpus):
    inputs, docs = corpus
    prepare_token_dir(inputs, tmp_path / "tok", 0.1)
    meta, ids = read_ids(tmp_path / "tok")
    assert bytes(ids.astype(np.uint8)) == "\n".join(docs).encode()
    assert (meta["tokenizer"], meta["dtype"], meta["files"]) == ("bytes", "uint8", 5)


# The run's tokenizer: a launch copies it into RUN_DIR/tokenizer/ (tests/integration/test_launch.py
# checks that); sample encodes and decodes with it, export hands it to transformers.

@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, bpe):
    """A run dir as a launch on a `--tokenizer` token dir leaves it: its tokenizer files and one
    committed checkpoint of a small model whose vocabulary is the tokenizer's, padded to 384."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from partrain.checkpoint import store
    from partrain.checkpoint.state import build_state
    from partrain.config.schema import Config
    from partrain.data.tokenizer import RUN_TOKENIZER, write_files
    from partrain.models.llama import build_model

    path, _ = bpe
    run_dir = tmp_path_factory.mktemp("bpe-run") / "run"
    (run_dir / RUN_TOKENIZER).mkdir(parents=True)
    write_files(path, "<|endoftext|>", run_dir / RUN_TOKENIZER)
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len, cfg.model.vocab_size = 2, 64, vocab_to_use(300)
    model = build_model(cfg.model, seed=3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.2)
    root = run_dir / store.CHECKPOINTS
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(build_state(model, torch.optim.AdamW(model.parameters()), None, zero=False),
                 checkpoint_id=store.tmp_dir(root, 3))
    store.commit(root, 3, {"reason": "test"}, OmegaConf.to_yaml(cfg))
    return run_dir, model.eval()


def test_sample_encodes_and_decodes_with_the_runs_tokenizer(run_main, bpe, bpe_run):
    import torch

    (_, tok), (run_dir, model) = bpe, bpe_run
    prompt = "the quick brown"
    res = run_main("sample", str(run_dir), "--prompt", prompt, "--temperature", "0",
                   "--max-new-tokens", "20")
    assert res.code == 0, res.stderr
    ids, eot = tok.encode(prompt, add_special_tokens=False).ids, tok.token_to_id("<|endoftext|>")
    new = []
    with torch.no_grad():
        while len(new) < 20:
            # Greedy over the tokenizer's 300 rows, never the 84 of padding.
            token = int(model(torch.tensor([ids + new]))[0, -1, :300].argmax())
            if token == eot:
                break
            new.append(token)
    assert res.stdout == prompt + tok.decode(new) + "\n"


def test_export_hands_the_tokenizer_to_transformers(run_main, tmp_path, bpe, bpe_run):
    from transformers import AutoTokenizer

    (_, tok), (run_dir, _) = bpe, bpe_run
    res = run_main("export", str(run_dir), "--out", str(tmp_path / "hf"))
    assert res.code == 0, res.stderr
    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Document 7: the quick brown fox ✓"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>"
    assert loaded.decode(tok.encode(text).ids) == text
    eot = tok.token_to_id("<|endoftext|>")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == eot
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == eot


def test_a_dir_prepared_again_from_text_edited_in_its_middle_is_another_dir(tmp_path):
    """The fingerprint a resume checks read each file's size and its first and last 4 KiB: a
    text edited in its middle, the same length, prepared again in place, resumed on silently (a
    reviewer's run). meta.json now holds the sha256 of every id, which the fingerprint reads."""
    from partrain.data.tokens import fingerprint

    text = tmp_path / "book.txt"
    lines = [f"line {i}: alpha beta gamma\n" for i in range(4000)]
    text.write_text("".join(lines))
    prepare_token_dir([text], tmp_path / "a", 0.1, workers=1)
    lines[2000] = lines[2000].replace("alpha", "ALPHA")
    text.write_text("".join(lines))
    prepare_token_dir([text], tmp_path / "b", 0.1, workers=1)
    a, b = (json.loads((tmp_path / d / "meta.json").read_text()) for d in "ab")
    assert {k: v for k, v in a.items() if k != "ids_sha256"} == \
        {k: v for k, v in b.items() if k != "ids_sha256"}  # the same sizes and counts
    assert a["ids_sha256"] != b["ids_sha256"]
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")
    cfg = quick("data.source=tokens", f"data.path={tmp_path / 'b'}", "train.seq_len=8")
    check_data(cfg)  # a dir with the hash reads as before


def test_a_tokenizer_json_swapped_for_one_with_another_end_of_text_id_is_refused(tmp_path, bpe,
                                                                                  corpus):
    """meta.json says eot_id 0; a tokenizer.json of the same size whose <|endoftext|> is id 1
    was accepted, and the run copied it: `sample` and `export` would stop at the wrong id."""
    from tokenizers import decoders, trainers

    path, _ = bpe
    inputs, _ = corpus
    prepare_token_dir(inputs[:1], tmp_path / "tok", 0.5, tokenizer=path, workers=1)
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.decoder = decoders.ByteLevel()
    other.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert other.token_to_id("<|endoftext|>") != meta["eot_id"]
    other.save(str(tmp_path / "tok" / "tokenizer.json"))
    cfg = quick("data.source=tokens", f"data.path={tmp_path / 'tok'}", "train.seq_len=8",
                "model.vocab_size=384")
    with pytest.raises(ConfigError, match=r"ends a document with <\|endoftext\|>=1, but meta.json "
                                          r"eot_id=0 ended the ids"):
        check_data(cfg)

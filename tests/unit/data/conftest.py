"""Fixtures of the data tests: the BPE tokenizer (one per module) and a corpus of every kind of
input."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.data.corpus import DOCS, train_bpe


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return path, train_bpe(path)


@pytest.fixture
def corpus(tmp_path):
    """DOCS spread over a directory tree (text files, hidden ones to skip), a JSON Lines and a
    Parquet file; returns the inputs and the documents in the order prepare must read them."""
    root = tmp_path / "corpus"
    (root / "b" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("skipped")
    (root / ".notes.txt").write_text("skipped")
    (root / "a.txt").write_text(DOCS[0])
    (root / "b" / "deeper" / "c.txt").write_text(DOCS[1])
    (root / "b" / "b.txt").write_text(DOCS[2])
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d, "meta": {"x": [1]}}) + "\n"
                             for i, d in enumerate(DOCS[3:30])) + json.dumps({"text": None}) + "\n")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"n": list(range(30, 60)), "text": DOCS[30:]}), parquet,
                   row_group_size=7)
    # Directory order is sorted: a.txt, b/b.txt, b/deeper/c.txt.
    return [root, jsonl, parquet], [DOCS[0], DOCS[2], DOCS[1], *DOCS[3:]]

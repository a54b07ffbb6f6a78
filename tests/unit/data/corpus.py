"""What the data tests read: DOCS, a byte-level BPE tokenizer trained on them with the `tokenizers`
library, the ids a prepared token dir holds, and a refusal of `data prepare` that leaves nothing."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from partrain.data.prepare import prepare_token_dir
from partrain.errors import ConfigError

DOCS = [f"Document {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog. Ünïcödé ✓ {i * i}\n"
        for i in range(60)]


def train_bpe(path, vocab_size=300, extra=()):
    """A byte-level BPE tokenizer with <|endoftext|> as its only special token, saved at `path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(DOCS, trainer)
    if extra:
        tok.add_tokens(list(extra))
    tok.save(str(path))
    return tok


def read_ids(out):
    """meta.json and the ids of both splits, train then val, read from the shard files."""
    meta = json.loads((out / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(out / f"{s}-{i:05d}.bin", dtype=meta["dtype"])
                          for s in ("train", "val") for i in range(len(meta[f"{s}_shards"]))])
    return meta, ids


def refusal(tmp_path, inputs, **options) -> str:
    """prepare_token_dir refused, leaving nothing: the message."""
    with pytest.raises(ConfigError) as info:
        prepare_token_dir(inputs, tmp_path / "tok", 0.1, **{"workers": 1, **options})
    assert not (tmp_path / "tok").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tok.tmp")]
    return str(info.value)

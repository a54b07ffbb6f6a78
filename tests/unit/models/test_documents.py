"""Document masking (train.document_masking) on one process: a packed sequence's logits and
gradients are those of each document run alone; each row's document ids come from the source's
document index and depend on the row alone; the layouts that cannot mask are refused."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from partrain.data.batches import document_ids, sampler_micro_batches
from partrain.data.sampler import RandomWindows
from partrain.errors import ConfigError
from partrain.models.layers import document_mask
from partrain.models.llama import build_model
from tests.unit.helpers import compose, resolved


def test_the_mask_is_causal_inside_each_document():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = document_mask(docs)[0, 0]
    assert mask.shape == (6, 6)
    for q in range(6):
        for k in range(6):
            assert bool(mask[q, k]) == (k <= q and docs[0, q] == docs[0, k]), (q, k)


def test_document_ids_from_the_index_count_from_the_rows_first():
    starts = np.array([0, 5, 9, 20])
    assert document_ids(starts, 0, 6).tolist() == [0, 0, 0, 0, 0, 1]
    assert document_ids(starts, 7, 5).tolist() == [0, 0, 1, 1, 1]
    assert document_ids(starts, 19, 3).tolist() == [0, 1, 1]
    assert document_ids(starts, 22, 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_packed_logits_and_gradients_are_each_document_alone(checkpointing):
    cfg = compose("model=tiny")
    seq, lengths = 24, [7, 1, 12, 4]
    torch.manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    docs = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None].int()

    packed = build_model(cfg.model, 0)
    for block in packed.layers.values():
        block.recompute = checkpointing
    logits = packed(x, documents=docs)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()

    alone = build_model(cfg.model, 0)
    bounds = np.cumsum([0] + lengths)
    pieces = [alone(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    want = torch.cat(pieces, dim=1)
    F.cross_entropy(want.flatten(0, 1), y.flatten()).backward()

    assert torch.allclose(logits, want, atol=1e-5, rtol=1e-5), (logits - want).abs().max()
    grads = dict(alone.named_parameters())
    for name, p in packed.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4), name
    # Without the mask the documents see each other: another result.
    assert (packed(x) - want).abs().max() > 1e-3


def test_micro_batches_carry_each_rows_documents_the_same_for_every_dp():
    stream = np.arange(1000)  # each token its own offset
    starts = np.array([0, 10, 11, 200, 640])
    sampler = RandomWindows(stream, global_batch_size=4, seq_len=64, seed=0, split="train",
                            docs=starts)
    whole = sampler_micro_batches(sampler, 3, micro_batch_size=4, dp=1, dp_rank=0,
                                  documents=True)
    halves = [m for r in range(2) for m in sampler_micro_batches(
        sampler, 3, micro_batch_size=2, dp=2, dp_rank=r, documents=True)]
    x, _, docs = whole[0]
    assert torch.equal(torch.cat([m[2] for m in halves]), docs)
    assert torch.equal(torch.cat([m[0] for m in halves]), x)
    for row in range(4):
        start = int(x[row, 0])
        assert docs[row].tolist() == document_ids(starts, start, 64).tolist()
    # Without document_masking, the micro-batches are (inputs, targets) as before.
    assert len(sampler_micro_batches(sampler, 3, micro_batch_size=4, dp=1, dp_rank=0)[0]) == 2


def test_context_parallelism_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as info:
        resolved("train.document_masking=true", "parallel.cp=2", "parallel.dp=1", nproc=2)
    message = str(info.value)
    assert "train.document_masking=true" in message and "parallel.cp=2" in message
    assert "parallel.cp=1" in message  # what to do


def test_tp_pp_and_sequence_parallelism_are_accepted():
    for overrides in (("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=1"),
                      ("parallel.pp=2", "parallel.dp=1")):
        cfg, _, _ = resolved("train.document_masking=true", *overrides, nproc=2)
        assert cfg.train.document_masking


def test_a_user_model_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as info:
        resolved("train.document_masking=true",
                 "model.target=tests.unit.models.user_models:plain", nproc=1)
    assert "train.document_masking is not for a user model" in str(info.value)

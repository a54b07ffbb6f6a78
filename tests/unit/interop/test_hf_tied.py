"""Tied embeddings (model.tie_embeddings) and Hugging Face's tie_word_embeddings: an export of a
tied checkpoint is a tied LlamaForCausalLM (no lm_head.weight) that transformers loads with
partrain's logits; a tied transformers checkpoint (save_pretrained writes no lm_head.weight)
imports into one weight used by the embedding and the head."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from partrain.checkpoint import store
from partrain.checkpoint.offline import checkpoint_model
from tests.unit.interop.hf_models import batch, hf_llama, import_keys, rel_l2, saved_run


@pytest.fixture(scope="module")
def saved_tied(tmp_path_factory):
    """A run dir with one committed checkpoint of a tied model (perturbed weights, one step)."""
    return saved_run(tmp_path_factory.mktemp("hf-tied") / "run", 1, tie_embeddings=True)


def test_a_tied_checkpoint_holds_the_embedding_once(saved_tied):
    (checkpoint,) = store.committed(saved_tied[0] / store.CHECKPOINTS)
    keys = dcp.FileSystemReader(checkpoint.path).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "optim.tok_embeddings.weight.exp_avg" in keys
    assert not [k for k in keys if ".output." in k]
    loaded, cfg = checkpoint_model(checkpoint)
    assert cfg.model.tie_embeddings and loaded.output.weight is loaded.tok_embeddings.weight
    x = batch()
    with torch.no_grad():
        assert torch.equal(loaded(x), saved_tied[1](x))


def test_tied_export_loads_in_transformers_with_partrains_logits(run_main, saved_tied, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, model = saved_tied
    out = tmp_path / "hf"
    res = run_main("export", str(run_dir), "--out", str(out))
    assert res.code == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = batch()
    with torch.no_grad():
        assert rel_l2(hf(x).logits, model(x)) <= 1e-5


def test_tied_import_computes_transformers_logits(tmp_path):
    from partrain.interop.hf import check_hf_init, load_hf_weights
    from partrain.models.llama import Transformer

    hf = hf_llama(tmp_path / "hf", tie_word_embeddings=True)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # what save_pretrained writes for a tied model
    model_cfg = import_keys(tmp_path / "hf", tie_embeddings=True)
    assert check_hf_init(model_cfg) == tmp_path / "hf"
    model = Transformer(model_cfg).eval()
    load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, hf.lm_head.weight)
    x = batch(seq=64)
    with torch.no_grad():
        assert rel_l2(model(x), hf(x).logits) <= 1e-5

"""Tied embeddings (model.tie_embeddings) and Hugging Face's tie_word_embeddings: an export of a
tied checkpoint is a tied LlamaForCausalLM (no lm_head.weight) that transformers loads with
partrain's logits; a tied transformers checkpoint (save_pretrained writes no lm_head.weight)
imports into one weight used by the embedding and the head."""

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors import safe_open

from partrain.checkpoint import store
from partrain.checkpoint.state import build_state, checkpoint_model
from partrain.config.schema import Config
from partrain.models import build_model
from tests.unit.test_hf import _batch, _model_cfg, _rel_l2, hf_llama


@pytest.fixture(scope="module")
def saved_tied(tmp_path_factory):
    """A run dir with one committed checkpoint of a tied model (perturbed weights, one step)."""
    run_dir = tmp_path_factory.mktemp("hf-tied") / "run"
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len, cfg.model.tie_embeddings = 2, 64, True
    model = build_model(cfg.model, seed=3)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    root = run_dir / store.CHECKPOINTS
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(build_state(model, optimizer, None, zero=False),
                 checkpoint_id=store.tmp_dir(root, 1))
    store.commit(root, 1, {"reason": "test"}, OmegaConf.to_yaml(cfg))
    return run_dir, model.eval()


def test_a_tied_checkpoint_holds_the_embedding_once(saved_tied):
    (checkpoint,) = store.committed(saved_tied[0] / store.CHECKPOINTS)
    keys = dcp.FileSystemReader(checkpoint.path).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "optim.tok_embeddings.weight.exp_avg" in keys
    assert not [k for k in keys if ".output." in k]
    loaded, cfg = checkpoint_model(checkpoint)
    assert cfg.model.tie_embeddings and loaded.output.weight is loaded.tok_embeddings.weight
    x = _batch()
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
    x = _batch()
    with torch.no_grad():
        assert _rel_l2(hf(x).logits, model(x)) <= 1e-5


def test_tied_import_computes_transformers_logits(tmp_path):
    from partrain.hf import check_hf_init, load_hf_weights
    from partrain.models.llama import Transformer

    hf = hf_llama(tmp_path / "hf", tie_word_embeddings=True)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # what save_pretrained writes for a tied model
    model_cfg = _model_cfg(tmp_path / "hf", tie_embeddings=True)
    assert check_hf_init(model_cfg) == tmp_path / "hf"
    model = Transformer(model_cfg).eval()
    load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, hf.lm_head.weight)
    x = _batch(seq=64)
    with torch.no_grad():
        assert _rel_l2(model(x), hf(x).logits) <= 1e-5

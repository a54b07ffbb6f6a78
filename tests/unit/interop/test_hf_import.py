"""Weights in: model.init_from=hf:DIR, from checkpoints that transformers itself writes; partrain
must compute transformers' logits, and refuses what does not fit with a message naming it."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from partrain.config.schema import Config
from tests.unit.helpers import save_checkpoint
from tests.unit.interop.hf_models import (
    LLAMA3,
    LLAMA3_KEYS,
    batch,
    hf_llama,
    import_keys,
    rel_l2,
)


@pytest.mark.parametrize("rope, keys", [(None, {}), (LLAMA3, LLAMA3_KEYS)], ids=["rope", "llama3"])
def test_import_computes_transformers_logits(tmp_path, rope, keys):
    from partrain.interop.hf import check_hf_init, load_hf_weights
    from partrain.models.llama import Transformer

    hf = hf_llama(tmp_path / "hf", rope)
    model_cfg = import_keys(tmp_path / "hf", **keys)
    assert check_hf_init(model_cfg) == tmp_path / "hf"
    model = Transformer(model_cfg).eval()
    load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    x = batch(seq=200)  # past original_max_position_embeddings: llama3's scaling matters
    with torch.no_grad():
        assert rel_l2(model(x), hf(x).logits) <= 1e-5


def test_llama3_rope_scaling_changes_the_frequencies():
    from partrain.models.layers import rope_scaling, rope_tables

    cfg = OmegaConf.structured(Config).model
    plain = rope_tables(32, 128, 500000.0)
    cfg.rope_type, cfg.rope_original_max_seq_len = "llama3", 64
    scaled = rope_tables(32, 128, 500000.0, rope_scaling(cfg))
    sin_plain, sin_scaled = plain[1], scaled[1]
    assert torch.equal(sin_scaled[:, 0], sin_plain[:, 0])  # the fastest rotation is kept
    # The slowest is slowed by the factor (its angles are small: sin is the angle).
    assert torch.allclose(sin_scaled[:, -1] * 8, sin_plain[:, -1], rtol=1e-4)


def test_export_of_a_llama3_model_round_trips(run_main, tmp_path):
    """Import a llama3 checkpoint, save it as partrain's, export it: transformers computes the
    same logits from the export (rope_parameters written as read)."""
    from transformers import AutoModelForCausalLM

    from partrain.interop.hf import load_hf_weights
    from partrain.models.llama import Transformer

    hf = hf_llama(tmp_path / "hf", LLAMA3)
    model_cfg = import_keys(tmp_path / "hf", **LLAMA3_KEYS)
    model = Transformer(model_cfg).eval()
    load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    cfg = OmegaConf.structured(Config)
    cfg.model = model_cfg
    save_checkpoint(model, cfg, tmp_path / "run")
    assert run_main("export", str(tmp_path / "run"), "--out", str(tmp_path / "out")).code == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"] == LLAMA3
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    x = batch(seq=200)
    with torch.no_grad():
        assert rel_l2(again(x).logits, hf(x).logits) <= 1e-5


@pytest.mark.parametrize("overrides, keys, fragments", [
    ({}, {"dim": 64}, ["model.dim=64 but config.json says 128", "add model.dim=128"]),
    ({}, {"n_layers": 3, "vocab_size": 512},
     ["model.n_layers=3", "model.vocab_size=512", "add model.n_layers=2 model.vocab_size=256"]),
    ({"rope_parameters": LLAMA3}, {}, ["model.rope_type=default but config.json says llama3",
                                       "model.rope_theta=500000.0"]),
    ({"tie_word_embeddings": True}, {}, ["model.tie_embeddings=false but config.json says true",
                                         "add model.tie_embeddings=true"]),
    ({}, {"tie_embeddings": True}, ["model.tie_embeddings=true but config.json says false",
                                    "add model.tie_embeddings=false"]),
    ({"hidden_act": "gelu"}, {}, ["hidden_act='gelu'", "silu"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, {},
     ["rope_type='yarn'", "default and llama3"]),
])
def test_import_refuses_what_does_not_fit(tmp_path, overrides, keys, fragments):
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf", **overrides)
    with pytest.raises(ConfigError) as e:
        check_hf_init(import_keys(tmp_path / "hf", **keys))
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert f"model.init_from=hf:{tmp_path / 'hf'}" in str(e.value)


def test_import_refuses_a_dir_without_weights(tmp_path):
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        check_hf_init(import_keys(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="is not a directory"):
        check_hf_init(import_keys(tmp_path / "nothing"))


def _rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, fragments", [
    ({"num_attention_heads": 0}, ["num_attention_heads=0", "whole number >= 1"]),
    ({"hidden_size": "128"}, ["hidden_size='128'", "whole number"]),
    ({"rope_parameters": "x"}, ["rope_parameters='x'", "object"]),
    ({"rms_norm_eps": None}, ["rms_norm_eps=None", "finite number"]),
    ({"num_hidden_layers": True}, ["num_hidden_layers=True"]),
    ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings='yes'", "true or false"]),
])
def test_import_refuses_a_malformed_config_json(tmp_path, changes, fragments):
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf")
    _rewrite_config(tmp_path / "hf", **changes)
    with pytest.raises(ConfigError) as e:
        check_hf_init(import_keys(tmp_path / "hf"))
    assert all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 64},
                                     {"type": "linear", "factor": 4.0}])
def test_a_rope_scaling_beside_a_default_rope_parameters_is_read_first(tmp_path, scaling):
    """transformers 5 takes rope_scaling over rope_parameters: a model card's YaRN (or a linear
    scaling) written beside a v5 config's default rope_parameters imported as default rope and
    trained silently off transformers' model (logits 1.4e-2 apart). Now it is read, and refused
    as a rope partrain does not have."""
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf")
    _rewrite_config(tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                    rope_scaling=scaling)
    with pytest.raises(ConfigError, match="rope_type='(yarn|linear)'; partrain has default and "
                                          "llama3"):
        check_hf_init(import_keys(tmp_path / "hf"))


def test_a_null_num_key_value_heads_is_as_many_as_the_heads(tmp_path):
    """transformers reads null as absent: one kv head per query head. It was refused."""
    from partrain.models.llama_hf import model_keys

    hf_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_key_value_heads"] = None
    assert model_keys(config, "here")["n_kv_heads"] == config["num_attention_heads"]


def test_import_refuses_weights_that_do_not_fit(tmp_path):
    """Checked in the launcher, from the files' headers: a truncated file, a missing tensor and
    a tensor of the wrong shape (which a slice under tp would silently crop)."""
    from safetensors.torch import load_file, save_file

    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    path = tmp_path / "hf"
    hf_llama(path)
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    tensors = {k: v.clone() for k, v in load_file(weights).items()}  # not views of the file

    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        check_hf_init(import_keys(path))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="no tensor lm_head.weight"):
        check_hf_init(import_keys(path))
    save_file({**tensors, "lm_head.weight": torch.zeros(512, 128)}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lm_head.weight .* \[512, 128\].*\[256, 128\]"):
        check_hf_init(import_keys(path))
    weights.write_bytes(good)
    assert check_hf_init(import_keys(path)) == path

"""What the interop tests read: a run dir holding a checkpoint of a small model, a random
transformers Llama saved with save_pretrained, the model keys that import it, a batch, and the
relative L2 distance of two outputs."""

import warnings

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.state import build_state
from partrain.config.schema import Config
from partrain.data.tokenizer import BYTE_VOCAB as BYTES
from partrain.models.llama import build_model


def saved_run(run_dir, step: int, **model_keys):
    """A run dir holding one committed checkpoint (at `step`) of a small GQA model (4 heads, 2 kv
    heads, 2 layers; `model_keys` override more) and the model itself. The weights are perturbed
    so that no two rows or heads are alike, and the optimizer has a step, as a trained
    checkpoint has."""
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len = 2, 64
    for key, value in model_keys.items():
        cfg.model[key] = value
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
                 checkpoint_id=store.tmp_dir(root, step))
    store.commit(root, step, {"reason": "test"}, OmegaConf.to_yaml(cfg))
    return run_dir, model.eval()


def batch(vocab=BYTES, seq=48):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(11))


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# A llama3 rope, as transformers' config.json says it.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# The same model as partrain's keys say it (the tiny defaults, 2 layers).
LLAMA3_KEYS = {"rope_type": "llama3", "rope_theta": 500000.0, "rope_original_max_seq_len": 64}


def hf_llama(path, rope=None, **overrides):
    """A random transformers Llama of partrain's tiny shape (2 layers), saved with
    save_pretrained into `path`; the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kwargs = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if rope:
        kwargs["rope_parameters"] = dict(rope)
    model = LlamaForCausalLM(LlamaConfig(**{**kwargs, **overrides})).eval()
    model.save_pretrained(path)
    return model


def import_keys(path, **keys):
    """Model keys of partrain's tiny shape (2 layers) that import the Llama at `path`."""
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.init_from = 2, f"hf:{path}"
    for key, value in keys.items():
        cfg.model[key] = value
    return cfg.model

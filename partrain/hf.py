"""Hugging Face interop: a partrain checkpoint as a transformers `LlamaForCausalLM` directory.

partrain's decoder is Llama's, with two differences that the mapping undoes:
- rotary embeddings rotate consecutive pairs (2i, 2i+1) of each head here (Meta's layout), and
  pairs (i, i + head_dim/2) in transformers (`rotate_half`): the rows of wq and wk are permuted
  per head, as transformers' own Llama conversion script does;
- the output head is never tied to the embedding (`tie_word_embeddings: false`).
Everything else is a renaming. The export is one directory, written under a temporary name and
renamed when complete: config.json, generation_config.json and safetensors weights (sharded with
`model.safetensors.index.json` past --max-shard-mb), loadable by `from_pretrained` with no
custom code.
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch

from partrain.errors import ConfigError

TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
IN_BLOCK = {"attention_norm.weight": "input_layernorm.weight",
            "attention.wq.weight": "self_attn.q_proj.weight",
            "attention.wk.weight": "self_attn.k_proj.weight",
            "attention.wv.weight": "self_attn.v_proj.weight",
            "attention.wo.weight": "self_attn.o_proj.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "feed_forward.w1.weight": "mlp.gate_proj.weight",
            "feed_forward.w3.weight": "mlp.up_proj.weight",
            "feed_forward.w2.weight": "mlp.down_proj.weight"}
BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONFIG_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def hf_name(name: str) -> str:
    """A parameter's name in the single-process model -> its name in LlamaForCausalLM."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    match = BLOCK.fullmatch(name)
    if not match or match.group(2) not in IN_BLOCK:
        raise ValueError(f"no Hugging Face name for {name!r}")
    return f"model.layers.{match.group(1)}.{IN_BLOCK[match.group(2)]}"


def to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq or wk from interleaved rotary pairs to rotate_half's halves, per head: within a
    head, row 2i + j moves to j * head_dim/2 + i."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of to_rotate_half (a Hugging Face checkpoint's wq or wk, for partrain)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(model_cfg, dtype: str) -> dict:
    """config.json of the LlamaForCausalLM that computes what partrain's model computes. The
    rotary base is written both ways transformers has read it (rope_theta before 5.0,
    rope_parameters since)."""
    from partrain.models.llama import ffn_dim

    m = model_cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": ffn_dim(m),
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.dim // m.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_theta)},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": float(m.init_std),
        # The byte-level corpora have no special tokens.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": CONFIG_DTYPE[dtype],
    }


def hf_state_dict(model, model_cfg, dtype: str) -> dict[str, torch.Tensor]:
    """The model's weights under LlamaForCausalLM's names, q/k rows permuted, in `dtype`."""
    state = {}
    for name, param in model.named_parameters():
        weight = param.detach()
        if name.endswith("attention.wq.weight"):
            weight = to_rotate_half(weight, model_cfg.n_heads)
        elif name.endswith("attention.wk.weight"):
            weight = to_rotate_half(weight, model_cfg.n_kv_heads)
        state[hf_name(name)] = weight.to(DTYPES[dtype]).contiguous()
    return state


def check_out_dir(out: Path) -> None:
    """--out must be new or an empty directory: an export never mixes with other files."""
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"--out {out} is a broken symlink")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; give a new "
                          "directory for the export")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {out}: {parent} is not a writable directory")


def write_safetensors(state: dict[str, torch.Tensor], out: Path, max_shard_mb: int) -> list[str]:
    """Write `state` as model.safetensors, or as shards and their index past max_shard_mb."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_mb * 1_000_000)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, out / filename,
                  metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sorted(split.filename_to_tensors)


def export_hf(checkpoint, out: Path, dtype: str = "fp32", max_shard_mb: int = 5000) -> dict:
    """Write the checkpoint as a Hugging Face Llama directory at `out` (new or empty). Nothing is
    left at `out` if it fails: it is written under a temporary name and renamed at the end."""
    from partrain.checkpoint.state import checkpoint_model

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    check_out_dir(out)
    model, cfg = checkpoint_model(checkpoint)
    state = hf_state_dict(model, cfg.model, dtype)
    del model
    out = out.absolute()
    tmp = out.with_name(f".tmp-{out.name}.{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        files = write_safetensors(state, tmp, max_shard_mb)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg.model, dtype), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({"do_sample": True}) + "\n")
        if out.exists():
            out.rmdir()  # checked empty above
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"--out {out} cannot be written: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"files": files, "tensors": len(state), "dtype": dtype, "step": checkpoint.step,
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}

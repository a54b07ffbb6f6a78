"""Hugging Face interop: a partrain checkpoint as a transformers `LlamaForCausalLM` directory, and
such a directory as the weights a run starts from (`model.init_from=hf:DIR`).

partrain's decoder is Llama's, with one difference that the mapping undoes: rotary embeddings
rotate consecutive pairs (2i, 2i+1) of each head here (Meta's layout), and pairs
(i, i + head_dim/2) in transformers (`rotate_half`): the rows of wq and wk are permuted per head,
as transformers' own Llama conversion script does. Everything else is a renaming. Tied embeddings
are `model.tie_embeddings` here and `tie_word_embeddings` there: a tied model has no
`lm_head.weight` (the export writes none, the import needs none and reads the embedding, once,
into both the embedding and the head).

The export is one directory, written under a temporary name and renamed when complete:
config.json, generation_config.json and safetensors weights (sharded with
`model.safetensors.index.json` past --max-shard-mb), loadable by `from_pretrained` with no
custom code, and the run's tokenizer files (tokenizer.json, tokenizer_config.json) when it
trained on a `data prepare --tokenizer` dir, loadable by `AutoTokenizer`.

Importing reads config.json (the model's shape must be the config's: a mismatch is refused
naming both, with the overrides to use) and, on each rank, only the slices of the safetensors
tensors that the rank holds (safetensors maps the files and slices lazily). Every weight must be
a finite number (finite.py): the launcher reads each tensor once and refuses a nan or inf naming
the file and the tensor, before any process starts; an export refuses one in the checkpoint.
"""

import json
import math
import re
from pathlib import Path

import torch

from partrain.data.tokenizer import TextTokenizer, copy_files, run_tokenizer_dir
from partrain.errors import ConfigError
from partrain.interop.finite import chunks, non_finite
from partrain.interop.sample import check_vocab
from partrain.models.arith import moe_enabled
from partrain.staging import check_out, staged_dir

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
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


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


def rope_parameters(model_cfg) -> dict:
    """The rotary embedding as transformers describes it (`rope_parameters`, since 5.0)."""
    from partrain.models.layers import rope_scaling

    scaling = rope_scaling(model_cfg)
    return {"rope_type": "llama3" if scaling else "default",
            "rope_theta": float(model_cfg.rope_theta),
            **({key: float(v) if key != "original_max_position_embeddings" else int(v)
                for key, v in scaling.items()} if scaling else {})}


def hf_config(model_cfg, dtype: str) -> dict:
    """config.json of the LlamaForCausalLM that computes what partrain's model computes. The
    rotary base is written both ways transformers has read it (rope_theta before 5.0,
    rope_parameters since)."""
    from partrain.models.arith import ffn_dim, tied

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
        "rope_parameters": rope_parameters(m),
        # transformers before 5.0 reads Llama-3's scaling here.
        "rope_scaling": rope_parameters(m) if m.rope_type == "llama3" else None,
        "tie_word_embeddings": tied(m),
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


def hf_state_dict(model, model_cfg, dtype: str,
                  where: str = "the model") -> dict[str, torch.Tensor]:
    """The model's weights under LlamaForCausalLM's names, q/k rows permuted, in `dtype`; each
    one finite, as saved and as written (`where`: what the refusal names)."""
    state = {}
    for name, param in model.named_parameters():
        weight = param.detach()
        problem = non_finite(weight)
        if problem:
            raise ConfigError(f"{where}: weight {name} holds {problem}; partrain exports finite "
                              "weights only (export a checkpoint from before the run diverged)")
        if name.endswith("attention.wq.weight"):
            weight = to_rotate_half(weight, model_cfg.n_heads)
        elif name.endswith("attention.wk.weight"):
            weight = to_rotate_half(weight, model_cfg.n_kv_heads)
        weight = weight.to(DTYPES[dtype]).contiguous()
        problem = non_finite(weight)
        if problem:
            raise ConfigError(f"--dtype {dtype}: weight {name} of {where} would hold {problem}; "
                              f"its values are beyond {dtype}'s range: export with --dtype fp32")
        state[hf_name(name)] = weight
    return state


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
    from safetensors import SafetensorError

    from partrain.checkpoint.offline import checkpoint_model

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    check_out(out)
    model, cfg = checkpoint_model(checkpoint)
    if moe_enabled(cfg.model):
        raise ConfigError(
            f"{checkpoint.path} is a mixture of experts (model.moe.n_experts="
            f"{cfg.model.moe.n_experts}); --format hf writes Llama models, which have no experts")
    tokenizer = run_tokenizer_dir(checkpoint.path.parent.parent, cfg.data)
    eot_id = None
    if tokenizer is not None:
        text_tokenizer = TextTokenizer(tokenizer)
        check_vocab(text_tokenizer, cfg.model.vocab_size)
        eot_id = text_tokenizer.eot_id
    state = hf_state_dict(model, cfg.model, dtype, str(checkpoint.path))
    del model
    # A full disk inside safetensors is its own error type.
    with staged_dir(out, errors=(OSError, SafetensorError)) as stage:
        stage.step = "writing the safetensors files"
        files = write_safetensors(state, stage.path, max_shard_mb)
        config, generation = hf_config(cfg.model, dtype), {"do_sample": True}
        if tokenizer is not None:  # generate() stops at the end-of-text token the data used
            config["eos_token_id"] = generation["eos_token_id"] = eot_id
            stage.step = "copying the tokenizer files"
            copy_files(tokenizer, stage.path)
        stage.step = "writing config.json"
        (stage.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (stage.path / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return {"files": files, "tensors": len(state), "dtype": dtype, "step": checkpoint.step,
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


HF_PREFIX = "hf:"
HF_CONFIG_MAX_BYTES = 1 << 20


def is_hf(init_from) -> bool:
    return isinstance(init_from, str) and init_from.startswith(HF_PREFIX)


def hf_dir(init_from: str) -> Path:
    return Path(init_from[len(HF_PREFIX):])


def read_hf_config(path: Path) -> dict:
    """config.json of a Hugging Face model directory (ConfigError naming model.init_from)."""
    where = f"model.init_from={HF_PREFIX}{path}"
    config = path / "config.json"
    if not path.is_dir():
        raise ConfigError(f"{where}: {path} is not a directory (a Hugging Face model directory "
                          "with config.json and safetensors weights)")
    if not config.is_file():
        raise ConfigError(f"{where}: {config} does not exist")
    if config.stat().st_size > HF_CONFIG_MAX_BYTES:
        raise ConfigError(f"{where}: {config} is over 1 MiB; not a model config")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {config} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {config} holds {type(data).__name__}, not an object")
    return data


def _whole(hf: dict, key: str, where: str, default=None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key}={value!r} must be a whole number >= 1")
    return value


def _real(table: dict, key: str, where: str, default=None) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{where}: {key}={value!r} must be a finite number > 0")
    return float(value)


def model_keys(hf: dict, where: str) -> dict:
    """partrain's model keys for a transformers Llama config (refusing what partrain lacks)."""
    if hf.get("model_type") != "llama":
        raise ConfigError(f"{where}: model_type={hf.get('model_type')!r}; partrain imports Llama "
                          "models (model_type 'llama')")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={hf[key]!r}; partrain's Llama has {key}={want!r}")
    tie = hf.get("tie_word_embeddings", False)  # LlamaConfig's default
    if not isinstance(tie, bool):
        raise ConfigError(f"{where}: tie_word_embeddings={tie!r} must be true or false")
    dim, heads = _whole(hf, "hidden_size", where), _whole(hf, "num_attention_heads", where)
    if hf.get("head_dim") not in (None, dim // heads):
        raise ConfigError(f"{where}: head_dim={hf['head_dim']!r} is not hidden_size / "
                          f"num_attention_heads = {dim // heads}; partrain's heads split the "
                          "hidden size")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters={rope!r} must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{where}: rope_type={rope_type!r}; partrain has default and llama3")
    keys = {"n_layers": _whole(hf, "num_hidden_layers", where), "n_heads": heads,
            "n_kv_heads": _whole(hf, "num_key_value_heads", where, heads), "dim": dim,
            "ffn_dim": _whole(hf, "intermediate_size", where),
            "vocab_size": _whole(hf, "vocab_size", where),
            "norm_eps": _real(hf, "rms_norm_eps", where, 1e-6),
            "rope_theta": _real(rope, "rope_theta", where, hf.get("rope_theta", 10000.0)),
            "rope_type": rope_type, "tie_embeddings": tie}
    if rope_type == "llama3":
        keys.update(rope_factor=_real(rope, "factor", where),
                    rope_low_freq_factor=_real(rope, "low_freq_factor", where),
                    rope_high_freq_factor=_real(rope, "high_freq_factor", where),
                    rope_original_max_seq_len=_whole(rope, "original_max_position_embeddings",
                                                     where))
    return keys


def check_hf_init(model_cfg) -> Path:
    """model.init_from=hf:DIR: a Llama of this config's shape whose safetensors hold every
    weight at its full shape; the DIR. Each rank then reads without further checks."""
    from partrain.models.arith import ffn_dim, tied
    from partrain.models.llama import Transformer

    path = hf_dir(model_cfg.init_from)
    where = f"model.init_from={model_cfg.init_from}"
    wanted = model_keys(read_hf_config(path), f"{where} (config.json)")
    derived = {"ffn_dim": ffn_dim(model_cfg), "tie_embeddings": tied(model_cfg)}
    mine = {key: derived[key] if key in derived else model_cfg[key] for key in wanted}
    wrong = [key for key in wanted if not _same(mine[key], wanted[key])]
    if wrong:
        raise ConfigError(
            f"{where}: " + ", ".join(f"model.{k}={_shown(mine[k])} but config.json says "
                                     f"{_shown(wanted[k])}" for k in wrong)
            + "; the weights have config.json's shape: add "
            + " ".join(f"model.{k}={_shown(wanted[k])}" for k in wrong))
    with torch.device("meta"):
        shapes = {hf_name(n): list(p.shape) for n, p in Transformer(model_cfg).named_parameters()}
    _check_tensors(path, weight_files(path, where), shapes, where)
    return path


def _check_tensors(path: Path, files: dict[str, Path], shapes: dict[str, list], where: str):
    """Every weight the model needs is in the files, at its full shape, in a float dtype (the
    files' headers), and holds finite numbers only (its values, read a chunk at a time: this
    reads the weights once here, so that a nan is refused before any process starts rather than
    trained on)."""
    from safetensors import safe_open

    for name, shape in shapes.items():
        if name not in files:
            raise ConfigError(f"{where}: no tensor {name} in {path}'s safetensors")
    for file in sorted(set(files[name] for name in shapes)):
        try:
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for name in (n for n in shapes if files[n] == file):
                    if name not in present:
                        raise ConfigError(f"{where}: {file.name} lacks {name}, which the index "
                                          "places there")
                    part = f.get_slice(name)
                    if part.get_shape() != shapes[name] or part.get_dtype() not in FLOAT_DTYPES:
                        raise ConfigError(
                            f"{where}: {name} in {file.name} is {part.get_dtype()} "
                            f"{part.get_shape()}; the model needs a float tensor of shape "
                            f"{shapes[name]}")
                    _check_finite(part, name, file, where)
        except ConfigError:
            raise
        except Exception as e:  # safetensors' own error for a truncated or foreign file
            raise ConfigError(f"{where}: {file} is not a readable safetensors file ({e})") from None


def _check_finite(part, name: str, file: Path, where: str) -> None:
    shape = part.get_shape()
    for start, stop in chunks(shape[0], math.prod(shape[1:])):
        problem = non_finite(part[start:stop], offset=start)
        if problem:
            raise ConfigError(f"{where}: tensor {name} in {file} holds {problem}; a run starts "
                              "from finite weights only (no nan or inf)")


def _shown(value) -> str:
    """A value as an override writes it (booleans as true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _same(mine, theirs) -> bool:
    if isinstance(mine, float) or isinstance(theirs, float):
        return abs(float(mine) - float(theirs)) <= 1e-12 * max(abs(float(theirs)), 1.0)
    return mine == theirs


def weight_files(path: Path, where: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (model.safetensors, or the index's)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {str(name): path / str(file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: {index} is not a safetensors index ({e!r})") from None
    elif (path / "model.safetensors").is_file():
        from safetensors import safe_open

        try:
            with safe_open(path / "model.safetensors", framework="pt") as f:
                files = {name: path / "model.safetensors" for name in f.keys()}
        except Exception as e:  # safetensors' own error for a truncated or foreign file
            raise ConfigError(f"{where}: {path / 'model.safetensors'} is not a readable "
                              f"safetensors file ({e})") from None
    else:
        raise ConfigError(f"{where}: {path} holds neither model.safetensors nor "
                          "model.safetensors.index.json (partrain reads safetensors weights)")
    missing = sorted({f for f in files.values() if not f.is_file()})
    if missing:
        raise ConfigError(f"{where}: {missing[0]} (named by the index) does not exist")
    return files


@torch.no_grad()
def load_hf_weights(model, path: Path, model_cfg, tp_mesh) -> None:
    """Fill this rank's parameters (its tp shard of its pp stage) from a Hugging Face Llama
    directory that check_hf_init accepted, reading only their slices. Not collective."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from partrain.checkpoint.state import named_parameters

    files = weight_files(path, f"model.init_from={HF_PREFIX}{path}")
    tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None and tp_mesh.size() > 1 else 0
    head_dim = model_cfg.dim // model_cfg.n_heads
    with ExitStack() as stack:
        opened = {}
        for name, param in named_parameters(model).items():
            key = hf_name(name)
            file = files[key]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(file, framework="pt"))
            part = opened[file].get_slice(key)
            index = [slice(None)] * param.dim()
            dim = getattr(param, "tp_shard_dim", None)  # set on tp shards only
            if dim is not None:
                size = param.shape[dim]
                index[dim] = slice(tp_rank * size, (tp_rank + 1) * size)
            weight = part[tuple(index)]
            problem = non_finite(weight)
            if problem:  # check_hf_init read them finite: the file changed since
                raise ConfigError(f"model.init_from={HF_PREFIX}{path}: tensor {key} in {file} "
                                  f"holds {problem}; a run starts from finite weights only")
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                weight = from_rotate_half(weight, weight.shape[0] // head_dim)
            param.copy_(weight)

"""Hugging Face interop: a partrain checkpoint as a transformers directory, and such a directory
as the weights a run starts from (`model.init_from=hf:DIR`), for a family that declares a
Hugging Face adapter (partrain.models.family.HfAdapter: its config.json model_types and keys,
the name map and the per-weight conversion). The built-in family's (Llama, Mistral, Qwen2,
Qwen3) is partrain.models.llama_hf: a renaming, and the q/k rows permuted per head from
interleaved rotary pairs to transformers' `rotate_half`. A family without one is refused, naming
it. Tied embeddings are `model.tie_embeddings` here and `tie_word_embeddings` there: a tied model
has no `lm_head.weight` (the export writes none, the import needs none and reads the embedding,
once, into both the embedding and the head).

The export is one directory, written under a temporary name and renamed when complete:
config.json, generation_config.json (the padding ids of a padded vocabulary suppressed, as
`sample` masks them) and safetensors weights (sharded with
`model.safetensors.index.json` past --max-shard-mb), loadable by `from_pretrained` with no
custom code, and the run's tokenizer files (tokenizer.json, tokenizer_config.json) when it
trained on a `data prepare --tokenizer` dir, loadable by `AutoTokenizer` and set to add no
special token, as the run's data and `sample` were encoded (a Llama-3 tokenizer.json prepends a
BOS the model never saw; data.tokenizer.write_as_trained).

Importing reads config.json (the model's shape must be the config's: a mismatch is refused
naming both, with the overrides to use; a tensor in the files that the model would not use is
refused, naming it, never dropped) and, on each rank, only the slices of the safetensors
tensors that the rank holds (safetensors maps the files and slices lazily). Every weight must be
a finite number (finite.py): the launcher reads each tensor once and refuses a nan or inf naming
the file and the tensor, before any process starts; an export refuses one in the checkpoint.
"""

import json
import math
import re
from pathlib import Path

import torch

from partrain.data.tokenizer import TextTokenizer, run_tokenizer_dir, write_as_trained
from partrain.errors import ConfigError
from partrain.interop.finite import chunks, non_finite
from partrain.config.hf_families import (  # hf_dir, is_hf: imported from here too
    HF_PREFIX,
    hf_dir,
    is_hf,
    read_hf_config,
    refuse_disagreements,
)
from partrain.interop.sample import check_vocab
from partrain.models.arith import moe_enabled
from partrain.models.family import hf_adapter, is_user_model
from partrain.staging import check_out, staged_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Buffers older transformers saved beside the weights (computed from config.json): not weights.
NOT_WEIGHTS = re.compile(r".*\.rotary_emb\.inv_freq")


def hf_state_dict(model, model_cfg, dtype: str,
                  where: str = "the model") -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names, q/k rows permuted, in `dtype`; each one
    finite, as saved and as written (`where`: what the refusal names)."""
    state, adapter = {}, hf_adapter(model_cfg, f"{where} as Hugging Face weights")
    for name, param in model.named_parameters():
        weight = param.detach()
        problem = non_finite(weight)
        if problem:
            raise ConfigError(f"{where}: weight {name} holds {problem}; partrain exports finite "
                              "weights only (export a checkpoint from before the run diverged)")
        weight = adapter.to_hf(name, weight, model_cfg).to(DTYPES[dtype]).contiguous()
        problem = non_finite(weight)
        if problem:
            raise ConfigError(f"--dtype {dtype}: weight {name} of {where} would hold {problem}; "
                              f"its values are beyond {dtype}'s range: export with --dtype fp32")
        state[adapter.name(name)] = weight
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
    """Write the checkpoint as a Hugging Face directory of its family at `out` (new or empty).
    Nothing is left at `out` if it fails: it is written under a temporary name and renamed at
    the end."""
    from omegaconf import OmegaConf
    from safetensors import SafetensorError

    from partrain.checkpoint.offline import checkpoint_model
    from partrain.checkpoint.resume import saved_config

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    check_out(out)
    saved = OmegaConf.create(saved_config(checkpoint)).model
    if not is_user_model(saved):  # checkpoint_model says what to do with a user's own model
        hf_adapter(saved, f"--format hf of {checkpoint.path}")  # before the model is built
    model, cfg = checkpoint_model(checkpoint)
    adapter = hf_adapter(cfg.model, f"--format hf of {checkpoint.path}")
    if moe_enabled(cfg.model):
        raise ConfigError(
            f"{checkpoint.path} is a mixture of experts (model.moe.n_experts="
            f"{cfg.model.moe.n_experts}); --format hf writes Llama, Mistral and Qwen models, "
            "which have no experts")
    config = adapter.config(cfg.model, dtype)  # refuses keys no family has, before any work
    tokenizer = run_tokenizer_dir(checkpoint.path.parent.parent, cfg.data, cfg.model.vocab_size)
    text_tokenizer = TextTokenizer(tokenizer)  # byte-level when None: ids 0 .. 255
    if tokenizer is not None:
        check_vocab(text_tokenizer, cfg.model.vocab_size)
    state = hf_state_dict(model, cfg.model, dtype, str(checkpoint.path))
    del model
    # A full disk inside safetensors is its own error type.
    with staged_dir(out, errors=(OSError, SafetensorError)) as stage:
        stage.step = "writing the safetensors files"
        files = write_safetensors(state, stage.path, max_shard_mb)
        generation = {"do_sample": True}
        # Rows past the tokenizer's ids (model.vocab_size padded, for tp) are ids no text has:
        # `sample` never draws them, and generate() must not either (it would print nothing).
        padding = list(range(text_tokenizer.vocab_size, cfg.model.vocab_size))
        if padding:
            generation["suppress_tokens"] = padding
        if tokenizer is not None:  # generate() stops at the end-of-text token the data used
            config["eos_token_id"] = generation["eos_token_id"] = text_tokenizer.eot_id
            stage.step = "writing the tokenizer files"
            write_as_trained(tokenizer, stage.path)
        stage.step = "writing config.json"
        (stage.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (stage.path / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return {"files": files, "tensors": len(state), "dtype": dtype, "step": checkpoint.step,
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def check_hf_init(model_cfg) -> Path:
    """model.init_from=hf:DIR: a model of this config's shape whose safetensors hold every
    weight at its full shape, and nothing else; the DIR. Each rank then reads without further
    checks."""
    from partrain.models.arith import ffn_dim, head_dim, tied
    from partrain.models.family import build_family_model

    path = hf_dir(model_cfg.init_from)
    where = f"model.init_from={model_cfg.init_from}"
    adapter = hf_adapter(model_cfg, where)
    wanted = adapter.keys(read_hf_config(path), f"{where} (config.json)")
    derived = {"ffn_dim": ffn_dim(model_cfg), "head_dim": head_dim(model_cfg),
               "tie_embeddings": tied(model_cfg)}
    wanted.pop("hf_model_type", None)  # what an export writes, not the weights' shape
    mine = {key: derived[key] if key in derived else model_cfg[key] for key in wanted}
    refuse_disagreements(where, mine, wanted, "; the weights have config.json's shape: add {keys}")
    with torch.device("meta"):
        model = build_family_model(model_cfg, seed=0)
        shapes = {adapter.name(n): list(p.shape) for n, p in model.named_parameters()}
    files = weight_files(path, where)
    unused = sorted(n for n in files if n not in shapes and not NOT_WEIGHTS.fullmatch(n))
    if unused:
        raise ConfigError(
            f"{where}: {path}'s safetensors hold {len(unused)} tensor(s) that partrain's model "
            f"would not use: {', '.join(unused[:6])}{' ...' if len(unused) > 6 else ''}; "
            "partrain refuses them rather than drop them (is config.json's model_type the "
            f"model's? model.family={model_cfg.family} reads "
            f"{', '.join(adapter.model_types)})")
    _check_tensors(path, files, shapes, where)
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
    """Fill this rank's parameters (its tp shard of its pp stage) from a Hugging Face
    directory that check_hf_init accepted, reading only their slices. Not collective."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from partrain.checkpoint.state import named_parameters

    where = f"model.init_from={HF_PREFIX}{path}"
    adapter = hf_adapter(model_cfg, where)
    files = weight_files(path, where)
    tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None and tp_mesh.size() > 1 else 0
    with ExitStack() as stack:
        opened = {}
        for name, param in named_parameters(model).items():
            key = adapter.name(name)
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
            param.copy_(adapter.from_hf(name, weight, model_cfg))

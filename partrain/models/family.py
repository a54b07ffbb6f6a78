"""Model families: what partrain trains, by name (`model.family`), or a user's own `nn.Module`
(`model.target=mypkg.module:build`, its keys under `model.args`).

A family is a builder plus what partrain may ask of the model it builds. The built-in `llama`
family (the Llama/Mistral/Qwen decoder and its mixtures of experts) is registered here like any
other. A user's builder is `build(model_cfg) -> nn.Module`: `model_cfg` is the `model` section
(`model_cfg.args` the user's keys, `vocab_size` and `max_seq_len` partrain's); partrain seeds
torch's generator with `train.seed` before calling it, so that every layout starts from the same
weights. The module's contract, the one the built-in model keeps:

- `forward(tokens: LongTensor[batch, seq]) -> logits[batch, seq, vocab]` (under tp: this rank's
  vocabulary shard, when the plan splits the head with "vocab_head"), called with the tokens as
  its one positional argument and nothing else (other arguments need defaults);
- optional `tensor_parallel_plan() -> {module name: style}` (partrain.models.tp_plan.STYLES:
  colwise, rowwise, vocab, vocab_head, norm, replicated, region, attention, head_norm) for
  `parallel.tp`;
- optional `layers` (an `nn.ModuleDict` of blocks, keyed "0", "1", ...) and
  `pipeline_chunk(layer_ids, first, last) -> nn.Module` (the given blocks; the embedding if first,
  else it takes hidden states; the head if last, else it returns hidden states) for `parallel.pp`;
  the hidden size that flows between stages is the model's `dim` attribute; the blocks are
  also FSDP's units, what `train.activation_checkpointing=full` recomputes and
  what `train.compile` compiles (a model without blocks is one unit, recomputed and compiled
  whole);
- optional `flops_per_token(seq_len) -> float` (training FLOPs, for MFU); else 6 x parameters.

What a model does not declare still trains with DDP, DeepSpeed ZeRO, FSDP2, checkpoints, resume
and metrics; tp and pp without a plan or a split are refused before anything starts, naming
what is missing (`check_user_model`), and so is a parameter shared between modules (one
Parameter under two names) that the layout would split into copies (partrain.models.shared),
and a forward that breaks its contract (partrain.models.forward: its signature, and its output
where the meta device can run it; else at the first step).

A registered family (`Family`, added with `register_family`) declares, besides its builder, what
partrain asks of a family from its config alone, without building it; None (or False) where it
has none:

- `count_params(model_cfg, active=False) -> int`: its parameters (`active`: those one token
  uses). `plan` and the checkpoint's disk estimate read it; without it, the model is built on
  the meta device and counted, as a user's model is;
- `flops_per_token(model_cfg, seq_len) -> float`: training FLOPs per token, for MFU and `plan`;
  without it, the model's own `flops_per_token(seq_len)`, else 6 x parameters, as a user's;
- `hf`: its Hugging Face adapter (`HfAdapter`: the config.json model_types it reads, its keys
  from config.json and back, the name map partrain <-> transformers and the per-weight
  conversion both ways), for `model.init_from=hf:DIR` and `export --format hf`; without it, both
  are refused naming the family;
- `moe`: whether model.moe and parallel.ep configure it; without it, they are refused;
- `documents`: whether its forward takes `documents=` (each token's document, batch x seq) for
  train.document_masking; without it, the key is refused.

The built-in `llama` declares them all: its counts are partrain.models.arith's (whose shape
arithmetic is also what lets `plan` model each stage's memory, collectives and step time: a
family counted otherwise is planned as a user's model is), its adapter partrain.models.llama_hf.
"""

import contextlib
import importlib
import io
import os
import re
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

from partrain.errors import ConfigError
from partrain.models import arith, llama_hf
from partrain.models.forward import forward_problems
from partrain.models.shared import check_shared_parameters

# torch is imported where a model is built: validation and `plan` import this module too.

TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class HfAdapter:
    """A family's weights as a transformers model's (the module docstring)."""
    model_types: tuple[str, ...]  # the config.json model_types an import reads
    keys: Callable  # (config.json as a dict, where) -> {model key: value}, refusing what it lacks
    config: Callable  # (model_cfg, dtype "fp32" | "bf16") -> the config.json an export writes
    name: Callable  # partrain parameter name (single-process model) -> transformers tensor name
    to_hf: Callable  # (name, weight, model_cfg) -> the weight as transformers holds it
    from_hf: Callable  # (name, weight, model_cfg) -> the weight as partrain's model holds it


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable  # (model_cfg, seed) -> the full model in fp32 on the CPU
    about: str
    count_params: Callable | None = None  # (model_cfg, active=False) -> parameters
    flops_per_token: Callable | None = None  # (model_cfg, seq_len) -> training FLOPs per token
    hf: HfAdapter | None = None  # model.init_from=hf:DIR and export --format hf
    moe: bool = False  # model.moe and parallel.ep configure it
    documents: bool = False  # its forward takes `documents=` (train.document_masking)


def _build_llama(model_cfg, seed: int):
    from partrain.models.llama import build_model

    return build_model(model_cfg, seed)


LLAMA_HF = HfAdapter(model_types=llama_hf.MODEL_TYPES, keys=llama_hf.model_keys,
                     config=llama_hf.hf_config, name=llama_hf.hf_name, to_hf=llama_hf.to_hf,
                     from_hf=llama_hf.from_hf)

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _build_llama, "Llama 2/3, Mistral, Qwen2/3 decoders and their "
                                          "mixtures of experts (model.moe)",
                    count_params=arith.count_params, flops_per_token=arith.flops_per_token,
                    hf=LLAMA_HF, moe=True, documents=True),
}


def register_family(family: Family) -> None:
    """Add a family under its name (a plugin's import registers it; model.family picks it)."""
    FAMILIES[family.name] = family


def is_user_model(model_cfg) -> bool:
    return bool(model_cfg.get("target"))


def family_of(model_cfg) -> Family | None:
    """The registered family `model_cfg` builds; None for a user's model (model.target)."""
    if is_user_model(model_cfg):
        return None
    name = model_cfg.get("family", "llama")
    if name not in FAMILIES:
        raise ConfigError(f"model.family={name} is not a registered family (known: "
                          f"{', '.join(sorted(FAMILIES))}); for your own nn.Module set "
                          "model.target=package.module:function")
    return FAMILIES[name]


def shape_modeled(model_cfg) -> bool:
    """Whether the planner's per-stage models (memory, activations, collectives, step time,
    --search) apply: they are partrain.models.arith's shape arithmetic, so only to a family that
    counts with it. Any other model is planned from its parameter count (partrain.plan.user)."""
    family = family_of(model_cfg)
    return family is not None and family.count_params is arith.count_params


def count_params(model_cfg, active: bool = False) -> int:
    """The model's parameters: its family's count from the config, else (a user's model, or a
    family without one) those of the model built on the meta device, all of them (a built model
    does not say which a token uses)."""
    family = family_of(model_cfg)
    if family is not None and family.count_params is not None:
        return family.count_params(model_cfg, active=active)
    return probe(model_cfg).params


def builds_offline(model_cfg) -> bool:
    """Whether sample and export can build this checkpoint's model: the built-in llama family
    (its KV cache, tied weights and rotary tables are what they use), not a user's model or
    another registered family."""
    return not model_cfg.get("target") and model_cfg.get("family", "llama") == "llama"


def hf_adapter(model_cfg, where: str) -> HfAdapter:
    """The family's Hugging Face adapter, or one ConfigError naming the family and what it lacks
    (`where`: the key or command that needs it)."""
    family = family_of(model_cfg)
    if family is None:
        raise ConfigError(f"{where}: model.target={model_cfg.target} is your own model; "
                          "Hugging Face import and export map a registered family's weights")
    if family.hf is None:
        raise ConfigError(f"{where}: model.family={family.name} declares no Hugging Face adapter "
                          "(Family.hf: the config.json model_types it reads and its name map), "
                          "so partrain cannot map its weights to or from transformers")
    return family.hf


def load_builder(target: str) -> Callable:
    """The callable `module:name` names, or a ConfigError saying why it cannot be used."""
    if not TARGET.match(target or ""):
        raise ConfigError(f"model.target={target} must be 'package.module:function' (a builder "
                          "importable from the workers' Python path)")
    module_name, _, attr = target.partition(":")
    # As `python -m` and torchrun's script do: the user's own modules import from where they run.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    said = io.StringIO()
    try:
        # What the import prints is held back: an argparse parser run at import prints its usage
        # (of partrain's arguments) before it exits; on success it is passed on.
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's import: its error
        raise ConfigError(f"model.target={target}: importing {module_name} failed: "
                          f"{_raised(e, said.getvalue())}") from None
    sys.stdout.write(said.getvalue())
    builder = getattr(module, attr, None)
    if not callable(builder):
        raise ConfigError(f"model.target={target}: {module_name} has no callable {attr!r}")
    return builder


def _raised(e: BaseException, printed: str = "") -> str:
    """What a user's code raised, said in a line; sys.exit() (it ended partrain with its own
    exit code, 0 or 3 included, and no word) as what it is."""
    if not isinstance(e, SystemExit):
        return f"{type(e).__name__}: {e}"
    last = next((line.strip() for line in reversed(printed.splitlines()) if line.strip()), "")
    parser = (" (an argparse parser run at import reads partrain's command line: parse under "
              "`if __name__ == \"__main__\":`)" if "usage:" in printed else "")
    return f"it called sys.exit({e.code!r}){parser}" + (f"; it printed: {last}" if last else "")


def build_family_model(model_cfg, seed: int):
    """The full model of `model_cfg` in fp32 on the CPU, its weights fixed by `seed`."""
    import torch
    from torch import nn

    # The process's generator starts from train.seed's state for every family (dropout and any
    # draw after the build), not only for a user's builder (a reviewer's two runs of the built-in
    # model saved other generator states).
    torch.manual_seed(seed)
    family = family_of(model_cfg)
    if family is not None:
        return family.build(model_cfg, seed)
    builder = load_builder(model_cfg.target)
    model = builder(model_cfg)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.target={model_cfg.target} returned a {type(model).__name__}, "
                        "not an nn.Module")
    return model.float()


@dataclass(frozen=True)
class UserModel:
    """What a user's model declares, learned by building it on the meta device (no memory)."""
    params: int
    tensor_parallel_plan: bool
    pipeline_split: bool
    blocks: int
    flops_per_token: bool
    # Under tp: its plan's weights split by rows (name, the size FSDP2 shards) and split biases
    # (tp_plan.fsdp_sharded), for the FSDP2 check once dp is known (validate_layout)
    tp_rows: tuple = ()
    tp_biases: tuple = ()


def probe(model_cfg) -> UserModel:
    """Build the user's model (or a registered family's) on the meta device and read what it
    declares."""
    return declared(build_on_meta(model_cfg))


def build_on_meta(model_cfg):
    """The user's model (or a registered family's) built on the meta device, or one ConfigError
    saying why it could not be."""
    import torch
    from torch import nn

    family = family_of(model_cfg)
    if family is None:
        what = f"model.target={model_cfg.target}"
        builder = load_builder(model_cfg.target)
        args = f" with model.args={dict(model_cfg.get('args') or {})}"
    else:
        what, args = f"model.family={family.name}", ""
        builder = partial(family.build, seed=0)  # the seed is moot: meta tensors hold no values
    try:
        with torch.device("meta"):
            model = builder(model_cfg)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's builder: its error
        raise ConfigError(f"{what}: the builder failed{args}: {_raised(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{what} returned a {type(model).__name__}, not an nn.Module")
    lazy = [name for name, p in model.named_parameters()
            if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:  # nn.LazyLinear and the like: their size is known only after a first forward
        raise ConfigError(f"{what}: {', '.join(lazy[:4])}{' ...' if len(lazy) > 4 else ''} "
                          "are lazy parameters (nn.LazyLinear and the like), whose shape comes "
                          "from a first forward: partrain shards, counts and checkpoints every "
                          "parameter before any forward; give each such layer its input size "
                          "(nn.Linear(in_features, out_features))")
    return model


def declared(model) -> UserModel:
    """What a built model declares (the module docstring's contract)."""
    from torch import nn

    layers = getattr(model, "layers", None)
    return UserModel(
        params=sum(p.numel() for p in model.parameters()),
        tensor_parallel_plan=callable(getattr(model, "tensor_parallel_plan", None)),
        pipeline_split=isinstance(layers, nn.ModuleDict)
        and callable(getattr(model, "pipeline_chunk", None))
        and isinstance(getattr(model, "dim", None), int),
        blocks=len(layers) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else 0,
        flops_per_token=callable(getattr(model, "flops_per_token", None)))


def check_user_model(cfg) -> UserModel | None:
    """A user's model against the layout, before anything starts: tp needs its plan, pp its split
    (and enough blocks), and what only the built-in family has is refused with the reason."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not is_user_model(m):
        if m.get("args"):
            raise ConfigError(f"model.args={dict(m.args)} are a user model's keys, but "
                              "model.target is unset: set model.target=package.module:function")
        check_family(cfg)
        return None
    model = build_on_meta(m)
    found = declared(model)
    needs = []
    if p.tp > 1 and not found.tensor_parallel_plan:
        needs.append(f"parallel.tp={p.tp} needs the model's tensor_parallel_plan() "
                     "(module name -> style)")
    elif p.tp > 1:
        from partrain.models.tp_plan import plan_problems

        needs += [f"its tensor-parallel plan at parallel.tp={p.tp}: {problem}"
                  for problem in plan_problems(model, p.tp, m.vocab_size)]
    if p.pp > 1 and not found.pipeline_split:
        needs.append(f"parallel.pp={p.pp} needs the model's `layers` (an nn.ModuleDict of "
                     "blocks), pipeline_chunk(layer_ids, first, last) and `dim` (the hidden "
                     "size between stages)")
    elif p.pp > 1 and found.blocks < p.pp * p.pp_virtual_stages:
        needs.append(f"parallel.pp={p.pp} x pp_virtual_stages={p.pp_virtual_stages} needs as "
                     f"many blocks; the model has {found.blocks}")
    for key, value, why in (
            ("parallel.cp", p.cp > 1, "context parallelism rewrites the built-in attention"),
            ("parallel.ep", p.ep > 1, "expert parallelism splits the built-in MoE"),
            ("model.moe.n_experts", m.moe.n_experts > 0, "model.moe configures the built-in MoE"),
            ("model.init_from=hf:", str(m.get("init_from") or "").startswith("hf:"),
             "Hugging Face import maps onto the built-in family"),
            ("train.activation_checkpointing=selective",
             t.activation_checkpointing == "selective",
             "selective recomputation knows the built-in blocks; use full"),
            ("train.document_masking", t.document_masking,
             "the built-in attention takes the documents' mask")):
        if value:
            needs.append(f"{key} is not for a user model: {why}")
    if p.tp > 1 and found.tensor_parallel_plan:
        from dataclasses import replace

        from partrain.models.tp_plan import fsdp_sharded

        rows, biases = fsdp_sharded(model)
        found = replace(found, tp_rows=rows, tp_biases=biases)
    needs += forward_problems(model, m)
    # The contract (docs/models.md): built in fp32; train.dtype sets the compute precision. One
    # built in bf16 trained bf16 weights under train.dtype=fp32 without a word.
    import torch

    low = sorted({str(param.dtype).removeprefix("torch.") for param in model.parameters()
                  if param.is_floating_point() and param.dtype != torch.float32})
    if low:
        needs.append(f"its builder makes {', '.join(low)} parameters; build the model in fp32 "
                     f"(train.dtype={t.dtype} sets the precision it computes in, and the "
                     "optimizer keeps fp32 weights)")
    if needs:
        raise ConfigError(f"model.target={m.target}: " + "; ".join(needs))
    check_shared_parameters(model, cfg, f"model.target={m.target}")
    return found


def check_family(cfg) -> None:
    """What a registered family does not declare, refused before anything starts: model.moe and
    parallel.ep without `moe`, model.init_from=hf: without `hf`."""
    m, p = cfg.model, cfg.parallel
    family = family_of(m)
    if str(m.get("init_from") or "").startswith("hf:"):
        hf_adapter(m, f"model.init_from={m.init_from}")
    if cfg.train.document_masking and not family.documents:
        raise ConfigError(f"train.document_masking=true: model.family={family.name} declares no "
                          "document mask (Family.documents: its forward takes documents=); "
                          "leave it false")
    if not family.moe:
        for key, value, used in (("parallel.ep", p.ep, p.ep > 1),
                                 ("model.moe.n_experts", m.moe.n_experts, m.moe.n_experts > 0)):
            if used:
                raise ConfigError(f"{key}={value}: model.family={family.name} declares no "
                                  "mixture of experts (Family.moe), which model.moe and "
                                  "parallel.ep configure; leave them unset")


def model_flops_per_token(model_cfg, model, seq_len: int, params: int) -> float:
    """Training FLOPs per token, for MFU: the family's count from the config, else what a user's
    model gives (user_flops_per_token)."""
    family = family_of(model_cfg)
    if family is not None and family.flops_per_token is not None:
        return float(family.flops_per_token(model_cfg, seq_len))
    return user_flops_per_token(model, seq_len, params)


def user_flops_per_token(model, seq_len: int, params: int) -> float:
    """Training FLOPs per token of a user's model: its own count, else 6 x parameters (the
    matrix multiplies of forward and backward, attention's score FLOPs left out)."""
    count = getattr(model, "flops_per_token", None)
    return float(count(seq_len)) if callable(count) else 6.0 * params


def blocks(model) -> list:
    """The model's blocks: the built-in TransformerBlocks, or a user model's `layers` (under pp,
    this rank's chunks' layers)."""
    from torch import nn

    from partrain.models.llama import TransformerBlock

    found = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if found:
        return found
    roots = list(model.chunks) if isinstance(getattr(model, "chunks", None), nn.ModuleList) \
        else [model]
    out = []
    for root in roots:
        layers = getattr(root, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            out.extend(layers.values())
        elif isinstance(layers, nn.ModuleList):
            out.extend(layers)
    return out


def recompute_full(block) -> None:
    """A user block recomputed in backward (train.activation_checkpointing=full): its forward
    runs under torch.utils.checkpoint (non-reentrant), its parameters keep their names."""
    from torch.utils.checkpoint import checkpoint

    inner = block.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward

"""Does a layout fit its GPUs, and what does it cost there: `partrain plan` on a GPU target
(`launcher.device=cuda`, or `--hardware`) and `partrain launch`'s refusal on CUDA.

Memory is the memory model's peak per pipeline stage (memory_model.memory_per_stage, as `plan`
prints it, on the GPU: the compute dtype and ZeRO-Offload as a CUDA run has them). A stage fits
when its peak is within USABLE_FRACTION of the device; one that does not gets the mildest changes
that would make every stage fit (a smaller micro-batch at the same global batch, activation
checkpointing, a ZeRO stage, more tp or pp at the same world size), each checked by partrain's own
validation and priced by the memory model and, with a hardware, by the time model
(time_model.step_time: the search's own code path), cheapest first. `launch` refuses a layout
whose prediction exceeds the device by more than MODEL_ERROR unless
`launcher.allow_predicted_oom=true`.
"""

import copy
import dataclasses
import itertools

from omegaconf import DictConfig, OmegaConf, open_dict

from partrain.config.resolve import World, compute_dtype
from partrain.config.validate import resolve_and_validate
from partrain.errors import ConfigError
from partrain.parallel.mesh import ParallelDims
from partrain.plan.hardware import Hardware
from partrain.plan.layout import stage_plan
from partrain.plan.memory_model import MODEL_ERROR, USABLE_FRACTION, memory_per_stage
from partrain.plan.time_model import Layout, step_time

GIB = 2**30
DEFAULT_HARDWARE = "H100-SXM"  # what `plan` checks and prices on when --hardware is not given
CHECKPOINTING = ("none", "selective", "full")
FIXES_SHOWN = 4


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def on_gpu(cfg: DictConfig) -> DictConfig:
    """A copy of a resolved config as a CUDA run has it (`auto` dtype = bf16, offload on the
    host), whatever launcher.device says: the target is a GPU."""
    view = copy.deepcopy(cfg)
    with open_dict(view):
        view.launcher.device = "cuda"
    return view


def stage_peaks(cfg: DictConfig) -> list[dict]:
    """The memory model's peak per pp rank of a resolved config, on a GPU."""
    view = on_gpu(cfg)
    p = view.parallel
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, cp=p.cp, ep=p.ep)
    return memory_per_stage(view, dims, stage_plan(view, dims),
                            compute_dtype(view.train.dtype, True))


def layout_of(cfg: DictConfig) -> Layout:
    """The time model's description of a resolved config's layout."""
    p, t = cfg.parallel, cfg.train
    return Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero_stage=p.zero_stage,
                  sequence_parallel=bool(p.sequence_parallel) and p.tp > 1,
                  pp_schedule=p.pp_schedule,
                  pp_virtual_stages=p.pp_virtual_stages if p.pp > 1 else 1,
                  micro_batch_size=t.micro_batch_size,
                  activation_checkpointing=t.activation_checkpointing,
                  offload_optimizer=p.offload_optimizer, cp_method=p.cp_method,
                  zero_backend=p.zero_backend if p.zero_stage else "deepspeed",
                  dp_replicate=p.dp_replicate,
                  pp_layers=tuple(p.pp_layers) if p.pp > 1 and p.get("pp_layers") else None)


def price(cfg: DictConfig, hw: Hardware) -> dict:
    """One step of a resolved config's layout on `hw` by the time model: seconds by part,
    tokens/s per job and per GPU, MFU and what limits it."""
    t = cfg.train
    layout = layout_of(cfg)
    dtype = compute_dtype(t.dtype, True)
    timing = step_time(cfg.model, layout, t.global_batch_size, t.seq_len, hw,
                       low_precision=dtype != "fp32")
    return {"hardware": hw.name, "gpus": layout.world_size, "gpus_per_node": hw.gpus_per_node,
            "dtype": dtype, "global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
            "tokens_per_step": t.global_batch_size * t.seq_len, **timing,
            "tokens_per_s_per_job": timing["tokens_per_s"],
            "tokens_per_s_per_gpu": timing["tokens_per_s"] / layout.world_size}


def _stage_ranks(cfg: DictConfig, pp_rank: int) -> str:
    """The global ranks of a pp rank (pp is the outermost dimension of the mesh)."""
    p = cfg.parallel
    size = p.dp * p.cp * p.tp
    first = pp_rank * size
    return f"rank {first}" if size == 1 else f"ranks {first}-{first + size - 1}"


def _families(cfg: DictConfig) -> list[list[dict]]:
    """The changes that lower memory, each family mildest first, as key -> value overrides."""
    p, t = cfg.parallel, cfg.train
    mb = [{"train.micro_batch_size": b, "train.micro_batches": None}
          for b in range(t.micro_batch_size - 1, 0, -1) if t.micro_batch_size % b == 0]
    ckpt = [{"train.activation_checkpointing": mode}
            for mode in CHECKPOINTING[CHECKPOINTING.index(t.activation_checkpointing) + 1:]]
    zero = [{"parallel.zero_stage": s} for s in range(p.zero_stage + 1, 4)]
    tp = [{"parallel.tp": p.tp * k, "parallel.dp": p.dp // k, "parallel.sequence_parallel": True,
           "train.micro_batches": None}
          for k in (2, 4, 8) if p.dp % k == 0]
    pp = [{"parallel.pp": p.pp * k, "parallel.dp": p.dp // k, "train.micro_batches": None}
          for k in (2, 4, 8) if p.dp % k == 0]
    return [f for f in (mb, ckpt, zero, tp, pp) if f]


def _try(cfg: DictConfig, world: World, change: dict) -> DictConfig | None:
    """The resolved config with `change`, or None if partrain's validation refuses it."""
    variant = copy.deepcopy(cfg)
    with open_dict(variant):
        for key, value in change.items():
            OmegaConf.update(variant, key, value)
    try:
        resolve_and_validate(variant, world)
    except ConfigError:
        return None
    return variant


def _label(change: dict, variant: DictConfig) -> str:
    shown = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items()
             if v is not None and not (k == "parallel.sequence_parallel" and
                                       variant.parallel.tp == 1)]
    derived = []
    if "train.micro_batches" in change:
        derived.append(f"{variant.train.micro_batches} micro-batches")
    if "parallel.dp" in change:
        derived.append(f"dp {variant.parallel.dp}")
    return " ".join(shown) + (f" ({', '.join(derived)})" if derived else "")


def fixes(cfg: DictConfig, world: World, usable: float, hw: Hardware | None) -> list[dict]:
    """The mildest change of each family that makes every stage fit in `usable` bytes; if no
    single change does, the mildest pair of changes from two families. Cheapest first: by the
    time model's tokens/s with a hardware, else by memory."""
    families = _families(cfg)
    found = []

    def attempt(change: dict) -> bool:
        variant = _try(cfg, world, change)
        if variant is None:
            return False
        peak = max(s["total"] for s in stage_peaks(variant))
        if peak > usable:
            return False
        fix = {"overrides": {k: v for k, v in change.items() if v is not None},
               "label": _label(change, variant), "peak_bytes": peak}
        if hw is not None:
            timing = price(variant, hw)
            fix["tokens_per_s_per_gpu"] = timing["tokens_per_s_per_gpu"]
            fix["step_s"] = timing["step_s"]
        found.append(fix)
        return True

    for family in families:
        any(attempt(change) for change in family)
    if not found:
        for a, b in itertools.combinations(families, 2):
            any(attempt({**x, **y}) for x, y in itertools.product(a, b))
    found.sort(key=lambda f: -f["tokens_per_s_per_gpu"] if hw is not None else f["peak_bytes"])
    return found[:FIXES_SHOWN]


def check_fit(cfg: DictConfig, world: World, device_bytes: float, device: str,
              hw: Hardware | None = None) -> dict:
    """Each pp rank's predicted peak against the device's memory, and the fixes if one does
    not fit (cfg resolved and validated)."""
    usable = USABLE_FRACTION * device_bytes
    refuse_above = (1 + MODEL_ERROR) * device_bytes
    stages = [{"pp_rank": s["pp_rank"], "ranks": _stage_ranks(cfg, s["pp_rank"]),
               "peak_bytes": s["total"], "largest": s["largest"],
               "fits": s["total"] <= usable, "certain_oom": s["total"] > refuse_above}
              for s in stage_peaks(cfg)]
    fits = all(s["fits"] for s in stages)
    return {"device": device, "device_bytes": device_bytes, "usable_fraction": USABLE_FRACTION,
            "usable_bytes": usable, "model_error": MODEL_ERROR,
            "refuse_above_bytes": refuse_above, "stages": stages, "fits": fits,
            "certain_oom": any(s["certain_oom"] for s in stages),
            "fixes": [] if fits else fixes(cfg, world, usable, hw)}


def _fix_text(fix: dict) -> str:
    speed = (f", {fix['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
             if "tokens_per_s_per_gpu" in fix else "")
    return f"{fix['label']}: {gib(fix['peak_bytes'])}{speed}"


def fixes_text(fit: dict) -> str:
    if not fit["fixes"]:
        return ("no change of the micro-batch, activation checkpointing, ZeRO stage, tp or pp "
                "(alone or two together) fits it: use more or larger GPUs")
    return ("would fit (the largest stage's peak, by the memory model" +
            (", cheapest first" if "tokens_per_s_per_gpu" in fit["fixes"][0] else "") + "): " +
            "; ".join(_fix_text(f) for f in fit["fixes"]))


def fit_warnings(fit: dict) -> list[str]:
    """One warning per pp rank that does not fit, then the fixes."""
    if fit["fits"]:
        return []
    where = (f"{fit['usable_fraction']:.0%} of {fit['device']}'s {gib(fit['device_bytes'])}"
             f" ({gib(fit['usable_bytes'])})")
    lines = [f"pp rank {s['pp_rank']} ({s['ranks']}): predicted peak {gib(s['peak_bytes'])} "
             f"(largest part: {s['largest'].removesuffix('_bytes').replace('_', ' ')}) does not "
             f"fit in {where}" for s in fit["stages"] if not s["fits"]]
    return lines + [fixes_text(fit)]


def refusal(fit: dict) -> str:
    """`launch`'s one message for a layout the model says cannot fit."""
    worst = max(fit["stages"], key=lambda s: s["peak_bytes"])
    return (f"predicted out of memory: pp rank {worst['pp_rank']} ({worst['ranks']}) needs "
            f"{gib(worst['peak_bytes'])} at its peak by partrain's memory model, and this GPU "
            f"({fit['device']}) has {gib(fit['device_bytes'])}: more than the model's "
            f"{fit['model_error']:.0%} error above it; {fixes_text(fit)}; or set "
            "launcher.allow_predicted_oom=true to start it anyway")


def target(hw: Hardware, world: World) -> Hardware:
    """The hardware as the plan's world lays it out: its ranks per node are the node size."""
    return dataclasses.replace(hw, gpus_per_node=world.nproc_per_node)


# What plan assumes of train.float8, with what one GPU measured (docs/performance.md, issue 33).
FLOAT8_UNPRICED = ("train.float8=true is priced as bf16: the time and memory above are bf16's; on "
                   "one H200 (the Llama-3.2-1B shape, compiled) FP8 measured 1.11x bf16's "
                   "tokens/s tensorwise and 0.92x rowwise, both at 0.88x its peak memory; "
                   "torchao expects more where the matmuls are larger")


def on_hardware(plan: dict, cfg: DictConfig, world: World, hw: Hardware, source: str) -> None:
    """`plan` on a GPU target: the fit of every stage (its warnings with the plan's) and the
    step's price, on `hw` laid out as the plan's world (its ranks per node are the node). A plan
    without the built-in shape arithmetic (plan.user) has neither: it says so already."""
    if "not_modeled" in plan:
        return
    hw = target(hw, world)
    fit = check_fit(cfg, world, hw.memory_bytes, hw.name, hw)
    plan["fit"] = {**fit, "hardware_source": source}
    plan["time"] = {**price(cfg, hw), "hardware_source": source}
    plan["warnings"] = [*plan["warnings"], *fit_warnings(fit)]
    if cfg.train.get("float8"):
        plan["warnings"].append(FLOAT8_UNPRICED)

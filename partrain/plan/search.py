"""`partrain plan --search`: every layout partrain can run for a model on N GPUs, ranked.

Enumerated: tp (every degree dividing the heads, kv heads, MLP and vocabulary, dividing a node's
GPUs or two whole nodes), pp (dividing the layers; 1F1B, and interleaved with every chunk count per rank up to
MAX_CHUNKS_PER_RANK that splits the layers evenly), cp (2 to 8, where the sequence divides, by
the config's parallel.cp_method), ep (MoE models: dividing the experts and dp), dp the rest,
ZeRO 0-3 (ZeRO-2/3 not with pp or sequence parallelism, ZeRO-3 not with ep), the micro-batch
size, activation checkpointing none / selective / full, and ZeRO-Offload of the optimizer. Sequence
parallelism is on whenever tp > 1 (same traffic, less memory). The config's
parallel.dp_replicate (HSDP) is kept: with it, only FSDP2's layouts whose dp it divides.

Each candidate's peak memory per GPU comes from the memory model (memory_model.py, the
schedule's in-flight micro-batches by the formula rather than a simulation) and its step time from
the time model (time_model.py). Those that fit in the GPU's memory (less a margin for the CUDA
libraries and fragmentation) are ranked by predicted tokens/s; the best few are then checked by
partrain's own validation, exactly as `partrain launch` would check them.
"""

import itertools
import math
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf

from partrain.config.resolve import compute_dtype
from partrain.config.validate_layout import MAX_PIPELINE_CHUNKS
from partrain.models.arith import ffn_dim, moe_enabled
from partrain.parallel.mesh import ParallelDims
from partrain.plan.explain import explained
from partrain.plan.fit import CHECKPOINTING
from partrain.plan.hardware import Hardware
from partrain.plan.layout import stage_plan
from partrain.plan.memory_model import USABLE_FRACTION, memory_per_stage
from partrain.plan.time_model import Layout, step_time, virtual_stage_counts

# The share of the GPU's memory a layout may use (the rest: the CUDA context and libraries'
# workspaces, the caching allocator's fragmentation); `plan`'s fit warnings use the same.
MEMORY_MARGIN = USABLE_FRACTION
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
CP_DEGREES = tuple(range(1, 9))
# Interleaved 1F1B's chunks per rank, v: the bubble, (p-1)/(v m + p-1), shrinks about as 1/v
# while every chunk sends its activations (sends grow as v), and each v is one more schedule to
# price. At v = 8 the bubble is under 1/9 of the step even with the fewest micro-batches
# interleaving takes (m = p), so more chunks buy little and cost sends. The layers rarely allow
# many more anyway: 80 layers on pp=8 allow v in {2, 5, 10}.
MAX_CHUNKS_PER_RANK = 8


@dataclass
class Candidate:
    layout: Layout
    memory_bytes: float
    memory_largest: str
    time: dict
    config: object = None  # the composed config, once partrain's validation accepted it

    def overrides(self) -> list[str]:
        """The config keys that set this layout (for `launch`, `plan` and the validation)."""
        L = self.layout
        return [f"parallel.dp={L.dp}", f"parallel.tp={L.tp}", f"parallel.pp={L.pp}",
                f"parallel.cp={L.cp}", f"parallel.ep={L.ep}", f"parallel.zero_stage={L.zero_stage}",
                f"parallel.zero_backend={L.zero_backend}",
                f"parallel.sequence_parallel={str(L.sequence_parallel).lower()}",
                f"parallel.pp_schedule={L.pp_schedule}",
                f"parallel.pp_virtual_stages={L.pp_virtual_stages}", "parallel.pp_layers=null",
                f"parallel.offload_optimizer={L.offload_optimizer}",
                f"parallel.cp_method={L.cp_method}", f"parallel.dp_replicate={L.dp_replicate}",
                f"train.micro_batch_size={L.micro_batch_size}", "train.micro_batches=null",
                f"train.activation_checkpointing={L.activation_checkpointing}"]

    def describe(self) -> str:
        L = self.layout
        parts = [f"dp{L.dp}"] + [f"{k}{getattr(L, k)}" for k in ("tp", "pp", "cp", "ep")
                                 if getattr(L, k) > 1]
        text = " x ".join(parts)
        if L.sequence_parallel:
            text += " +sp"
        if L.pp > 1:
            text += (f" interleaved v{L.pp_virtual_stages}" if L.pp_virtual_stages > 1
                     else " 1f1b")
        if L.zero_stage:
            engine = "FSDP" if L.zero_backend == "fsdp" else "ZeRO-"
            text += f", {engine}{L.zero_stage}" + (" + offload" if L.offload_optimizer != "none"
                                                   else "")
        text += f", mb {L.micro_batch_size}"
        if L.activation_checkpointing != "none":
            text += f", {L.activation_checkpointing} ckpt"
        return text

    def as_dict(self) -> dict:
        return {"layout": asdict(self.layout), "describe": self.describe(),
                "memory_bytes": self.memory_bytes, "memory_largest": self.memory_largest,
                **{k: v for k, v in self.time.items()},
                "tokens_per_s_per_job": self.time.get("tokens_per_s"),
                "tokens_per_s_per_gpu": self.per_gpu()}

    def per_gpu(self) -> float | None:
        """Tokens/s of one GPU: the job's over its world size."""
        return (self.time["tokens_per_s"] / self.layout.world_size
                if "tokens_per_s" in self.time else None)


def _divisors(n: int, limit: int) -> list[int]:
    """The divisors of n up to `limit`, in order, in O(sqrt(n)) steps (n may be any size: the
    search runs before the validation that bounds the config's keys)."""
    found = set()
    for d in range(1, min(math.isqrt(n), limit) + 1):
        if n % d == 0:
            found.update(x for x in (d, n // d) if x <= limit)
    return sorted(found)


def _tp_degrees(m, hw: Hardware, gpus: int) -> list[int]:
    """Every tp dividing the heads, kv heads, MLP and vocabulary (3 and 6 too: partrain's tp
    takes any such degree) and --gpus, whose groups fill nodes evenly: dividing a node's GPUs,
    or two whole nodes (a group across a node's edge is slow, and 48 heads' dozen divisors made
    a search 7 to 14 times longer)."""
    per_node = min(gpus, hw.gpus_per_node)
    common = math.gcd(m.n_heads, m.n_kv_heads, ffn_dim(m), m.vocab_size)
    return [t for t in _divisors(common, min(gpus, 2 * hw.gpus_per_node))
            if gpus % t == 0 and (per_node % t == 0 or t == 2 * per_node)]


def _chunk_counts(n_layers: int, pp: int) -> list[int]:
    """The interleaved schedule's chunks per rank the search tries for pp stages."""
    return virtual_stage_counts(n_layers, pp,
                                min(MAX_PIPELINE_CHUNKS, pp * MAX_CHUNKS_PER_RANK))


def layouts(model_cfg, gpus: int, hw: Hardware, global_batch_size: int, seq_len: int,
            cp_method: str = "ring", dp_replicate: int = 1):
    """Every layout of the space above that the validation rules allow (cp by `cp_method`; HSDP
    with `dp_replicate` replicas where it is above 1)."""
    moe = moe_enabled(model_cfg)
    pps = _divisors(model_cfg.n_layers, min(gpus, MAX_PIPELINE_CHUNKS))
    for tp, pp, cp in itertools.product(_tp_degrees(model_cfg, hw, gpus), pps, CP_DEGREES):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        if cp > 1 and (seq_len % (2 * cp) or cp * tp > seq_len):
            continue
        if cp > 1 and cp_method == "all_to_all" and any(
                (heads // tp) % cp for heads in (model_cfg.n_heads, model_cfg.n_kv_heads)):
            continue  # each cp rank takes 1/cp of a tp rank's heads
        if dp % dp_replicate:
            continue
        if tp > 1 and seq_len % (tp * cp):
            continue
        # ep divides both dp and the experts: the divisors of their greatest common divisor.
        eps = _divisors(math.gcd(dp, model_cfg.moe.n_experts), dp) if moe else [1]
        schedules = [("1f1b", 1)] + [("interleaved_1f1b", v)
                                     for v in _chunk_counts(model_cfg.n_layers, pp)]
        for mb in MICRO_BATCH_SIZES:
            if global_batch_size % (mb * dp):
                continue
            m = global_batch_size // (mb * dp)
            if pp > 1 and m < pp:
                continue
            for (schedule, v), ep, zero, ckpt in itertools.product(
                    schedules, eps, (0, 1, 2, 3), CHECKPOINTING):
                if schedule == "interleaved_1f1b" and m % pp:
                    continue
                for backend in _zero_backends(zero, tp, pp, ep, dp_replicate > 1):
                    for offload in (("none", "cpu") if zero else ("none",)):
                        yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
                                     sequence_parallel=tp > 1, pp_schedule=schedule,
                                     pp_virtual_stages=v, micro_batch_size=mb,
                                     activation_checkpointing=ckpt, offload_optimizer=offload,
                                     zero_backend=backend, cp_method=cp_method,
                                     dp_replicate=dp_replicate)


def _zero_backends(zero: int, tp: int, pp: int, ep: int, hsdp: bool = False) -> list[str]:
    """The engines that can run ZeRO stage `zero` with these degrees: DeepSpeed's ZeRO-2/3 not
    with pp or sequence parallelism, its ZeRO-3 not with ep; FSDP2 at stages 2 and 3, with
    every degree (under pp one stage is enough: it gathers once a step either way). HSDP
    (`hsdp`): FSDP2's alone."""
    engines = []
    if not (zero >= 2 and (pp > 1 or tp > 1) or zero == 3 and ep > 1 or hsdp):
        engines.append("deepspeed")
    if zero == 3 or zero == 2 and pp == 1:
        engines.append("fsdp")
    return engines


def _memory(model, layout: Layout, global_batch_size: int, seq_len: int, stages_cache: dict,
            dtype: str = "bf16", optim=None) -> dict:
    """The largest rank's peak bytes by the memory model (no schedule simulation), with
    `optim`'s state (the config's optim section; None: AdamW's)."""
    L = layout
    dims = ParallelDims(pp=L.pp, dp=L.dp, tp=L.tp, cp=L.cp, ep=L.ep)
    key = (L.tp, L.pp, L.pp_virtual_stages, L.ep)
    if key not in stages_cache:  # plan's own stage list, for the keys it reads
        stages_cache[key] = stage_plan(SimpleNamespace(
            model=model, parallel=SimpleNamespace(pp_virtual_stages=L.pp_virtual_stages,
                                                  pp_layers=None, ep=L.ep)), dims)
    m = global_batch_size // (L.micro_batch_size * L.dp)
    view = SimpleNamespace(
        model=model, launcher=SimpleNamespace(device="cuda"), optim=optim,
        parallel=SimpleNamespace(zero_stage=L.zero_stage, zero_backend=L.zero_backend,
                                 sequence_parallel=L.sequence_parallel,
                                 cp_method=L.cp_method, pp_virtual_stages=L.pp_virtual_stages,
                                 dp_replicate=L.dp_replicate,
                                 pp_schedule=L.pp_schedule, offload_optimizer=L.offload_optimizer),
        train=SimpleNamespace(micro_batch_size=L.micro_batch_size, seq_len=seq_len,
                              micro_batches=m, activation_checkpointing=L.activation_checkpointing))
    per_stage = memory_per_stage(view, dims, stages_cache[key], dtype, simulate=False)
    return max(per_stage, key=lambda s: s["total"])


# Predictions within this factor of each other are a tie, broken toward the simpler layout: the
# model does not see DeepSpeed's own overheads (at dp=1 ZeRO-1/2/3 measured 0.96/0.83/0.36 of DDP
# on an H100, README "On GPUs"), nor a degree's cost in debugging.
TIE = 1.01


def fp16_can_run(layout: Layout) -> bool:
    """fp16 needs DeepSpeed's loss scaler: ZeRO by DeepSpeed, and no pp, whose backward does
    not go through it (partrain/config/validate_layout.py's rules). The search priced every
    layout and validated its 40 best: under fp16 none passed where valid ones fit."""
    return layout.zero_stage > 0 and layout.zero_backend == "deepspeed" and layout.pp == 1


def _simpler(c: Candidate) -> tuple:
    L = c.layout
    return (L.zero_stage > 0, L.offload_optimizer != "none",
            CHECKPOINTING.index(L.activation_checkpointing), L.pp, L.cp, L.tp, L.zero_stage,
            L.pp_virtual_stages, -L.micro_batch_size)


RANKED_BY_TIE = 200  # the head of the list, ranked by the tie rule; the rest by tokens/s


def _ranked(fits: list[Candidate]) -> list[Candidate]:
    """By predicted tokens/s; among the layouts within TIE (1%) of the fastest left, the
    simplest first. (Fixed 1% buckets of log tokens/s put a layout 0.45% faster but not simpler
    first when the two fell on either side of a bucket's edge.)"""
    left = sorted(((-c.time["tokens_per_s"], _simpler(c), i, c) for i, c in enumerate(fits)),
                  key=lambda row: row[:3])
    out = []
    while left and len(out) < RANKED_BY_TIE:
        fastest = -left[0][0]
        near = 0
        while near < len(left) and -left[near][0] * TIE >= fastest:
            near += 1
        out.append(left.pop(min(range(near), key=lambda i: left[i][1])))
    return [row[3] for row in out + left]


def search(cfg, gpus: int, hw: Hardware, top: int = 10, explain: dict | None = None) -> dict:
    """Rank every layout for `cfg`'s model and batch on `gpus` GPUs of `hw`; cfg is composed
    (its parallel and micro-batch keys are ignored: the search sets them). The compute dtype is
    train.dtype's on CUDA (`auto`: bf16). `explain` (Layout fields -> values, explain.parse_explain)
    also collects every enumerated layout that has those values, fitting or not."""
    start = time.perf_counter()
    t = cfg.train
    # Plain attribute access: the model config is read millions of times.
    model = OmegaConf.to_object(cfg.model) if isinstance(cfg.model, DictConfig) else cfg.model
    seq_len, gbs = t.seq_len, t.global_batch_size
    dtype = compute_dtype(t.dtype, True)
    budget = hw.memory_bytes * MEMORY_MARGIN
    stages_cache: dict = {}
    fits, counted, too_big, matching = [], 0, None, []
    p = cfg.parallel
    optim = SimpleNamespace(name=cfg.optim.name, momentum=cfg.optim.momentum)
    for layout in layouts(model, gpus, hw, gbs, seq_len, p.cp_method, p.dp_replicate):
        if dtype == "fp16" and not fp16_can_run(layout):
            continue
        counted += 1
        mem = _memory(model, layout, gbs, seq_len, stages_cache, dtype, optim)
        wanted = explain is not None and all(getattr(layout, k) == v for k, v in explain.items())
        if mem["total"] > budget:
            if too_big is None or mem["total"] < too_big.memory_bytes:
                too_big = Candidate(layout, mem["total"], mem["largest"], {})
            if wanted:
                matching.append(Candidate(layout, mem["total"], mem["largest"], {}))
            continue
        timing = step_time(model, layout, gbs, seq_len, hw, low_precision=dtype != "fp32")
        fits.append(Candidate(layout, mem["total"], mem["largest"], timing))
        if wanted:
            matching.append(fits[-1])
    fits = _ranked(fits)
    return {"gpus": gpus, "hardware": asdict(hw), "candidates": counted, "fit": len(fits),
            "best": fits[:top], "smallest_that_does_not_fit": too_big,
            "seconds": time.perf_counter() - start, "dtype": dtype,
            "global_batch_size": gbs, "seq_len": seq_len,
            "explain": None if explain is None else explained(
                explain, matching, fits, budget, TIE, None if matching else
                _why_not_enumerated(explain, model, gpus, hw, gbs, seq_len, dtype,
                                    p.cp_method, p.dp_replicate))}


def _why_not_enumerated(want: dict, model, gpus: int, hw: Hardware, gbs: int, seq_len: int,
                        dtype: str = "bf16", cp_method: str = "ring",
                        dp_replicate: int = 1) -> str:
    """The search's rule (or partrain's) that leaves no layout with the asked values (--explain,
    explain.py). It restates layouts()'s rules, so it lives beside them."""
    if dtype == "fp16" and (want.get("pp", 1) > 1 or want.get("zero_stage", 1) == 0 or
                            want.get("zero_backend", "deepspeed") != "deepspeed"):
        return ("train.dtype=fp16 needs DeepSpeed's loss scaler: ZeRO by DeepSpeed (zero >= 1, "
                "zero_backend=deepspeed) and pp=1")
    tp, pp, cp = want.get("tp", 1), want.get("pp", 1), want.get("cp", 1)
    tps, pps = _tp_degrees(model, hw, gpus), _divisors(model.n_layers, min(gpus, MAX_PIPELINE_CHUNKS))
    if "tp" in want and tp not in tps:
        return (f"tp={tp} is not one the search tries for this model on {gpus} GPUs ({tps}): tp "
                f"must divide model.n_heads={model.n_heads}, model.n_kv_heads="
                f"{model.n_kv_heads}, the MLP size {ffn_dim(model)} and model.vocab_size="
                f"{model.vocab_size} and --gpus {gpus}, and divide a node's GPUs or be two "
                "whole nodes "
                f"({2 * hw.gpus_per_node} GPUs)")
    if "pp" in want and pp not in pps:
        return f"pp={pp} must divide model.n_layers={model.n_layers} (pp in {pps})"
    v, schedule = want.get("pp_virtual_stages", 1), want.get("pp_schedule")
    if v > 1 and schedule not in (None, "interleaved_1f1b"):
        return f"v={v} chunks per rank needs schedule=interleaved_1f1b"
    if v > 1 or schedule == "interleaved_1f1b":
        if "pp" in want and pp == 1:
            return "interleaved 1F1B (v chunks per rank) needs pp > 1"
        counts = {p: _chunk_counts(model.n_layers, p)
                  for p in ([pp] if "pp" in want else pps) if p > 1}
        if not any(v in c if v > 1 else c for c in counts.values()):
            return (f"the search tries interleaved 1F1B with the chunks per rank v that split "
                    f"model.n_layers={model.n_layers} evenly over pp * v chunks, v at most "
                    f"{MAX_CHUNKS_PER_RANK}: "
                    + ", ".join(f"pp={p}: v in {c}" for p, c in counts.items()))
    if "cp" in want and (cp not in CP_DEGREES or cp > 1 and seq_len % (2 * cp)):
        return (f"cp={cp} must be 1 to {CP_DEGREES[-1]} and split train.seq_len={seq_len} "
                "into 2 * cp chunks")
    if gpus % (tp * pp * cp):
        return f"tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp} must divide --gpus {gpus}"
    if cp > 1 and cp_method == "all_to_all" and any((heads // tp) % cp for heads in (
            model.n_heads, model.n_kv_heads)):
        return (f"parallel.cp_method=all_to_all gives each cp rank 1/cp of a tp rank's heads: "
                f"cp={cp} must divide model.n_heads={model.n_heads} and model.n_kv_heads="
                f"{model.n_kv_heads} over tp={tp}")
    if "dp" in want and dp_replicate > 1 and want["dp"] % dp_replicate:
        return (f"parallel.dp_replicate={dp_replicate} (HSDP) must divide dp={want['dp']}: the "
                "search keeps the config's replicas")
    if tp > 1 and seq_len % (tp * cp):
        return (f"tp({tp}) * cp({cp}) = {tp * cp} must divide train.seq_len={seq_len}: the "
                "search runs tp with sequence parallelism, which splits each cp rank's share "
                "over tp")
    dp = gpus // (tp * pp * cp)
    if "dp" in want and want["dp"] != dp and all(k in want for k in ("tp", "pp", "cp")):
        return f"dp is what is left: {gpus} / (tp * pp * cp) = {dp}, not {want['dp']}"
    if "dp" in want and gpus % want["dp"]:
        return f"dp={want['dp']} must divide --gpus {gpus}"
    mb = want.get("micro_batch_size")
    if mb is not None and mb not in MICRO_BATCH_SIZES:
        return f"the search tries micro-batch sizes {list(MICRO_BATCH_SIZES)}, not {mb}"
    dp = want.get("dp", dp)
    if gbs % dp or gbs < dp * max(1, pp):
        return (f"train.global_batch_size={gbs} cannot be shared by dp={dp}"
                + (f" with at least pp={pp} micro-batches each" if pp > 1 else "")
                + f": it needs a multiple of {dp * max(1, pp)} sequences")
    zero = want.get("zero_stage", 0)
    if want.get("zero_backend") == "fsdp" and zero < 2:
        return "FSDP runs ZeRO stages 2 and 3"
    if want.get("zero_backend") == "fsdp" and zero == 2 and pp > 1:
        return "under pp FSDP's stages 2 and 3 are one: the search tries zero=3"
    if zero >= 2 and (pp > 1 or tp > 1) and want.get("zero_backend") != "fsdp":
        return (f"DeepSpeed's ZeRO-{zero} does not go with pp > 1 or tp > 1 (sequence "
                "parallelism); FSDP (zero_backend=fsdp) goes with both"
                + (", under pp at zero=3 (its stages 2 and 3 are one there)"
                   if pp > 1 and zero == 2 else ""))
    if zero > 3:
        return f"zero={zero}: ZeRO stages are 0 to 3"
    if want.get("ep", 1) > 1 and not moe_enabled(model):
        return "ep > 1 needs a mixture-of-experts model"
    return ("no layout the search enumerates has all of these values together (see `partrain "
            "plan --help` and docs/planner.md for the space it searches)")


def why_no_layout(cfg, gpus: int, hw: Hardware) -> str:
    """Why no layout of `gpus` GPUs exists for cfg's model and batch, naming the keys that bound
    each degree (for a search that enumerated none)."""
    m, t = cfg.model, cfg.train
    tps = _tp_degrees(m, hw, gpus)
    pps = _divisors(m.n_layers, min(gpus, MAX_PIPELINE_CHUNKS))
    cps = [c for c in CP_DEGREES if c == 1 or not t.seq_len % (2 * c)]
    hsdp = (f"; dp must be a multiple of parallel.dp_replicate={cfg.parallel.dp_replicate} "
            "(HSDP: FSDP2's layouts alone)" if cfg.parallel.dp_replicate > 1 else "")
    return (f"no layout of --gpus {gpus} splits this model and batch: tp (in {tps}) must divide "
            f"model.n_heads={m.n_heads}, model.n_kv_heads={m.n_kv_heads}, the MLP size "
            f"{ffn_dim(m)} and model.vocab_size={m.vocab_size}, and divide a node's GPUs or be "
            f"two whole nodes; pp (in "
            f"{pps}) must divide model.n_layers={m.n_layers}; cp (in {cps}) must divide "
            f"train.seq_len={t.seq_len} in 2 * cp chunks; tp * pp * cp must divide {gpus}, and "
            f"what is left, dp, times a micro-batch size (one of {list(MICRO_BATCH_SIZES)}) must "
            f"divide train.global_batch_size={t.global_batch_size}{hsdp}. Change --gpus or "
            "those keys")

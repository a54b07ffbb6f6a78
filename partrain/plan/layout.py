"""`partrain plan`: the layout, rank by rank, without starting a process.

Every rank's node, local rank and (pp, dp, tp) coordinates, the groups of each mesh dimension,
the batch arithmetic, the model's size and what each rank holds of it, and the tensor-parallel
collectives of one step with their sizes, as a dict (JSON as it is; plan/render draws it).
"""

from omegaconf import DictConfig, OmegaConf

from partrain.config.resolve import World, compute_dtype
from partrain.models.arith import (
    count_params_per_rank,
    expert_params,
    moe_blocks,
    moe_enabled,
    stage_layers,
    tied,
)
from partrain.models.family import family_of, shape_modeled
from partrain.parallel.mesh import DIM_NAMES, ParallelDims
from partrain.parallel.schedules import (
    SIMULATED_MAX_ACTIONS,
    bubble_theory,
    build_schedule,
    simulate,
)
from partrain.plan.costs import (
    checkpoint_state_bytes,
    cp_traffic,
    moe_traffic,
    tp_collectives,
    tp_step_collectives,
    optimizer_state_bytes,
    true_size,
    zero_memory,
)
from partrain.plan.memory_model import (
    activations,
    expert_slice_params,
    memory_per_stage,
    shape,
)

TIMELINE_MAX_MICRO_BATCHES = 16  # wider timelines are drawn for fewer (labels stay 2 digits)
TIMELINE_MAX_RANKS = 32  # a deeper pipeline is not drawn (one line per pp rank)
# Worlds up to this size are listed rank by rank; larger ones by their first and last ranks and
# the pattern of each dimension's groups, so a plan costs the same for any world size.
FULL_LISTING_RANKS = 4096
SHOWN_AT_EACH_END = 8


def build_plan(cfg: DictConfig, world: World, warnings: list[str]) -> dict:
    """The plan as plain data (what --json prints); cfg must be resolved and validated. A family
    without the built-in shape arithmetic gets plan.user's plan, as a user's model does."""
    if not shape_modeled(cfg.model):
        from partrain.plan.user import build_user_plan

        return build_user_plan(cfg, world, warnings)
    p, t = cfg.parallel, cfg.train
    family = family_of(cfg.model)
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, cp=p.cp, ep=p.ep)
    stages = stage_plan(cfg, dims)
    params_per_rank = max(s["params_per_rank"] for s in stages)
    # A plan is for the machine the config names; `auto` is planned as GPUs.
    dtype = compute_dtype(t.dtype, cfg.launcher.device != "cpu")
    full = dims.world_size <= FULL_LISTING_RANKS
    return {
        "name": cfg.name,
        "world_size": world.size,
        "nnodes": world.nnodes,
        "nproc_per_node": world.nproc_per_node,
        "degrees": {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp, "ep": dims.ep,
                    "zero_stage": p.zero_stage},
        "ranks": _ranks(dims, world, full),
        "ranks_complete": full,
        "groups": {dim: dims.groups(dim) for dim in DIM_NAMES} if full else None,
        "group_pattern": {dim: _group_pattern(dims, dim) for dim in DIM_NAMES},
        "batch": _batch(t, dims.dp),
        "model": {"name": cfg.model.name, "params": family.count_params(cfg.model),
                  "active_params": family.count_params(cfg.model, active=True),
                  "tie_embeddings": tied(cfg.model), "params_per_rank": params_per_rank,
                  "flops_per_token": family.flops_per_token(cfg.model, t.seq_len)},
        "experts": _experts(cfg, dims, stages, act_bytes=4 if dtype == "fp32" else 2),
        "hsdp": _hsdp(dims, p.dp_replicate) if p.dp_replicate > 1 else None,
        "memory": _memory(p.zero_stage, params_per_rank, dims.dp * dims.cp // p.dp_replicate,
                          dtype, p.zero_backend, dims.pp > 1, optimizer_state_bytes(cfg.optim),
                          _busiest_experts(cfg, dims, stages), dims),
        "memory_per_stage": memory_per_stage(cfg, dims, stages, dtype),
        "tp_collectives": _tp_collectives(cfg, dims, stages, low_precision=dtype != "fp32"),
        "context": _context(cfg, dims, stages, act_bytes=4 if dtype == "fp32" else 2),
        "pipeline": _pipeline(cfg, dims, stages) if dims.pp > 1 else None,
        "checkpoint": _checkpoint(cfg, params_per_rank, dims.dp),
        "warnings": warnings,
    }


def _ranks(dims: ParallelDims, world: World, full: bool) -> list[dict]:
    """Each rank's node, local rank and coordinates: every rank, or the first and last
    SHOWN_AT_EACH_END of a large world."""
    listed = (range(dims.world_size) if full else
              [*range(SHOWN_AT_EACH_END),
               *range(dims.world_size - SHOWN_AT_EACH_END, dims.world_size)])
    ranks = []
    for rank in listed:
        node, local_rank = divmod(rank, world.nproc_per_node)
        ranks.append({"rank": rank, "node": node, "local_rank": local_rank, **dims.coords(rank)})
    return ranks


def _batch(t: DictConfig, dp: int) -> dict:
    """The batch arithmetic, its rule written out with the numbers."""
    return {
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "micro_batches": t.micro_batches,
        "dp": dp,
        "rule": f"{t.global_batch_size} = micro_batch_size({t.micro_batch_size}) * "
                f"micro_batches({t.micro_batches}) * dp({dp})",
        "seq_len": t.seq_len,
        "tokens_per_step": t.global_batch_size * t.seq_len,
    }


def _checkpoint(cfg: DictConfig, params_per_rank: int, dp: int) -> dict:
    """What one checkpoint writes: fp32 weights and the optimizer's state, each tensor once. A
    rank writes its stage's shard of them, the dp replicas sharing the work (DCP
    de-duplicates)."""
    c = cfg.checkpoint
    total = true_size(cfg.model, optim_cfg=cfg.get("optim"))
    per_param = 4 + checkpoint_state_bytes(cfg.get("optim"))
    return {"bytes": total, "bytes_per_rank": round(per_param * params_per_rank / dp),
            "every": c.every, "keep": c.keep, "save_last": c.save_last,
            "async_save": c.async_save, "disk_bytes": total * c.keep}


def _hsdp(dims: ParallelDims, replicate: int) -> dict:
    """HSDP's groups inside the first dp group (pp, cp and tp coordinates 0): FSDP shards inside
    each run of dp / dp_replicate consecutive dp ranks (with their cp ranks) and all-reduces
    across the runs."""
    first = dims.groups("dp")[0]
    shard = dims.dp // replicate
    return {"dp_replicate": replicate, "dp_shard": shard,
            "shard_groups": [first[i:i + shard] for i in range(0, dims.dp, shard)],
            "replicate_groups": [first[i::shard] for i in range(shard)]}


def _group_pattern(dims: ParallelDims, dim: str) -> dict:
    """One dimension's groups without listing them: how many, their size, the stride between
    members, and the first and last group."""
    size = dict(zip(DIM_NAMES, dims.shape))
    stride = {"pp": dims.dp * dims.cp * dims.tp, "dp": dims.cp * dims.tp, "cp": dims.tp,
              "tp": 1}[dim]
    count = dims.world_size // size[dim]
    last_start = dims.rank(**{d: size[d] - 1 for d in DIM_NAMES if d != dim}, **{dim: 0})
    return {"groups": count, "size": size[dim], "stride": stride,
            "first": [stride * i for i in range(min(size[dim], SHOWN_AT_EACH_END))],
            "last": [last_start + stride * i for i in range(min(size[dim], SHOWN_AT_EACH_END))]}


def stage_plan(cfg: DictConfig, dims: ParallelDims) -> list[dict]:
    """Every pipeline stage: its pp rank, local chunk, blocks and parameters per rank."""
    p = cfg.parallel
    v = p.pp_virtual_stages if dims.pp > 1 else 1
    layers = stage_layers(cfg.model.n_layers, dims.pp, v, p.pp_layers if dims.pp > 1 else None)
    last = len(layers) - 1
    return [{"stage": s, "pp_rank": s % dims.pp, "chunk": s // dims.pp,
             "blocks": [ids[0], ids[-1]] if ids else [],
             "embedding": s == 0, "head": s == last,
             "params_per_rank": count_params_per_rank(cfg.model, dims.tp, list(ids), s == 0,
                                                      s == last, p.ep)}
            for s, ids in enumerate(layers)]


def _busiest_experts(cfg: DictConfig, dims: ParallelDims, stages: list[dict]) -> int:
    """Expert-slice parameters on the busiest stage (memory_model.expert_slice_params)."""
    busiest = max(stages, key=lambda st: st["params_per_rank"])
    blocks = range(busiest["blocks"][0], busiest["blocks"][1] + 1) if busiest["blocks"] else []
    return expert_slice_params(cfg.model, blocks, dims.ep) if moe_enabled(cfg.model) else 0


def _memory(stage: int, psi: int, nd: int, dtype: str, engine: str, pipeline: bool,
            moments: int, experts: int = 0, dims: ParallelDims | None = None) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state at the chosen zero_stage, for
    the busiest rank's Ψ parameters (activations and buffers not included), sharded over
    Nd = dp x cp ranks (/ dp_replicate); the other stages by the same engine for comparison
    (DeepSpeed's for 0-1 under FSDP). Under ep, `experts` of the Ψ are expert slices, which
    ZeRO shards over their own dp / ep x cp ranks: counted apart (the line said the whole Ψ
    over Nd, 8.4 GiB for Mixtral at ep8 whose state is 22.2)."""
    e_nd = max(1, dims.dp // dims.ep * dims.cp) if experts and dims is not None else 1

    def state(s: int) -> dict:
        dense = zero_memory(s, psi - experts, nd, dtype, engine, pipeline, moments)
        if not experts:
            return dense
        sliced = zero_memory(s, experts, e_nd, dtype, engine, pipeline, moments)
        both = {k: dense[k] + sliced[k]
                for k in ("param_bytes", "grad_bytes", "optim_bytes", "total")}
        both["formula"] = (f"{dense['formula']} (dense) + {sliced['formula'].replace('Nd', 'Nde')}"
                           " (expert slices)")
        return both

    return {"zero_stage": stage, "engine": engine if stage else "ddp", "params_per_rank": psi,
            "dp": nd, "dtype": dtype, "expert_params_per_rank": experts, "expert_nd": e_nd,
            **state(stage), "total_by_stage": {s: state(s)["total"] for s in range(4)}}


def _pipeline(cfg: DictConfig, dims: ParallelDims, stages: list[dict]) -> dict:
    """Schedule, bubble (theory and simulated with backward = 2 x forward) and a timeline."""
    p, m = cfg.parallel, cfg.train.micro_batches
    v, schedule = p.pp_virtual_stages, p.pp_schedule
    shown = m
    if m * v > TIMELINE_MAX_MICRO_BATCHES:
        shown = max(dims.pp, (TIMELINE_MAX_MICRO_BATCHES // v) // dims.pp * dims.pp)
    timeline = None
    if dims.pp <= TIMELINE_MAX_RANKS:
        sim = simulate(build_schedule(schedule, dims.pp, shown, v))
        timeline = [[{"op": a.op, "chunk": a.chunk, "mb": a.mb, "start": start, "end": end}
                     for a, start, end in spans] for spans in sim.spans]
    actions = 2 * m * v * dims.pp
    return {
        "schedule": schedule, "virtual_stages": v, "micro_batches": m, "stages": stages,
        "bubble_theory": bubble_theory(schedule, dims.pp, m, v),
        "rule": ("(p-1)/(v*m+p-1)" if schedule == "interleaved_1f1b" else "(p-1)/(m+p-1)"),
        "peak_in_flight": simulate(build_schedule(schedule, dims.pp, m, v)).peak_in_flight
        if actions <= SIMULATED_MAX_ACTIONS else None,
        "timeline_micro_batches": shown, "timeline": timeline,
    }


def _busiest_rank_blocks(dims: ParallelDims, stages: list[dict]) -> int:
    """The most blocks a pp rank runs, over its chunks."""
    per_rank = [0] * dims.pp
    for s in stages:
        per_rank[s["pp_rank"]] += s["blocks"][1] - s["blocks"][0] + 1
    return max(per_rank)


def _tp_collectives(cfg: DictConfig, dims: ParallelDims, stages: list[dict],
                    low_precision: bool) -> dict:
    """The collectives of one tp group per optimizer step: each micro-batch's, times the number
    of micro-batches, plus the per-step ones; activations of 2 bytes under `low_precision`."""
    p, t = cfg.parallel, cfg.train
    sp = bool(p.sequence_parallel) and dims.tp > 1
    # A tp group in a pipeline stage runs that rank's blocks (the busiest rank's, if uneven);
    # the embedding and loss rows belong to the first and last stage.
    stage = OmegaConf.merge(cfg.model, {"n_layers": _busiest_rank_blocks(dims, stages)})
    # Under cp a tp group works on its cp rank's share of each sequence.
    per_micro = tp_collectives(stage, t.micro_batch_size * t.seq_len // dims.cp, dims.tp, sp,
                               low_precision)
    rows = [{**r, **{k: r[k] * t.micro_batches for k in ("calls", "bytes", "wire_bytes")}}
            for r in per_micro] + tp_step_collectives(stage, dims.tp, sp)
    return {"sequence_parallel": sp, "layers_per_tp_group": stage.n_layers, "per_step": rows,
            "bytes_per_step": sum(r["bytes"] for r in rows),
            "wire_bytes_per_step": sum(r["wire_bytes"] for r in rows)}


def _context(cfg: DictConfig, dims: ParallelDims, stages: list[dict], act_bytes: int) -> dict:
    """Context parallelism: what a rank of the busiest stage sends over its cp group per step,
    and the activations of one micro-batch it keeps (at this cp and, for contrast, at cp=1)."""
    p, t = cfg.parallel, cfg.train
    layers = _busiest_rank_blocks(dims, stages)
    rows = cp_traffic(cfg.model, t.micro_batch_size, t.seq_len, dims.cp, dims.tp, p.cp_method,
                      layers, act_bytes)
    rows = [{**r, "calls": r["calls"] * t.micro_batches, "bytes": r["bytes"] * t.micro_batches}
            for r in rows]
    # The memory model's own figure (its peak line's activations, for one micro-batch): the line
    # said a second formula's (all bf16), 11.9 GiB beside the peak line's 13.4.
    blocks = list(range(layers))
    sp = dims.tp > 1 and p.sequence_parallel
    at = {cp: activations(cfg.model, blocks, shape(cfg.model, dims.tp, sp,
                                                   cp > 1 and p.cp_method == "ring"),
                          t.micro_batch_size * t.seq_len // cp, 1,
                          t.activation_checkpointing, act_bytes)["kept_bytes"]
          for cp in {1, dims.cp}}
    return {"cp": dims.cp, "method": p.cp_method if dims.cp > 1 else None,
            "tokens_per_rank": t.seq_len // dims.cp, "per_step": rows,
            "bytes_per_step": sum(r["bytes"] for r in rows),
            "activation_bytes_per_micro_batch": at[dims.cp],
            "activation_bytes_per_micro_batch_cp1": at[1]}


def _experts(cfg: DictConfig, dims: ParallelDims, stages: list[dict], act_bytes: int) -> dict | None:
    """Mixture of experts: the experts each rank holds, the parameters (all, active per token,
    experts per rank) and the all-to-all bytes a rank of the busiest stage sends per step under
    uniform routing (partrain.plan.costs.moe_traffic)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not moe_enabled(m):
        return None
    blocks = moe_blocks(m)
    per_rank = [0] * dims.pp
    for s in stages:
        per_rank[s["pp_rank"]] += sum(1 for b in blocks if s["blocks"] and
                                      s["blocks"][0] <= b <= s["blocks"][1])
    # Tokens a rank routes per step: its dp share of the batch, its cp share of each sequence,
    # and its tp share of that under sequence parallelism (else every tp rank routes them all).
    tokens = (t.micro_batches * t.micro_batch_size * t.seq_len // dims.cp
              // (dims.tp if p.sequence_parallel else 1))
    traffic = moe_traffic(m, tokens, t.micro_batches, dims.ep, max(per_rank), act_bytes)
    return {"n_experts": m.moe.n_experts, "top_k": m.moe.top_k,
            "n_shared_experts": m.moe.n_shared_experts, "moe_blocks": len(blocks),
            "ep": dims.ep, "experts_per_rank": m.moe.n_experts // dims.ep,
            "ep_groups": [[dims.rank(pp=0, dp=g * dims.ep + j, tp=0) for j in range(dims.ep)]
                          for g in range(min(dims.dp // dims.ep, SHOWN_AT_EACH_END))],
            "expert_params_per_rank": (max(per_rank) * (m.moe.n_experts // dims.ep)
                                       * expert_params(m)),
            "balance": m.moe.balance, "capacity_factor": m.moe.capacity_factor,
            "tokens_routed_per_rank": tokens, "all_to_all": traffic}

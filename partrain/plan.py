"""`partrain plan`: the layout, rank by rank, without starting a process.

Every rank's node, local rank and (pp, dp, tp) coordinates, the groups of each mesh dimension,
the batch arithmetic, the model's size and what each rank holds of it, and the tensor-parallel
collectives of one step with their sizes, as rich tables or as JSON.
"""

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from partrain.config.validate import World
from partrain.mesh import DIM_NAMES, ParallelDims
from partrain.models.llama import count_params, count_params_per_rank, flops_per_token
from partrain.parallel.tensor import tp_collectives, tp_step_collectives


def build_plan(cfg: DictConfig, world: World, warnings: list[str]) -> dict:
    """The plan as plain data (what --json prints); cfg must be resolved and validated."""
    p, t = cfg.parallel, cfg.train
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp)
    ranks = []
    for rank in range(dims.world_size):
        node, local_rank = divmod(rank, world.nproc_per_node)
        ranks.append({"rank": rank, "node": node, "local_rank": local_rank, **dims.coords(rank)})
    return {
        "name": cfg.name,
        "world_size": world.size,
        "nnodes": world.nnodes,
        "nproc_per_node": world.nproc_per_node,
        "degrees": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "zero_stage": p.zero_stage},
        "ranks": ranks,
        "groups": {dim: dims.groups(dim) for dim in DIM_NAMES},
        "batch": {
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": t.micro_batch_size,
            "micro_batches": t.micro_batches,
            "dp": dims.dp,
            "rule": f"{t.global_batch_size} = micro_batch_size({t.micro_batch_size}) * "
                    f"micro_batches({t.micro_batches}) * dp({dims.dp})",
            "seq_len": t.seq_len,
            "tokens_per_step": t.global_batch_size * t.seq_len,
        },
        "model": {"name": cfg.model.name, "params": count_params(cfg.model),
                  "params_per_rank": count_params_per_rank(cfg.model, dims.tp),
                  "flops_per_token": flops_per_token(cfg.model, t.seq_len)},
        "tp_collectives": _tp_collectives(cfg, dims),
        "warnings": warnings,
    }


def _tp_collectives(cfg: DictConfig, dims: ParallelDims) -> dict:
    """The collectives of one tp group per optimizer step: each micro-batch's, times the number
    of micro-batches, plus the per-step ones."""
    p, t = cfg.parallel, cfg.train
    sp = bool(p.sequence_parallel) and dims.tp > 1
    low = t.dtype == "bf16" or (t.dtype == "auto" and cfg.launcher.device != "cpu")
    # A tp group in a pipeline stage runs that stage's share of the blocks; the embedding and
    # loss rows belong to the first and last stage.
    stage = OmegaConf.merge(cfg.model, {"n_layers": cfg.model.n_layers // dims.pp})
    per_micro = tp_collectives(stage, t.micro_batch_size * t.seq_len, dims.tp, sp, low)
    rows = [{**r, **{k: r[k] * t.micro_batches for k in ("calls", "bytes", "wire_bytes")}}
            for r in per_micro] + tp_step_collectives(stage, dims.tp, sp)
    return {"sequence_parallel": sp, "layers_per_tp_group": stage.n_layers, "per_step": rows,
            "bytes_per_step": sum(r["bytes"] for r in rows),
            "wire_bytes_per_step": sum(r["wire_bytes"] for r in rows)}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def print_plan(plan: dict, console: Console) -> None:
    d, b, m = plan["degrees"], plan["batch"], plan["model"]
    console.print(
        f"[bold]{plan['name']}[/bold]: {plan['world_size']} ranks = {plan['nnodes']} node(s) x "
        f"{plan['nproc_per_node']} per node; pp({d['pp']}) * dp({d['dp']}) * tp({d['tp']}) = "
        f"{d['pp'] * d['dp'] * d['tp']}; zero_stage {d['zero_stage']}")
    console.print(f"model {m['name']}: {m['params']:,} parameters, {m['params_per_rank']:,} per "
                  f"rank (tp={d['tp']} splits all but the norms), "
                  f"{m['flops_per_token'] / 1e9:.2f} GFLOP per token (training)")

    ranks = Table(title="ranks")
    for col in ("rank", "node", "local_rank", "pp", "dp", "tp"):
        ranks.add_column(col, justify="right")
    for r in plan["ranks"]:
        ranks.add_row(*(str(r[c]) for c in ("rank", "node", "local_rank", "pp", "dp", "tp")))
    console.print(ranks)

    groups = Table(title="process groups (ranks that communicate along each dimension)")
    groups.add_column("dim")
    groups.add_column("groups", justify="right")
    groups.add_column("ranks")
    for dim, members in plan["groups"].items():
        groups.add_row(dim, str(len(members)), "  ".join(
            "[" + ",".join(map(str, g)) + "]" for g in members))
    console.print(groups)

    console.print(f"batch: global_batch_size {b['rule']}; seq_len {b['seq_len']}; "
                  f"{b['tokens_per_step']:,} tokens per step")
    tpc = plan["tp_collectives"]
    if tpc["per_step"]:
        stages = (f"; a pp stage's {tpc['layers_per_tp_group']} blocks, embedding rows on the "
                  "first stage, head and loss rows on the last" if d["pp"] > 1 else "")
        table = Table(title=f"tensor-parallel collectives per step, in each tp group of {d['tp']}"
                            f"{' (sequence parallel)' if tpc['sequence_parallel'] else ''}"
                            f"{stages}; payload = the full tensor, sent = per rank, ring algorithm")
        for col in ("where", "op", "calls", "elements each", "payload", "sent"):
            table.add_column(col, justify="left" if col in ("where", "op") else "right")
        for r in tpc["per_step"]:
            table.add_row(r["where"], r["op"], f"{r['calls']:,}", f"{r['elements']:,}",
                          _size(r["bytes"]), _size(r["wire_bytes"]))
        table.add_row("total", "", "", "", _size(tpc["bytes_per_step"]),
                      _size(tpc["wire_bytes_per_step"]))
        console.print(table)
    for warning in plan["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")

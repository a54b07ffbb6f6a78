"""`partrain plan`: the layout, rank by rank, without starting a process.

Every rank's node, local rank and (pp, dp, tp) coordinates, the groups of each mesh dimension,
the batch arithmetic and the model's size, as rich tables or as JSON.
"""

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from partrain.config.validate import World
from partrain.mesh import DIM_NAMES, ParallelDims
from partrain.models.llama import count_params, flops_per_token


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
                  "flops_per_token": flops_per_token(cfg.model, t.seq_len)},
        "warnings": warnings,
    }


def print_plan(plan: dict, console: Console) -> None:
    d, b, m = plan["degrees"], plan["batch"], plan["model"]
    console.print(
        f"[bold]{plan['name']}[/bold]: {plan['world_size']} ranks = {plan['nnodes']} node(s) x "
        f"{plan['nproc_per_node']} per node; pp({d['pp']}) * dp({d['dp']}) * tp({d['tp']}) = "
        f"{d['pp'] * d['dp'] * d['tp']}; zero_stage {d['zero_stage']}")
    console.print(f"model {m['name']}: {m['params']:,} parameters, "
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
    for warning in plan["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")

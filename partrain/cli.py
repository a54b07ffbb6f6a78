"""The `partrain` command: launch, plan, show, data prepare.

Every command composes and validates the config before it does anything; a ConfigError becomes
one message on stderr and exit code 2, with nothing started and nothing written.
"""

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from omegaconf import OmegaConf
from rich.console import Console

from partrain.config import compose_config, resolve_and_validate, resolve_world
from partrain.errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train decoder-only transformers with data, tensor, pipeline and ZeRO "
                       "parallelism from Hydra configs.")
data_app = typer.Typer(add_completion=False, help="Prepare training data.")
app.add_typer(data_app, name="data")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

ARGS_HELP = "[CONFIG] [OVERRIDE...]: a recipe name or YAML path, then Hydra overrides (key=value)"


def _split_args(args: Optional[List[str]]) -> tuple[Optional[str], list[str]]:
    """CONFIG is the first argument that is not an override (overrides hold '=' or start with ~)."""
    args = list(args or [])
    if args and "=" not in args[0] and not args[0].startswith("~"):
        return args[0], args[1:]
    return None, args


def _resolve(args, nnodes=None, nproc_per_node=None, world_size=None, probe_cuda=False):
    config, overrides = _split_args(args)
    cfg = compose_config(config, overrides)
    if world_size is not None:
        nnodes, nproc_per_node = _split_world(cfg, world_size)
    cuda_devices = 0
    if probe_cuda and cfg.launcher.device != "cpu":
        import torch

        cuda_devices = torch.cuda.device_count()
        if cfg.launcher.device == "cuda" and cuda_devices == 0:
            raise ConfigError("launcher.device=cuda but no CUDA device is visible; "
                              "use launcher.device=cpu")
    world = resolve_world(cfg, nnodes, nproc_per_node, cuda_devices)
    warnings = resolve_and_validate(cfg, world)
    return cfg, world, warnings


def _split_world(cfg, world_size: int) -> tuple[int, int]:
    """--world-size N for `plan`: keep the GPUs per node if the config has them, else the nodes."""
    if world_size < 1:
        raise ConfigError(f"--world-size={world_size} must be at least 1")
    per_node = cfg.launcher.nproc_per_node
    if per_node and world_size % per_node == 0:
        return world_size // per_node, per_node
    nnodes = cfg.launcher.nnodes
    if world_size % nnodes:
        raise ConfigError(f"--world-size={world_size} is not divisible by launcher.nnodes={nnodes}")
    return nnodes, world_size // nnodes


@app.command(context_settings={"allow_extra_args": False})
def launch(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Default: runs/<name>-<time>"),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node"),
    nnodes: Optional[int] = typer.Option(None, "--nnodes"),
    node_rank: int = typer.Option(0, "--node-rank"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of node 0"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show the plan; start nothing"),
) -> None:
    """Compose, validate, write the run dir and train on this node's ranks."""
    from partrain.data import check_data
    from partrain.launch import ElasticLaunch, default_run_dir, launch_workers, write_run_dir
    from partrain.launch.rundir import check_run_dir
    from partrain.plan import build_plan, print_plan

    cfg, world, warnings = _resolve(args, nnodes, nproc_per_node, probe_cuda=True)
    if not 0 <= node_rank < world.nnodes:
        raise ConfigError(f"--node-rank={node_rank} must be in 0..{world.nnodes - 1} "
                          f"for {world.nnodes} node(s)")
    if world.nnodes > 1 and not rdzv_endpoint:
        raise ConfigError(f"--nnodes={world.nnodes} needs --rdzv-endpoint HOST:PORT "
                          "(node 0's address), the same on every node")
    data_description = check_data(cfg)
    run_dir = run_dir or default_run_dir(cfg.name)
    check_run_dir(run_dir)
    for warning in warnings:
        err.print(f"[yellow]warning:[/yellow] {warning}")
    if dry_run:
        print_plan(build_plan(cfg, world, []), out)
        out.print(f"data: {data_description}")
        out.print(f"dry run: would write {run_dir} and start {world.nproc_per_node} worker(s) on "
                  "this node; nothing started")
        return

    write_run_dir(cfg, run_dir)
    out.print(f"partrain: run dir {run_dir}; {world.size} rank(s), {world.nproc_per_node} on this "
              f"node (node {node_rank} of {world.nnodes}); logs in {run_dir / 'logs'}")
    cpu = cfg.launcher.device == "cpu" or (cfg.launcher.device == "auto" and not _has_cuda())
    spec = ElasticLaunch(
        nnodes=world.nnodes, nproc_per_node=world.nproc_per_node, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint, run_id=cfg.name, rdzv_timeout_s=cfg.launcher.rdzv_timeout_s,
        cpu_threads=_cpu_threads(world.nproc_per_node) if cpu else None)
    code = launch_workers(run_dir, spec, console_print=err.print)
    if code == 0:
        out.print(f"done: metrics in {run_dir / 'metrics.jsonl'}")
    raise typer.Exit(code)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_threads(nproc: int) -> int:
    import os

    return max(1, (os.cpu_count() or 1) // nproc)


@app.command()
def plan(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Plan for N ranks"),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
) -> None:
    """Show every rank's place in the mesh, the groups and the batch arithmetic; start nothing."""
    from partrain.plan import build_plan, print_plan

    cfg, world, warnings = _resolve(args, world_size=world_size)
    result = build_plan(cfg, world, warnings)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_plan(result, out)


@app.command()
def show(args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False)) -> None:
    """Print the resolved config as YAML (what config.yaml in the run dir would hold)."""
    cfg, _, warnings = _resolve(args)
    sys.stdout.write(OmegaConf.to_yaml(cfg))
    if cfg.parallel.zero_stage > 0:
        from partrain.parallel.zero import deepspeed_config

        on_cuda = cfg.launcher.device == "cuda" or (cfg.launcher.device == "auto" and _has_cuda())
        text = json.dumps(deepspeed_config(cfg, on_cuda), indent=2)
        sys.stdout.write("# The DeepSpeed config the workers derive (partrain/parallel/zero.py):\n"
                         + "".join(f"# {line}\n" for line in text.splitlines()))
    for warning in warnings:
        err.print(f"[yellow]warning:[/yellow] {warning}")


@data_app.command("prepare")
def data_prepare(
    files: List[Path] = typer.Argument(..., help="Text files, concatenated in the given order"),
    out_dir: Path = typer.Option(..., "--out", help="New directory for train.bin, val.bin, meta.json"),
    val_fraction: float = typer.Option(0.05, "--val-fraction"),
) -> None:
    """Byte-tokenize text files into a token dir for data=tokens data.path=DIR."""
    from partrain.data import prepare_token_dir

    meta = prepare_token_dir(files, out_dir, val_fraction)
    out.print(f"wrote {out_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
              f"(vocab {meta['vocab_size']}); train with: partrain launch data=tokens "
              f"data.path={out_dir}")


def main() -> None:
    try:
        app()
    except ConfigError as e:
        err.print(f"[bold red]error:[/bold red] {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()

"""The `partrain` command: launch, slurm, plan, show, export, sample, data prepare.

Every command composes and validates the config before it does anything; a ConfigError becomes
one message on stderr and exit code 2, with nothing started and nothing written.
"""

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import List, Optional

import typer
from omegaconf import OmegaConf
from rich.console import Console
from rich.text import Text

from partrain.config.compose import compose_config
from partrain.config.validate import (
    check_startable,
    resolve_and_validate,
    resolve_world,
)
from partrain.errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train decoder-only transformers with data, tensor, pipeline and ZeRO "
                       "parallelism from Hydra configs.")
data_app = typer.Typer(add_completion=False, help="Prepare training data.")
app.add_typer(data_app, name="data")

# markup=False: what partrain prints holds the user's own text (paths, names, values), and a
# `[run1]` or `[/x]` in it must come out as typed, not be read as rich markup.
out = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)

OVERRIDE_SHAPE = re.compile(r"[~+]|[A-Za-z_][\w.@+-]*=|=")
ARGS_HELP = "[CONFIG] [OVERRIDE...]: a recipe name or YAML path, then Hydra overrides (key=value)"


def _warn(text: str) -> None:
    err.print(Text.assemble(("warning:", "yellow"), " ", text))


def _whole(flag: str, minimum: int = 1):
    """A parser for an integer flag whose message echoes what was given."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise typer.BadParameter(f"{flag}={value!r} is not a whole number") from None
        if number < minimum:
            raise typer.BadParameter(f"{flag}={number} must be at least {minimum}")
        return number
    return parse


def _number(flag: str):
    """A parser for a flag that takes a number, echoing what was given."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise typer.BadParameter(f"{flag}={value!r} is not a number") from None
        return number  # the range (and NaN) is checked where the value is used
    return parse


def _split_args(args: Optional[List[str]]) -> tuple[Optional[str], list[str]]:
    """CONFIG is the first argument unless it has an override's shape (`key=`, `+key=`, `~key`):
    a path may hold '=' (`runs/lr=1e-3/config.yaml`) where a key cannot."""
    args = list(args or [])
    if args and not OVERRIDE_SHAPE.match(args[0]):
        return args[0], args[1:]
    return None, args


def _resolve(args, nnodes=None, nproc_per_node=None, world_size=None, probe_cuda=False,
             gpus_on_node=None, resume=None):
    from partrain.config.frozen import is_frozen_config, load_frozen_config

    config, overrides = _split_args(args)
    if resume is not None:
        from partrain.checkpoint.resume import resume_config

        if config is not None:
            raise ConfigError(f"--resume {resume} takes overrides only (key=value), not {config}: "
                              "the run dir's config.yaml is the config")
        cfg = resume_config(resume, overrides)
    elif is_frozen_config(config):  # a run dir's config.yaml: run as it is, never re-composed
        cfg = load_frozen_config(config, overrides)
    else:
        cfg = compose_config(config, overrides)
    if world_size is not None:
        nnodes, nproc_per_node = _split_world(cfg, world_size)
    cuda_devices = 0
    if probe_cuda and cfg.launcher.device != "cpu":
        import torch

        cuda_devices = torch.cuda.device_count()
        if gpus_on_node and cuda_devices:  # the scheduler's share of the node, if it says
            cuda_devices = min(cuda_devices, gpus_on_node)
        if cfg.launcher.device == "cuda" and cuda_devices == 0:
            raise ConfigError("launcher.device=cuda but no CUDA device is visible; "
                              "use launcher.device=cpu")
    world = resolve_world(cfg, nnodes, nproc_per_node, cuda_devices)
    if world_size is not None:
        world = dataclasses.replace(world, nproc_from=f"--world-size={world_size}")
    warnings = resolve_and_validate(cfg, world)
    return cfg, world, warnings


def _split_world(cfg, world_size: int) -> tuple[int, int]:
    """--world-size N for `plan`: keep the GPUs per node if the config has them, else the nodes."""
    from partrain.config.validate import MAX_WORLD_SIZE

    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"--world-size={world_size:,} exceeds {MAX_WORLD_SIZE:,} ranks, the "
                          "most partrain plans for")
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
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", metavar="N",
                                                 parser=_whole("--nproc-per-node")),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", metavar="N", parser=_whole("--nnodes")),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", metavar="R",
                                            parser=_whole("--node-rank", 0),
                                            help="0 on the node that hosts the rendezvous; "
                                            "default 0 (SLURM: SLURM_NODEID)"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of node 0"),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", help="This node's address for "
                                             "the others; default: the route to the endpoint"),
    ifname: Optional[str] = typer.Option(None, "--ifname", help="Network interface for gloo/NCCL; "
                                         "default: the one that routes to the endpoint"),
    resume: Optional[Path] = typer.Option(
        None, "--resume", metavar="RUN_DIR", help="Continue the run in RUN_DIR from its newest "
        "checkpoint; OVERRIDEs may change the layout (parallel.*, launcher.*, micro-batches) and "
        "raise train.max_steps"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show the plan; start nothing"),
) -> None:
    """Compose, validate, write the run dir and train on this node's ranks (or continue the run
    a run dir holds, from its newest checkpoint)."""
    # Inside SLURM the node count, this node's rank and the endpoint come from the job (flags
    # win); under torchrun, or with one srun task per GPU, this refuses to start.
    from partrain.checkpoint.resume import check_resumable
    from partrain.data.tokens import check_data
    from partrain.launch.cluster import detect_place
    from partrain.launch.local import ElasticLaunch, launch_workers
    from partrain.launch.netif import (
        check_local_addr,
        pick_network,
        set_ifname_variables,
    )
    from partrain.launch.preemption import FORWARDER
    from partrain.launch.preflight import check_init_from
    from partrain.launch.rundir import check_run_dir, default_run_dir, write_run_dir
    from partrain.observe.curves import check_curves
    from partrain.plan.layout import build_plan
    from partrain.plan.render import print_plan

    FORWARDER.install()  # a preemption signal from here on is passed to the workers
    if resume is not None and run_dir is not None and run_dir.absolute() != resume.absolute():
        raise ConfigError(f"--run-dir {run_dir} and --resume {resume} name two run dirs; "
                          "--resume continues in its own")
    place = detect_place(nproc_per_node)
    nnodes = nnodes if nnodes is not None else place.nnodes
    rank_source = "--node-rank" if node_rank is not None else "SLURM_NODEID"
    node_rank = node_rank if node_rank is not None else (place.node_rank or 0)
    cfg, world, warnings = _resolve(args, nnodes, nproc_per_node, probe_cuda=True,
                                    gpus_on_node=place.gpus_on_node, resume=resume)
    check_startable(world)
    if not 0 <= node_rank < world.nnodes:
        raise ConfigError(f"{rank_source}={node_rank} must be in 0..{world.nnodes - 1} "
                          f"for {world.nnodes} node(s)")
    endpoint_from = "--rdzv-endpoint"
    if world.nnodes > 1 and not rdzv_endpoint:
        rdzv_endpoint, endpoint_from = (place.rdzv_endpoint,
                                        "the SLURM job's first node (SLURM_JOB_NODELIST)")
        if not rdzv_endpoint:
            raise ConfigError(f"--nnodes={world.nnodes} needs --rdzv-endpoint HOST:PORT "
                              "(node 0's address), the same on every node")
    if local_addr:
        check_local_addr(local_addr)
    network = (pick_network(rdzv_endpoint, local_addr, ifname, endpoint_from) if rdzv_endpoint
               else None)
    if network is None and (local_addr or ifname):
        warnings.append("--local-addr / --ifname only matter for a multi-node job "
                        "(--rdzv-endpoint); this run stays on 127.0.0.1")
    data_description = check_data(cfg)
    check_curves(cfg)
    run_dir = resume or run_dir or default_run_dir(cfg.name, place.job_id)
    checkpoint = check_run_dir(run_dir, cfg, resuming=resume is not None)
    if checkpoint is not None:
        check_resumable(checkpoint, cfg)
    else:
        check_init_from(cfg)
    for warning in warnings:
        _warn(warning)
    if checkpoint is not None and checkpoint.step >= cfg.train.max_steps:
        out.print(f"partrain: {run_dir} is trained to step {checkpoint.step} = train.max_steps "
                  f"({checkpoint.path}); nothing to do (to train on: partrain launch --resume "
                  f"{run_dir} train.max_steps=N)")
        return
    resuming_from = (f"; resuming from step {checkpoint.step} ({checkpoint.path})"
                     if checkpoint is not None else "")
    if dry_run:
        print_plan(build_plan(cfg, world, []), out)
        out.print(f"data: {data_description}")
        if network:
            out.print(f"network: {network.addr} on {network.ifname or '?'} ({network.how})")
        out.print(f"dry run: would write {run_dir} (checked: it can be made) and start "
                  f"{world.nproc_per_node} worker(s) on this node{resuming_from}; nothing started")
        return

    write_run_dir(cfg, run_dir, resuming=resume is not None)
    out.print(f"partrain: run dir {run_dir}; {world.size} rank(s), {world.nproc_per_node} on this "
              f"node (node {node_rank} of {world.nnodes}, {place.source}); logs in "
              f"{run_dir / 'logs'}{resuming_from}")
    if network:
        variables = set_ifname_variables(network)
        out.print(f"network: rendezvous {rdzv_endpoint}; this node is {network.addr} on "
                  f"{network.ifname or 'an unknown interface'} ({network.how}); "
                  f"{', '.join(variables) or 'set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME yourself'}",
                  soft_wrap=True)
    cpu = not _runs_on_cuda(cfg)
    spec = ElasticLaunch(
        nnodes=world.nnodes, nproc_per_node=world.nproc_per_node, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint, run_id=f"slurm-{place.job_id}" if place.job_id else cfg.name,
        rdzv_timeout_s=cfg.launcher.rdzv_timeout_s, local_addr=network and network.addr,
        cpu_threads=_cpu_threads(world.nproc_per_node) if cpu else None,
        max_steps=cfg.train.max_steps)
    code = launch_workers(run_dir, spec, console_print=err.print)
    if code == 0:
        out.print(f"done: metrics in {run_dir / 'metrics.jsonl'}")
    raise typer.Exit(code)


@app.command()
def slurm(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    nodes: int = typer.Option(..., "--nodes", metavar="N", parser=_whole("--nodes"),
                              help="Nodes to ask for"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", metavar="G",
                                                parser=_whole("--gpus-per-node")),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", metavar="N", parser=_whole("--nproc-per-node"),
        help="Ranks per node; default: --gpus-per-node, else launcher.nproc_per_node, else the "
        "degrees' product over the nodes"),
    partition: Optional[str] = typer.Option(None, "--partition"),
    time_limit: Optional[str] = typer.Option(None, "--time", help="SLURM time limit, e.g. 04:00:00"),
    account: Optional[str] = typer.Option(None, "--account"),
    qos: Optional[str] = typer.Option(None, "--qos"),
    sbatch_args: Optional[List[str]] = typer.Option(
        None, "--sbatch-arg", help="Another #SBATCH option, e.g. --sbatch-arg=--exclusive (repeatable)"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Default: runs/<name>-<time>"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the run dir and print the script "
                                 "(`> job.sh` gives a runnable script); submit nothing"),
) -> None:
    """Validate for nodes x ranks, write the run dir and its sbatch script, and submit it."""
    from partrain.data.tokens import check_data
    from partrain.launch.preflight import check_init_from
    from partrain.launch.rundir import check_run_dir, default_run_dir, write_run_dir
    from partrain.launch.slurm import (
        SlurmJob,
        partrain_command,
        passed_through_env,
        remove_prepared,
        render_script,
        submit,
        write_script,
    )
    from partrain.observe.curves import check_curves

    cfg, world, warnings = _resolve(args, nodes, nproc_per_node or gpus_per_node)
    check_startable(world)
    check_data(cfg)
    check_curves(cfg)
    check_init_from(cfg)
    run_dir = (run_dir or default_run_dir(cfg.name)).absolute()
    check_run_dir(run_dir)
    job = SlurmJob(run_dir=run_dir, job_name=cfg.name, nodes=world.nnodes,
                   nproc_per_node=world.nproc_per_node, partrain=partrain_command(),
                   gpus_per_node=gpus_per_node, partition=partition, time=time_limit,
                   account=account, qos=qos, sbatch_args=tuple(sbatch_args or ()),
                   env=passed_through_env())
    script_text = render_script(job)  # refuses unsafe values before anything is written
    for warning in warnings:
        _warn(warning)
    created = not run_dir.exists()
    write_run_dir(cfg, run_dir)
    try:
        script = write_script(job)
    except OSError as e:
        remove_prepared(run_dir, created)
        raise ConfigError(f"--run-dir {run_dir} cannot be written: {e.strerror}") from None
    if dry_run:
        sys.stdout.write(script_text)
        err.print(f"dry run: wrote {run_dir / 'config.yaml'} and {script}; nothing submitted "
                  f"(submit with: sbatch {script})")
        return
    try:
        job_id = submit(script)
    except ConfigError:
        remove_prepared(run_dir, created)
        raise
    out.print(f"submitted job {job_id}: {world.nnodes} node(s) x {world.nproc_per_node} rank(s); "
              f"run dir {run_dir}", soft_wrap=True)
    out.print(f"logs: {run_dir / 'logs' / f'slurm-{job_id}.out'} (the job), "
              f"{run_dir / 'logs'}/rank-N.log (each rank); metrics: {run_dir / 'metrics.jsonl'}",
              soft_wrap=True)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _runs_on_cuda(cfg) -> bool:
    """Where this machine's workers will run: launcher.device, `auto` = CUDA when visible."""
    return cfg.launcher.device == "cuda" or (cfg.launcher.device == "auto" and _has_cuda())


def _cpu_threads(nproc: int) -> int:
    import os

    return max(1, (os.cpu_count() or 1) // nproc)


@app.command()
def plan(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    world_size: Optional[int] = typer.Option(None, "--world-size", metavar="N",
                                             parser=_whole("--world-size"),
                                             help="Plan for N ranks; default: the config's "
                                             "nodes x ranks per node, else the degrees' product"),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
    search: bool = typer.Option(False, "--search", help="Rank every layout of the config's model "
                                "and batch on --gpus GPUs of --hardware by predicted tokens/s"),
    gpus: Optional[int] = typer.Option(None, "--gpus", metavar="N", parser=_whole("--gpus"),
                                       help="--search: the GPUs to lay out"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", metavar="G",
                                                parser=_whole("--gpus-per-node"),
                                                help="--search: GPUs per node (default: the "
                                                "hardware's)"),
    hardware: str = typer.Option("H100-SXM", "--hardware", metavar="NAME_OR_YAML",
                                 help="--search: A100-80GB, H100-SXM, H200 or a YAML file"),
    write_recipe: Optional[Path] = typer.Option(None, "--write-recipe", metavar="PATH",
                                                help="--search: write the best layout as a "
                                                "recipe that launch and slurm run as it is"),
) -> None:
    """Show every rank's place in the mesh, the groups and the batch arithmetic; start nothing.
    With --search: the best layouts for N GPUs instead."""
    from partrain.plan.layout import build_plan
    from partrain.plan.render import print_plan

    if search:
        _search(args, gpus, gpus_per_node, hardware, write_recipe, as_json)
        return
    for flag, value in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node),
                        ("--write-recipe", write_recipe)):
        if value is not None:
            raise ConfigError(f"{flag} is a --search option; add --search")
    cfg, world, warnings = _resolve(args, world_size=world_size)
    result = build_plan(cfg, world, warnings)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_plan(result, out)


def _search(args, gpus, gpus_per_node, hardware, write_recipe, as_json) -> None:
    import shlex

    from partrain.plan.hardware import load_hardware
    from partrain.plan.search import as_json as search_json
    from partrain.plan.search import check_request, print_search, validated
    from partrain.plan.search import search as run_search
    from partrain.plan.search import write_recipe as write

    if gpus is None:
        raise ConfigError("--search needs --gpus N")
    hw = load_hardware(hardware)
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node {gpus_per_node} must be at least 1")
        hw = dataclasses.replace(hw, gpus_per_node=gpus_per_node)
    check_request(gpus, hw)
    config, overrides = _split_args(args)
    cfg = compose_config(config, overrides)
    result = validated(run_search(cfg, gpus, hw, top=40), config, overrides, gpus, hw)
    if write_recipe is not None:
        command = " ".join(["partrain plan --search", shlex.join(args or []), f"--gpus {gpus}",
                            f"--gpus-per-node {hw.gpus_per_node}", f"--hardware {hardware}"])
        write(write_recipe, result, command)
    if as_json:
        sys.stdout.write(json.dumps(search_json(result), indent=2) + "\n")
    else:
        print_search(result, out)
        if write_recipe is not None and result["best"]:
            out.print(f"wrote {write_recipe}: partrain launch {write_recipe}")


@app.command()
def show(args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False)) -> None:
    """Print the resolved config as YAML (what config.yaml in the run dir would hold)."""
    cfg, _, warnings = _resolve(args)
    sys.stdout.write(OmegaConf.to_yaml(cfg))
    if cfg.parallel.zero_stage > 0:
        from partrain.config.deepspeed import deepspeed_config

        text = json.dumps(deepspeed_config(cfg, _runs_on_cuda(cfg)), indent=2)
        sys.stdout.write("# The DeepSpeed config the workers derive (partrain/parallel/zero.py):\n"
                         + "".join(f"# {line}\n" for line in text.splitlines()))
    for warning in warnings:
        _warn(warning)


SOURCE_HELP = ("A checkpoint (RUN_DIR/checkpoints/step-N) or a run dir (its newest checkpoint)")


@app.command()
def export(
    source: Path = typer.Argument(..., metavar="RUN_DIR_OR_CHECKPOINT", help=SOURCE_HELP,
                                  show_default=False),
    out_dir: Path = typer.Option(..., "--out", help="New directory for the export"),
    fmt: str = typer.Option("hf", "--format", help="hf: a transformers LlamaForCausalLM "
                            "directory (config.json, safetensors)"),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 or bf16"),
    max_shard_mb: int = typer.Option(5000, "--max-shard-mb", metavar="MB",
                                     parser=_whole("--max-shard-mb"),
                                     help="Safetensors files of at most MB megabytes, with an "
                                     "index file when there are several"),
) -> None:
    """Write a checkpoint's weights in another library's format, on one process."""
    from partrain.checkpoint.store import find
    from partrain.interop.hf import export_hf

    if fmt != "hf":
        raise ConfigError(f"--format {fmt} is not a format partrain writes (formats: hf)")
    checkpoint = find(source, "RUN_DIR_OR_CHECKPOINT")
    info = export_hf(checkpoint, out_dir, dtype, max_shard_mb)
    out.print(f"exported {checkpoint.path} (step {info['step']}) to {out_dir}: {info['tensors']} "
              f"tensors, {info['bytes']:,} bytes in {dtype}, {len(info['files'])} safetensors "
              f"file(s); load with transformers.AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")


@app.command()
def sample(
    source: Path = typer.Argument(..., metavar="RUN_DIR_OR_CHECKPOINT", help=SOURCE_HELP,
                                  show_default=False),
    prompt: str = typer.Option(..., "--prompt", help="The text to continue"),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", metavar="N",
                                       parser=_whole("--max-new-tokens")),
    temperature: float = typer.Option(0.8, "--temperature", metavar="T",
                                      parser=_number("--temperature"),
                                      help="0 = always the most likely token"),
    top_k: int = typer.Option(50, "--top-k", metavar="K", parser=_whole("--top-k", minimum=0),
                              help="Draw from the K most likely tokens; 0 = all"),
    seed: int = typer.Option(0, "--seed", metavar="S", parser=_whole("--seed", minimum=0)),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when visible), cpu or cuda"),
) -> None:
    """Generate text from a checkpoint on one process, streamed as it comes."""
    from partrain.checkpoint.offline import checkpoint_model
    from partrain.checkpoint.store import find
    from partrain.data.tokenizer import TextTokenizer, run_tokenizer_dir
    from partrain.interop.sample import check_options, encode, generate

    check_options(prompt, max_new_tokens, temperature, top_k, seed)
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device} is not one of auto, cpu, cuda")
    if device == "cuda" and not _has_cuda():
        raise ConfigError("--device cuda: no CUDA device is visible")
    checkpoint = find(source, "RUN_DIR_OR_CHECKPOINT")
    on_cuda = device == "cuda" or (device == "auto" and _has_cuda())
    model, cfg = checkpoint_model(checkpoint, "cuda" if on_cuda else "cpu")
    run_dir = checkpoint.path.parent.parent
    tokenizer = TextTokenizer(run_tokenizer_dir(run_dir, cfg.data))
    ids = encode(tokenizer, prompt, cfg.model.vocab_size)
    err.print(f"{checkpoint.path} (step {checkpoint.step}), seed {seed}, temperature "
              f"{temperature}, top-k {top_k or 'all'}:")

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    emit(prompt)
    generate(model, tokenizer, ids, max_new_tokens, temperature, top_k, seed, cfg.model.max_seq_len, emit)
    emit("\n")


@data_app.command("prepare")
def data_prepare(
    inputs: List[Path] = typer.Argument(..., metavar="INPUTS...",
                                        help="Text, JSON Lines (.jsonl) and Parquet files, or "
                                        "directories of them (recursively), in the given order"),
    out_dir: Path = typer.Option(..., "--out", help="New directory for train.bin, val.bin, meta.json"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", metavar="PATH",
                                             help="A tokenizer.json (tokenizers library) or a "
                                             "directory holding one; default: a token per byte"),
    field: str = typer.Option("text", "--field", help="The field of each JSON Lines record or "
                              "Parquet row that holds the document"),
    eot: Optional[str] = typer.Option(None, "--eot", metavar="TOKEN",
                                      help="The token after each document (default: the "
                                      "tokenizer's eos_token, or <|endoftext|> and kin)"),
    workers: Optional[int] = typer.Option(None, "--workers", metavar="N",
                                          parser=_whole("--workers"),
                                          help="Tokenizer processes (default: one per core)"),
    val_fraction: float = typer.Option(0.05, "--val-fraction", metavar="F",
                                       parser=_number("--val-fraction"),
                                       help="Share of the tokens held out for validation, in (0, 1)"),
) -> None:
    """Tokenize text into a token dir for data=tokens data.path=DIR."""
    import time

    from partrain.data.prepare import default_workers, prepare_token_dir, summary

    workers = workers or default_workers()
    start = time.perf_counter()
    meta = prepare_token_dir(inputs, out_dir, val_fraction, tokenizer, field, eot, workers, err)
    for line in summary(meta, out_dir, time.perf_counter() - start, workers):
        out.print(line)


def _error(message: str) -> None:
    err.print(Text.assemble(("error:", "bold red"), " ", message))


def main() -> None:
    """The console script: every usage, config or data error is one `error:` line and exit 2."""
    try:
        code = app(standalone_mode=False)
    except ConfigError as e:
        _error(str(e))
        code = 2
    except typer.exceptions.TyperException as e:
        if not hasattr(e, "format_message"):  # not a usage error: a bug, keep its traceback
            raise
        ctx = getattr(e, "ctx", None)
        hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        _error(e.format_message() + hint)
        code = getattr(e, "exit_code", 2)
    except typer.Abort:
        _error("aborted")
        code = 130
    except OSError as e:  # a path the system refuses (too long, a symlink loop) as input
        _error(f"{str(e.filename or '')[:200]}: {e.strerror or e}")
        code = 2
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

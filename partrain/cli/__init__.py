"""The `partrain` command: launch, slurm, plan, show, export, sample, runs, data prepare.

Each command is its Typer signature and a call: `launch` and `slurm` hand their flags to
partrain.launch.start; `plan` and `show` get the resolved config from partrain.launch.preflight,
which holds every check before a start, in one order. Every command composes and validates the
config before it does anything; a ConfigError becomes one message on stderr and exit code 2, with
nothing started and nothing written.
"""

import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from omegaconf import OmegaConf
from rich.text import Text

from partrain.cli.consoles import err, out
from partrain.cli.data import data_app
from partrain.cli.parsers import nnodes_flag, nproc_flag, number_flag, whole_flag
from partrain.cli.usage import meant, missing_value
from partrain.errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="Train decoder-only transformers with data, tensor, pipeline and ZeRO "
                       "parallelism from Hydra configs.")


ARGS_HELP = "[CONFIG] [OVERRIDE...]: a recipe name or YAML path, then Hydra overrides (key=value)"

app.add_typer(data_app, name="data")


def _warn(text: str) -> None:
    err.print(Text.assemble(("warning:", "yellow"), " ", text))


@app.command(context_settings={"allow_extra_args": False})
def launch(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Default: runs/<name>-<time>"),
    nproc_per_node: Optional[str] = typer.Option(
        None, "--nproc-per-node", "--nproc_per_node", metavar="N|gpu|cpu|auto",
        parser=nproc_flag("--nproc-per-node"),
        help="Ranks on this node; gpu: the visible GPUs (none: exit 2), cpu: the usable cores, "
        "auto: the GPUs the workers use, else the cores (as torchrun counts them)"),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", metavar="N", parser=nnodes_flag,
                                         help="Nodes in the job (torchrun's MIN:MAX with MIN = "
                                         "MAX too)"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", "--node_rank", metavar="R",
                                            parser=whole_flag("--node-rank", 0),
                                            help="0 on the node that hosts the rendezvous; "
                                            "default 0 (SLURM: SLURM_NODEID)"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", "--rdzv_endpoint",
                                                help="HOST:PORT of node 0"),
    master_addr: Optional[str] = typer.Option(
        None, "--master-addr", "--master_addr", metavar="HOST",
        help="torchrun's spelling: --master-addr HOST --master-port PORT is --rdzv-endpoint "
        "HOST:PORT (default 127.0.0.1, 29500)"),
    master_port: Optional[int] = typer.Option(None, "--master-port", "--master_port",
                                              metavar="PORT", parser=whole_flag("--master-port"),
                                              help="See --master-addr"),
    standalone: bool = typer.Option(False, "--standalone", help="One node on a free local port "
                                    "(partrain's default for one node; torchrun's spelling)"),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", "--rdzv_id", metavar="ID",
                                          help="The job's id at the rendezvous, the same on every "
                                          "node; default: the run's name (SLURM: the job id)"),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", "--rdzv_backend",
                                               metavar="c10d",
                                               help="Accepted for torchrun's command lines: "
                                               "partrain always runs c10d (static is read as it)"),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", "--local_addr",
                                             help="This node's address for the others; default: "
                                             "the route to the endpoint"),
    ifname: Optional[str] = typer.Option(None, "--ifname", help="Network interface for gloo/NCCL; "
                                         "default: the one that routes to the endpoint"),
    resume: Optional[Path] = typer.Option(
        None, "--resume", metavar="RUN_DIR", help="Continue the run in RUN_DIR from its newest "
        "checkpoint; OVERRIDEs may change the layout (parallel.*, launcher.*, micro-batches) and "
        "train.max_steps (past the checkpoint's step)"),
    max_restarts: Optional[int] = typer.Option(
        None, "--max-restarts", "--max_restarts", metavar="N", parser=whole_flag("--max-restarts", 0),
        help="Restart every node's workers up to N times after a rank fails, from the newest "
        "checkpoint (launcher.max_restarts)"),
    start_method: Optional[str] = typer.Option(
        None, "--start-method", "--start_method", metavar="spawn|forkserver|auto",
        help="How the ranks start (launcher.start_method; torchrun's flag): spawn, a new "
        "interpreter each; forkserver, forks of one process per node that imported torch once; "
        "auto (the default), forkserver on CPU and spawn on CUDA"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show the plan; start nothing"),
) -> None:
    """Compose, validate, write the run dir and train on this node's ranks (or continue the run
    a run dir holds, from its newest checkpoint). torchrun's launcher flags work as they are
    (--nproc_per_node, --node_rank, --rdzv_endpoint, --master_addr, --standalone, ...)."""
    from partrain.launch.preflight import LAUNCH, Request
    from partrain.launch.start import start
    from partrain.launch.torchrun import read_rendezvous

    if max_restarts is not None:  # the flag wins over the key, as --nnodes does
        args = [*(args or []), f"launcher.max_restarts={max_restarts}"]
    if start_method is not None:
        args = [*(args or []), f"launcher.start_method={start_method}"]

    meet = read_rendezvous(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                           master_addr=master_addr, master_port=master_port,
                           standalone=standalone, rdzv_id=rdzv_id, rdzv_backend=rdzv_backend)
    request = Request(args, LAUNCH, nnodes=meet.nnodes, nproc_per_node=nproc_per_node,
                      run_dir=run_dir, resume=resume, node_rank=meet.node_rank,
                      rdzv_endpoint=meet.endpoint, rdzv_from=meet.endpoint_from,
                      rdzv_id=meet.run_id, local_addr=local_addr, ifname=ifname)
    raise typer.Exit(start(request, dry_run, out, err, _warn))


@app.command()
def slurm(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    nodes: int = typer.Option(..., "--nodes", "--nnodes", metavar="N", parser=whole_flag("--nodes"),
                              help="Nodes to ask for (--nnodes: torchrun's spelling)"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", metavar="G",
                                                parser=whole_flag("--gpus-per-node")),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", "--nproc_per_node", metavar="N",
        parser=nproc_flag("--nproc-per-node", words=False),
        help="Ranks per node; default: --gpus-per-node, else launcher.nproc_per_node, else the "
        "degrees' product over the nodes"),
    partition: Optional[str] = typer.Option(None, "--partition"),
    time_limit: Optional[str] = typer.Option(None, "--time", help="SLURM time limit, e.g. 04:00:00"),
    account: Optional[str] = typer.Option(None, "--account"),
    qos: Optional[str] = typer.Option(None, "--qos"),
    cpus_per_task: Optional[int] = typer.Option(
        None, "--cpus-per-task", metavar="N", parser=whole_flag("--cpus-per-task"),
        help="CPUs per node for its ranks (srun's step asks for them too); default: none asked, "
        "the step gets the job's CPUs on each node"),
    mem: Optional[str] = typer.Option(None, "--mem", metavar="SIZE",
                                      help="Memory per node, e.g. 64G or 500M; 0 = all of it"),
    exclusive: bool = typer.Option(False, "--exclusive", help="Whole nodes: no other job on them"),
    setup: Optional[List[str]] = typer.Option(
        None, "--setup", metavar="LINE", help="A shell line run on every node before partrain, "
        "after launcher.setup's, e.g. --setup 'module load cuda/12.4' (repeatable)"),
    sbatch_args: Optional[List[str]] = typer.Option(
        None, "--sbatch-arg", help="Another #SBATCH option, e.g. --sbatch-arg=--constraint=a100 "
        "(repeatable)"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Default: runs/<name>-<time>"),
    resume: Optional[Path] = typer.Option(
        None, "--resume", metavar="RUN_DIR", help="Continue RUN_DIR from its newest checkpoint "
        "on this job's nodes x ranks (the layout may change): its config and script are "
        "rewritten; OVERRIDEs as for launch --resume"),
    max_restarts: Optional[int] = typer.Option(
        None, "--max-restarts", "--max_restarts", metavar="N", parser=whole_flag("--max-restarts", 0),
        help="In-job restarts after a rank fails (launcher.max_restarts, frozen in the run dir)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the run dir and print the script "
                                 "(`> job.sh` gives a runnable script); submit nothing"),
) -> None:
    """Validate for nodes x ranks, write the run dir and its sbatch script, and submit it."""
    from partrain.launch.preflight import SLURM, Request
    from partrain.launch.start import prepare_job

    if max_restarts is not None:
        args = [*(args or []), f"launcher.max_restarts={max_restarts}"]

    # --nproc-per-node defaults to --gpus-per-node (its help says so), then to the config's.
    request = Request(args, SLURM, nnodes=nodes, nproc_per_node=nproc_per_node or gpus_per_node,
                      run_dir=run_dir, resume=resume)
    prepare_job(request, dry_run, out, err, _warn, gpus_per_node=gpus_per_node,
                partition=partition, time=time_limit, account=account, qos=qos,
                cpus_per_task=cpus_per_task, mem=mem, exclusive=exclusive,
                setup=tuple(setup or ()), sbatch_args=tuple(sbatch_args or ()))


@app.command()
def plan(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    world_size: Optional[int] = typer.Option(None, "--world-size", metavar="N",
                                             parser=whole_flag("--world-size"),
                                             help="Plan for N ranks; default: the config's "
                                             "nodes x ranks per node, else the degrees' product"),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
    search: bool = typer.Option(False, "--search", help="Rank every layout of the config's model "
                                "and batch on --gpus GPUs of --hardware by predicted tokens/s"),
    gpus: Optional[int] = typer.Option(None, "--gpus", metavar="N", parser=whole_flag("--gpus"),
                                       help="--search: the GPUs to lay out"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", metavar="G",
                                                parser=whole_flag("--gpus-per-node"),
                                                help="--search: GPUs per node (default: the "
                                                "hardware's)"),
    hardware: Optional[str] = typer.Option(
        None, "--hardware", metavar="NAME_OR_YAML",
        help="The GPUs: A100-80GB, H100-SXM (the default), H200, B200, MI300X or a YAML file. "
        "Without --search: check that this layout fits them and price its step on them"),
    tokens_per_step: Optional[str] = typer.Option(
        None, "--tokens-per-step", metavar="TOKENS",
        help="The global batch in tokens (K = 1,024, M = 1,048,576: 4M): train.global_batch_size "
        "= TOKENS / train.seq_len"),
    explain: Optional[str] = typer.Option(
        None, "--explain", metavar="'tp=8 pp=8'",
        help="--search: where the best layout with these values ranks and why, or what rules "
        "it out"),
    write_recipe: Optional[Path] = typer.Option(None, "--write-recipe", metavar="PATH",
                                                help="--search: write the best layout as a "
                                                "recipe that launch and slurm run as it is"),
) -> None:
    """Show every rank's place in the mesh, the groups and the batch arithmetic; start nothing.
    On a GPU target (launcher.device=cuda or --hardware): whether each stage fits the GPU's
    memory, and the step's time. With --search: the best layouts for N GPUs instead."""
    from partrain.cli.plan import plan_command

    plan_command(list(args or []), world_size, as_json, search, gpus, gpus_per_node, hardware,
                 tokens_per_step, explain, write_recipe, out)


@app.command()
def show(
    args: Optional[List[str]] = typer.Argument(None, help=ARGS_HELP, show_default=False),
    keys: bool = typer.Option(False, "--keys", help="List every config key with its type, the "
                              "schema's default and its meaning (docs/config-keys.md is "
                              "generated from the same table)"),
) -> None:
    """Print the resolved config as YAML (what config.yaml in the run dir would hold)."""
    from partrain.launch.preflight import PLAN, Request, preflight, runs_on_cuda

    if keys:
        if args:
            raise ConfigError(f"--keys lists the schema's keys and takes no CONFIG or OVERRIDE "
                              f"(got {' '.join(args)}); `partrain show RECIPE` prints a recipe's "
                              "resolved values")
        from partrain.config.keys import key_table, shown

        for row in key_table():
            out.print(f"{row.key} ({row.type}, default {shown(row.default)}): {row.help}")
        return
    ready = preflight(Request(args, PLAN))
    cfg, warnings = ready.cfg, ready.warnings
    from partrain.config.paths import with_anchored_paths

    sys.stdout.write(OmegaConf.to_yaml(with_anchored_paths(cfg)))  # as a run dir would freeze it
    if cfg.parallel.zero_stage > 0 and cfg.parallel.zero_backend == "deepspeed":
        from partrain.config.deepspeed import deepspeed_config

        text = json.dumps(deepspeed_config(cfg, runs_on_cuda(cfg)), indent=2)
        sys.stdout.write("# The DeepSpeed config the workers derive (partrain/config/deepspeed.py):\n"
                         + "".join(f"# {line}\n" for line in text.splitlines()))
    for warning in warnings:
        _warn(warning)


SOURCE_HELP = ("A checkpoint (RUN_DIR/checkpoints/step-N) or a run dir (its newest checkpoint)")


@app.command()
def export(
    source: Path = typer.Argument(..., metavar="RUN_DIR_OR_CHECKPOINT", help=SOURCE_HELP,
                                  show_default=False),
    out_dir: Path = typer.Option(..., "--out", help="New directory for the export"),
    fmt: str = typer.Option("hf", "--format", help="hf: a transformers directory (config.json, "
                            "safetensors) of a Llama, Mistral, Qwen2 or Qwen3"),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 or bf16"),
    max_shard_mb: int = typer.Option(5000, "--max-shard-mb", metavar="MB",
                                     parser=whole_flag("--max-shard-mb"),
                                     help="Safetensors files of at most MB megabytes, with an "
                                     "index file when there are several"),
) -> None:
    """Write a checkpoint's weights in another library's format, on one process."""
    from partrain.checkpoint.offline import read_checkpoint
    from partrain.checkpoint.verify import check_whole
    from partrain.interop.hf import export_hf

    if fmt != "hf":
        raise ConfigError(f"--format {fmt} is not a format partrain writes (formats: hf)")

    def read(checkpoint):
        check_whole(checkpoint, "RUN_DIR_OR_CHECKPOINT", read_all=True)
        return checkpoint, export_hf(checkpoint, out_dir, dtype, max_shard_mb)

    checkpoint, info = read_checkpoint(source, "RUN_DIR_OR_CHECKPOINT", read)
    out.print(f"exported {checkpoint.path} (step {info['step']}) to {out_dir}: {info['tensors']} "
              f"tensors, {info['bytes']:,} bytes in {dtype}, {len(info['files'])} safetensors "
              f"file(s); load with transformers.AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")


@app.command()
def sample(
    source: Path = typer.Argument(..., metavar="RUN_DIR_OR_CHECKPOINT", help=SOURCE_HELP,
                                  show_default=False),
    prompt: str = typer.Option(..., "--prompt", help="The text to continue"),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", metavar="N",
                                       parser=whole_flag("--max-new-tokens")),
    temperature: float = typer.Option(0.8, "--temperature", metavar="T",
                                      parser=number_flag("--temperature"),
                                      help="0 = always the most likely token"),
    top_k: int = typer.Option(50, "--top-k", metavar="K", parser=whole_flag("--top-k", minimum=0),
                              help="Draw from the K most likely tokens; 0 = all"),
    seed: int = typer.Option(0, "--seed", metavar="S", parser=whole_flag("--seed", minimum=0)),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when visible), cpu or cuda"),
) -> None:
    """Generate text from a checkpoint on one process, streamed as it comes."""
    from partrain.checkpoint.offline import checkpoint_model, read_checkpoint
    from partrain.checkpoint.verify import check_whole
    from partrain.data.tokenizer import TextTokenizer, run_tokenizer_dir
    from partrain.interop.sample import check_options, check_weights, encode, generate
    from partrain.launch.preflight import has_cuda

    check_options(prompt, max_new_tokens, temperature, top_k, seed)
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device} is not one of auto, cpu, cuda")
    if device == "cuda" and not has_cuda():
        raise ConfigError("--device cuda: no CUDA device is visible")
    on_cuda = device == "cuda" or (device == "auto" and has_cuda())

    def read(checkpoint):
        check_whole(checkpoint, "RUN_DIR_OR_CHECKPOINT", read_all=True)
        return checkpoint, *checkpoint_model(checkpoint, "cuda" if on_cuda else "cpu")

    checkpoint, model, cfg = read_checkpoint(source, "RUN_DIR_OR_CHECKPOINT", read)
    check_weights(model, checkpoint.path)  # a nan: refused before the prompt is printed
    run_dir = checkpoint.path.parent.parent
    tokenizer = TextTokenizer(run_tokenizer_dir(run_dir, cfg.data, cfg.model.vocab_size))
    ids = encode(tokenizer, prompt, cfg.model.vocab_size)
    err.print(f"{checkpoint.path} (step {checkpoint.step}), seed {seed}, temperature "
              f"{temperature}, top-k {top_k or 'all'}:")

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    emit(prompt)
    generate(model, tokenizer, ids, max_new_tokens, temperature, top_k, seed, cfg.model.max_seq_len, emit)
    emit("\n")


@app.command()
def runs(
    root: Path = typer.Option(Path("runs"), "--root", metavar="DIR",
                              help="The folder of run dirs (or one run dir)"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per run dir, in a list"),
) -> None:
    """List the run dirs under ./runs: state (running, done, failed, preempted, ...), last step
    and loss, newest checkpoint. Reads only; what it cannot read is `unknown`."""
    from partrain.config.paths import what_is
    from partrain.launch.runs import list_runs, render
    from partrain.observe.metrics import strict

    found = what_is(root)
    if found == "does not exist" and root == Path("runs"):  # nothing launched here yet
        if as_json:
            sys.stdout.write("[]\n")
        else:
            out.print("no run dirs: ./runs does not exist (partrain launch writes run dirs "
                      "there; --root DIR reads another folder)")
        return
    if found != "is a directory":
        raise ConfigError(f"--root {root} {found}; give the folder that holds run dirs")
    listed = list_runs(root)
    if as_json:
        # strict JSON: a loss a run dir recorded as NaN (written before metrics were strict) is null
        sys.stdout.write(json.dumps([strict(run.as_json()) for run in listed], indent=2,
                                    allow_nan=False) + "\n")
    elif not listed:
        out.print(f"no run dirs under {root}")
    else:
        for line in render(listed):
            out.print(line)


def _error(message: str) -> None:
    err.print(Text.assemble(("error:", "bold red"), " ", message))


def main() -> None:
    """The CLI in this process (in-process tests): every usage, config or data error is one
    `error:` line and SystemExit(2)."""
    sys.exit(_run())


def console() -> None:
    """The console script and `python -m partrain`: main(), then the process ends without the
    interpreter's teardown (unloading torch module by module: about 0.4 s of CPU after every
    launch or plan). Every command has closed its files by then; what it printed is flushed."""
    # Signals a parent left blocked stay blocked across exec: a launcher started so (a job
    # runner's mask; it was seen under the test suite) took no Ctrl-C, SIGTERM or preemption
    # signal and trained on until killed. Unblocked here; an ignored one (a background job's
    # SIGINT) stays ignored, as the shell meant.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                signal.SIGUSR2})
    # OmegaConf's grammar warns, with its own source path, of `${oc.env:X,}` before partrain's
    # one line says what is wrong with the value (a reviewer's find).
    warnings.filterwarnings("ignore", message="In the sequence", category=UserWarning)
    code = _run()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run() -> int:
    """Run the command line; its exit code."""
    try:
        problem = missing_value(typer.main.get_command(app), sys.argv[1:])
        if problem is not None:
            raise ConfigError(problem)
        code = app(standalone_mode=False)
    except ConfigError as e:
        _error(str(e))
        code = 2
    except typer.exceptions.TyperException as e:
        if not hasattr(e, "format_message"):  # not a usage error: a bug, keep its traceback
            raise
        ctx = getattr(e, "ctx", None)
        hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        _error(meant(e, ctx) + hint)
        code = getattr(e, "exit_code", 2)
    except typer.Abort:
        _error("aborted")
        code = 130
    except OSError as e:  # a path the system refuses (too long, a symlink loop) as input
        _error(f"{str(e.filename or '')[:200]}: {e.strerror or e}")
        code = 2
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    console()

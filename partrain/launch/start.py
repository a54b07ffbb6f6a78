"""The bodies of `partrain launch` and `partrain slurm`, after their flags are read.

`start`: preflight (every check, in preflight.py's order), then the run dir written and this
node's workers run under the elastic agent (local.py) to the end; --dry-run stops after the checks
and prints what it would do. `prepare_job`: preflight, then the run dir and its sbatch script
written (slurm.py) and submitted, or printed for --dry-run. Both print on the CLI's consoles: what
a user reads on stdout, the workers' failures and the progress of a submission on stderr.
"""

import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rich.console import Console

from partrain.checkpoint import store
from partrain.config.frozen import CONFIG
from partrain.errors import ConfigError
from partrain.launch.cluster import usable_cores
from partrain.launch.forked import rank_server
from partrain.launch.heap import imports_without_gc
from partrain.launch.lifeline import LAUNCHER_PID_ENV
from partrain.launch.netif import set_ifname_variables
from partrain.launch.preemption import FORWARDER
from partrain.launch.preflight import Ready, Request, preflight, runs_on_cuda
from partrain.launch.rundir import (
    hold_run_dir,
    nearest_existing,
    node_local_warning,
    remove_made,
    trained_in,
    write_run_dir,
)
from partrain.launch.runs import ENDED, STATE_FILE, ended_done_at, write_state
from partrain.launch.sbatch_checks import SlurmJob, check_sbatch_env
from partrain.launch.slurm import (
    SCRIPT,
    SubmissionUnknown,
    check_no_job_in,
    dropped_settings,
    job_files,
    partrain_command,
    put_back,
    passed_through_env,
    remove_prepared,
    render_script,
    submit,
    write_script,
)
from partrain.parallel.nvme import remove_swap_dir
from partrain.plan.layout import build_plan
from partrain.plan.render import print_plan


def start(request: Request, dry_run: bool, out: Console, err: Console,
          warn: Callable[[str], None]) -> int:
    """Check, write the run dir and run this node's ranks to the end (or continue the run the run
    dir holds, from its newest checkpoint); returns the exit code (local.py's)."""
    FORWARDER.install()  # a preemption signal from here on is passed to the workers
    ready = preflight(request)
    for warning in ready.warnings:
        warn(warning)
    cfg, run_dir, checkpoint = ready.cfg, ready.run_dir, ready.checkpoint
    if checkpoint is not None and checkpoint.step >= cfg.train.max_steps:
        out.print(f"partrain: {run_dir} is trained to step {checkpoint.step} = train.max_steps "
                  f"({checkpoint.path}); nothing to do (to train on: partrain launch --resume "
                  f"{run_dir} train.max_steps=N)")
        return 0
    if checkpoint is not None and not store.saves_at(cfg.checkpoint, cfg.train.max_steps, True) \
            and ended_done_at(run_dir, cfg.train.max_steps):
        # Its newest checkpoint is before the end (save_last=false): a launch would train the
        # steps after it again and write their metrics over the ones it has.
        out.print(f"partrain: {run_dir} is trained to train.max_steps={cfg.train.max_steps} "
                  f"(its metrics.jsonl; checkpoint.save_last=false kept no checkpoint of the "
                  f"last step, the newest is step {checkpoint.step}); nothing to do (to train on: "
                  f"partrain launch --resume {run_dir} train.max_steps=N)")
        return 0
    resuming_from = (f"; resuming from step {checkpoint.step} ({checkpoint.path})"
                     if checkpoint is not None else
                     "; it trained before without committing a checkpoint, so the run starts "
                     "again from step 1" if trained_in(run_dir) else "")
    if ready.changed:  # after a spike: optim.lr 0.003 -> 0.0001, and any change of layout
        out.print("changed on resume: " + ", ".join(ready.changed))
    building = deepspeed_builds(cfg)
    if building:
        out.print(building)
    if dry_run:
        print_dry_run(ready, resuming_from, out)
        return 0
    # Every check has passed: this node's hold on the run dir (a launch started beside this one
    # is refused now, not once this one says it runs), then forked ranks' server starts, its
    # imports beside the launcher's.
    with hold_run_dir(run_dir, ready.node.rank, resuming=request.resume is not None):
        server = (rank_server(run_dir, ready.world.nproc_per_node, compiles(cfg))
                  if start_method(cfg) == "forkserver" else nullcontext())
        with _environment(rank_env(ready)), server:
            with interrupts_held(), imports_without_gc():  # torch, the elastic agent (heap.py)
                from partrain.launch.local import launch_workers

            before = _config_before(run_dir, checkpoint)
            # Going on from a checkpoint replaces config.yaml, as a resume does: a job script's
            # command on another split of the ranks than the config's (the checks let it through)
            # was refused here at every node.
            write_run_dir(cfg, run_dir, resuming=request.resume is not None,
                          replace=checkpoint is not None)
            records = ready.node.rank == 0  # node 0's launcher says the run's state (`runs`)
            if records:
                _record(run_dir, "running", None, warn, ready.world.nnodes)
            print_start(ready, resuming_from, out)
            try:
                code = launch_workers(run_dir, launch_spec(ready), console_print=err.print)
            finally:
                remove_swap_dir(cfg.parallel, run_dir)  # offload to nvme: this node's swap folder
        if records:
            _record(run_dir, ENDED.get(code, "failed"), code, warn, ready.world.nnodes)
    if code == 0:
        out.print(f"done: metrics in {run_dir / 'metrics.jsonl'}")
        if records:
            for line in next_steps(run_dir, cfg):
                out.print(line)
    elif before is not None and store.newest(run_dir / store.CHECKPOINTS) == checkpoint and \
            ready.node.rank == 0 and _config_now(run_dir) != before:
        # A resume that failed before it saved anything leaves the run dir as it found it: its
        # config.yaml is the one its checkpoints were trained with, not this try's overrides.
        # Node 0's launcher puts it back, whole (the others read it at their start).
        tmp = run_dir / f".{CONFIG}.put-back.tmp"
        tmp.write_text(before)
        os.replace(tmp, run_dir / CONFIG)
        if request.resume is not None and request.args:  # the command said above lacks them
            again = " ".join(shlex.quote(a) for a in request.args)
            err.print(f"  {run_dir / CONFIG} is as before this resume, which saved nothing: to "
                      f"resume with its overrides again, partrain launch --resume "
                      f"{shlex.quote(str(run_dir))} {again}")
    return code


@contextmanager
def interrupts_held():
    """A Ctrl-C during the block is held to its end, then raised (KeyboardInterrupt): a library's
    bare `except:` inside an import must not take it and leave the run training. A Python-level
    handler, not a blocked mask: a blocked SIGINT is delivered to another thread that does not
    block it (numpy's OpenBLAS starts one at import), and Python raises it in the main thread all
    the same. Outside the main thread, where no handler can be set, or where SIGINT does not raise
    KeyboardInterrupt (ignored: a background job), the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


@contextmanager
def _environment(env: dict[str, str]):
    """`env` in this process's environment for the block (the agent copies it into every rank;
    the rank server takes it as it starts), and as it was after it: a launch run in-process (the
    tests, a Python caller) leaves nothing behind for the next one."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _record(run_dir: Path, state: str, code: int | None, warn: Callable[[str], None],
            nnodes: int) -> None:
    """logs/state.json; a run dir that refuses it loses only what `partrain runs` shows."""
    try:
        write_state(run_dir, state, code, nnodes)
    except OSError as e:
        warn(f"{run_dir / STATE_FILE} cannot be written ({e.strerror or e}); `partrain runs` "
             "will not show this run's state")


def next_steps(run_dir: Path, cfg) -> list[str]:
    """What a finished run can do next, as commands with its run dir: sample, export (not a
    mixture of experts, which --format hf refuses), train on. None without a committed
    checkpoint (checkpoint.save_last=false and no schedule)."""
    from partrain.models.family import builds_offline
    from partrain.models.arith import moe_enabled

    checkpoint = store.newest(run_dir / store.CHECKPOINTS)
    if checkpoint is None:
        return []
    run = shlex.quote(str(run_dir))
    prompt = "'def main('" if cfg.data.source == "stdlib" else "'Once upon a time'"
    lines = []
    if not builds_offline(cfg.model):  # sample and export know the built-in family only
        return [f"next: partrain launch --resume {run} train.max_steps="
                f"{2 * cfg.train.max_steps}   # train on"]
    lines.append(f"next: partrain sample {run} --prompt {prompt}   # text from step "
                 f"{checkpoint.step}")
    if not moe_enabled(cfg.model):
        lines.append(f"next: partrain export {run} --out {shlex.quote(f'hf/{run_dir.name}')}   "
                     "# a Hugging Face directory")
    lines.append(f"next: partrain launch --resume {run} train.max_steps="
                 f"{2 * cfg.train.max_steps}   # train on")
    return lines


def _config_now(run_dir: Path) -> str | None:
    try:
        return (run_dir / CONFIG).read_text()
    except OSError:
        return None


def _config_before(run_dir: Path, checkpoint) -> str | None:
    """The run dir's config.yaml before a resume rewrites it (None for a new run)."""
    return _config_now(run_dir) if checkpoint is not None else None


# DeepSpeed's C++ ops a ZeRO run on CPU JIT-builds on first use, with what they took on 2 cores:
# the offload's CPU Adam, and async_io for offload to nvme. (Its shared-memory all-reduce, which
# only its inference path uses, is not built: parallel/zero.py.)
CPU_OPS = {"cpu_adam": "30-100 s", "async_io": "~150 s"}


def extension_root() -> Path:
    """torch's extension cache, where DeepSpeed's JIT-built ops go: TORCH_EXTENSIONS_DIR, else
    torch's default (~/.cache/torch_extensions, under XDG_CACHE_HOME where that is set)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def op_folder(op: str) -> Path:
    """The folder torch's JIT build gives `op` (torch.utils.cpp_extension's build directory):
    TORCH_EXTENSIONS_DIR/op where that is set, else one folder per Python and torch build under
    the default cache (py311_cpu/op, py312_cu128/op, ...)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return extension_root() / op
    import torch

    version = torch.version
    accelerator = (f"rocm{version.hip.replace('.', '')}" if version.hip else
                   f"cu{version.cuda.replace('.', '')}" if version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return extension_root() / f"{python}_{accelerator}" / op


def deepspeed_builds(cfg) -> str | None:
    """What DeepSpeed will build before the first step of this run (ZeRO on CPU, ops not yet in
    torch's extension cache), said up front instead of minutes of silence; None if nothing."""
    if not cfg.parallel.zero_stage or cfg.parallel.zero_backend != "deepspeed" or runs_on_cuda(cfg):
        return None
    nvme = "nvme" in (cfg.parallel.offload_optimizer, cfg.parallel.offload_params)
    ops = (["cpu_adam"] if cfg.parallel.offload_optimizer != "none" else []) + (["async_io"] * nvme)
    missing = [op for op in ops if not (op_folder(op) / f"{op}.so").is_file()]
    if not missing:
        return None
    return ("deepspeed: building its C++ ops on first use on this machine before the first step: "
            + ", ".join(f"{op} ({CPU_OPS[op]} on 2 cores)" for op in missing)
            + f"; cached in {op_folder(missing[0]).parent} for every later run "
            "(TORCH_EXTENSIONS_DIR sets where)")


def print_dry_run(ready: Ready, resuming_from: str, out: Console) -> None:
    """--dry-run: the plan, the data, the network, and what a start would do."""
    world, network = ready.world, ready.node.network
    print_plan(build_plan(ready.cfg, world, []), out)
    out.print(f"data: {ready.data}")
    if network:
        out.print(f"network: {network.addr} on {network.ifname or '?'} ({network.how})")
    out.print(f"dry run: would write {ready.run_dir} (checked: it can be made) and start "
              f"{world.nproc_per_node} worker(s) on this node{resuming_from}; nothing started")


def print_start(ready: Ready, resuming_from: str, out: Console) -> None:
    """Where the run goes and this node's place in it; sets the workers' interface variables for
    a multi-node job (and says which)."""
    world, node, run_dir = ready.world, ready.node, ready.run_dir
    out.print(f"partrain: run dir {run_dir}; {world.size} rank(s), {world.nproc_per_node} on this "
              f"node (node {node.rank} of {world.nnodes}, {node.place.source}); logs in "
              f"{run_dir / 'logs'}{resuming_from}")
    network = node.network
    if network:
        variables = set_ifname_variables(network)
        out.print(f"network: rendezvous {node.rdzv_endpoint}; this node is {network.addr} on "
                  f"{network.ifname or 'an unknown interface'} ({network.how}); "
                  f"{', '.join(variables) or 'set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME yourself'}",
                  soft_wrap=True)


def launch_spec(ready: Ready):
    """The agent's view of this node: its place in the job and the rendezvous."""
    from partrain.launch.local import ElasticLaunch

    cfg, world, node = ready.cfg, ready.world, ready.node
    job_id = node.place.job_id
    return ElasticLaunch(
        nnodes=world.nnodes, nproc_per_node=world.nproc_per_node, node_rank=node.rank,
        rdzv_endpoint=node.rdzv_endpoint,
        run_id=node.rdzv_id or (f"slurm-{job_id}" if job_id else cfg.name),
        rdzv_timeout_s=cfg.launcher.rdzv_timeout_s,
        local_addr=node.network and node.network.addr, max_steps=cfg.train.max_steps,
        max_restarts=cfg.launcher.max_restarts, cuda=runs_on_cuda(cfg),
        start_method=start_method(cfg))


def cpu_threads(ready: Ready) -> int | None:
    """OpenMP threads per worker on CPU: the cores this task may use, shared out (under SLURM
    the step's, not the machine's); None on CUDA."""
    if runs_on_cuda(ready.cfg):
        return None
    return max(1, usable_cores() // ready.world.nproc_per_node)


def rank_env(ready: Ready) -> dict[str, str]:
    """What every rank's environment must hold when it imports torch (OpenMP reads its thread
    count then; a user's OMP_NUM_THREADS stays) and the lifeline's launcher pid."""
    threads = cpu_threads(ready)
    env = {LAUNCHER_PID_ENV: str(os.getpid())}
    if threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def compiles(cfg) -> bool:
    """The ranks will call torch.compile: train.compile, or DeepSpeed's ZeRO (forked.COMPILER)."""
    return bool(cfg.train.compile or (cfg.parallel.zero_stage
                                      and cfg.parallel.zero_backend == "deepspeed"))


def start_method(cfg) -> str:
    """launcher.start_method with auto resolved: forkserver on CPU under Linux (the lifeline
    asks /proc), spawn on CUDA (the forked start is checked on one GPU, not yet on a node of
    several under NCCL) and elsewhere."""
    if cfg.launcher.start_method != "auto":
        return cfg.launcher.start_method
    return "forkserver" if sys.platform.startswith("linux") and not runs_on_cuda(cfg) else "spawn"


def prepare_job(request: Request, dry_run: bool, out: Console, err: Console,
                warn: Callable[[str], None], *, gpus_per_node: int | None = None,
                partition: str | None = None, time: str | None = None,
                account: str | None = None, qos: str | None = None,
                cpus_per_task: int | None = None, mem: str | None = None,
                exclusive: bool = False, setup: tuple[str, ...] = (),
                sbatch_args: tuple[str, ...] = ()) -> None:
    """Check for nodes x ranks, write the run dir and its sbatch script, and submit it (with
    --dry-run: print the script instead). A failed write or submission takes back what it wrote.
    `setup` (--setup) runs on every node after the config's launcher.setup."""
    ready = preflight(request)
    cfg, world, run_dir = ready.cfg, ready.world, ready.run_dir
    if ready.checkpoint is not None and ready.checkpoint.step >= cfg.train.max_steps:
        raise ConfigError(  # the job would start, say "nothing to do" and end
            f"--resume {run_dir} is trained to step {ready.checkpoint.step} = train.max_steps "
            f"({ready.checkpoint.path}): there is nothing to submit; to train on, give a larger "
            f"one: partrain slurm --resume {run_dir} train.max_steps=N --nodes {world.nnodes}")
    gpu_warning = check_gpu_request(cfg.launcher.device, gpus_per_node, world.nproc_per_node)
    job = SlurmJob(run_dir=run_dir, job_name=cfg.name, nodes=world.nnodes,
                   nproc_per_node=world.nproc_per_node, partrain=partrain_command(),
                   gpus_per_node=gpus_per_node, partition=partition, time=time,
                   account=account, qos=qos, cpus_per_task=cpus_per_task, mem=mem,
                   exclusive=exclusive, sbatch_args=sbatch_args, env=passed_through_env(),
                   setup=(*cfg.launcher.setup, *setup))
    script_text = render_script(job)  # refuses unsafe values before anything is written
    check_sbatch_env(job, os.environ)
    local = node_local_warning(run_dir, world.nnodes)
    warnings = [*ready.warnings, *([gpu_warning] if gpu_warning else []),
                *([local] if local else [])]
    if cpus_per_task is not None and cpus_per_task < world.nproc_per_node:
        warnings.append(f"--cpus-per-task={cpus_per_task} gives the {world.nproc_per_node} ranks "
                        f"of each node less than a core each; ask for at least "
                        f"{world.nproc_per_node}")
    for warning in warnings:
        warn(warning)
    if ready.changed:
        out.print("changed on resume: " + ", ".join(ready.changed))
    if request.resume is not None:  # a new run dir has no job (a prepared one is refused)
        check_no_job_in(run_dir)
    # The nearest directory that is there before this call (None: the run dir is): what a failed
    # submission takes back goes up to it, the parents made for the run dir too. A resume's
    # config and script as they were: what a failed submission puts back.
    created = None if run_dir.exists() else nearest_existing(run_dir)
    before = job_files(run_dir) if request.resume is not None else None
    if before and before[SCRIPT] is not None:
        dropped = dropped_settings(before[SCRIPT][0], script_text)
        if dropped:
            warn(f"{run_dir / SCRIPT} asked for {', '.join(dropped)}, which this job does not "
                 "(a resume takes its flags anew): give them again to keep them")
    script = write_job(ready, job, created, before)
    if dry_run:
        sys.stdout.write(script_text)
        err.print(f"dry run: wrote {run_dir / 'config.yaml'} and {script}; nothing submitted "
                  f"(submit with: sbatch {shlex.quote(str(script))})")
        return
    try:
        job_id = submit(script)
    except SubmissionUnknown:
        raise  # the job may be queued: it must find the script and config it was given
    except ConfigError:
        _take_back(run_dir, created, before)
        raise
    resumes = (f"; it resumes from step {ready.checkpoint.step} ({ready.checkpoint.path})"
               if ready.checkpoint is not None else "")
    out.print(f"submitted job {job_id}: {world.nnodes} node(s) x {world.nproc_per_node} rank(s); "
              f"run dir {run_dir}{resumes}", soft_wrap=True)
    out.print(f"logs: {run_dir / 'logs' / f'slurm-{job_id}.out'} (the job), "
              f"{run_dir / 'logs'}/rank-N.log (each rank); metrics: {run_dir / 'metrics.jsonl'}",
              soft_wrap=True)


def check_gpu_request(device: str, gpus_per_node: int | None, nproc_per_node: int) -> str | None:
    """What the job asks SLURM for against what its ranks will use (the submitting machine's own
    GPUs say nothing of the nodes'): a CUDA run that asks for none is refused (a site that
    confines a job to its GPUs shows it none; one that does not lets it take other jobs'), more
    ranks than GPUs too, and a CPU run that asks for GPUs (it would hold them idle); `auto` that
    asks for none is said (a warning), since it trains on the CPU where the nodes show no GPU."""
    if gpus_per_node is None:
        if device == "cuda":
            raise ConfigError(
                "launcher.device=cuda and no --gpus-per-node: the job would ask SLURM for no "
                f"GPUs; give --gpus-per-node {nproc_per_node} (one per rank)")
        if device == "auto":
            return ("launcher.device=auto and no --gpus-per-node: the job asks SLURM for no "
                    "GPUs, and where the nodes show a job none it trains on their CPUs; give "
                    "--gpus-per-node G for a GPU job, or launcher.device=cpu")
        return None
    if device == "cpu":
        raise ConfigError(
            f"launcher.device=cpu and --gpus-per-node {gpus_per_node}: the job would hold "
            f"{gpus_per_node} GPUs on each node and train on its CPUs (the quickstart recipe "
            "sets cpu); set launcher.device=cuda (or auto), or leave --gpus-per-node out for a "
            "CPU job")
    if nproc_per_node > gpus_per_node:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node} > --gpus-per-node {gpus_per_node}: each rank "
            f"takes a GPU of its own, and ranks past {gpus_per_node} would have none; give "
            f"--nproc-per-node {gpus_per_node}, or ask for {nproc_per_node} GPUs")
    return None


def _take_back(run_dir: Path, created: Path | None, before: dict | None = None) -> None:
    """What a failed submission wrote, and the parents made for the run dir; a resume's config
    and script as they were (`before`: job_files')."""
    if before is not None:
        put_back(run_dir, before)
        return
    remove_prepared(run_dir, created)
    if created is not None:
        remove_made(run_dir, created)


def write_job(ready: Ready, job: SlurmJob, created: Path | None, before: dict | None) -> Path:
    """The run dir with its frozen config and the sbatch script; if the script cannot be written,
    what was written goes again (all of the run dir and the parents made for it if this call
    created it below `created`, the nearest directory there before; a resume's files as they
    were, `before`)."""
    write_run_dir(ready.cfg, ready.run_dir, resuming=before is not None)
    try:
        return write_script(job)
    except OSError as e:
        _take_back(ready.run_dir, created, before)
        raise ConfigError(f"--run-dir {ready.run_dir} cannot be written: {e.strerror}") from None

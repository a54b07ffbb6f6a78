"""Every check before a start, in one order: `preflight(request)` for `launch` (and its
--dry-run), `slurm`, `plan` and `show`, each command running the checks its `Checks` name.

The order, and the commands that run each step (the first refusal wins; nothing is written before
the last step passes):

 1. --run-dir and --resume name one run dir (launch).
 2. Where this node is (cluster.detect_place): refuses torchrun and a double launch under srun,
    and reads SLURM's node count, node rank, head node and GPUs (launch).
 3. The config: --resume's run dir's config with its overrides, a run dir's frozen config.yaml
    as it is, or a recipe composed with overrides; this node's CUDA devices counted (launch),
    and its GPUs or cores for torchrun's --nproc-per-node gpu|cpu|auto (launch/torchrun.py);
    the world resolved (plan's --world-size split into nodes x ranks per node) and every rule of
    the config validated (every command).
 3b. The layout fits this node's GPUs (check_memory): on CUDA, each pipeline stage's peak by
    partrain's memory model against the GPU's memory; refused when it exceeds it by more than
    the model's error, unless launcher.allow_predicted_oom (launch).
 4. The world can start on one node (check_startable) (launch, slurm).
 5. This node in the job: its rank, the rendezvous endpoint, its address and interface
    (netif.pick_network) (launch).
 6. The data (check_sources: data.path's dir, or each of data.blend's and their one
    tokenizer; under --resume a dir gone from where the run read it is named first, with the
    way to give its new place: check_data_there) (launch, slurm).
 7. The curves' packages (check_curves) (launch, slurm).
 8. The run dir (check_run_dir): slurm prepares a new or empty one; launch may also join one
    prepared for this very config, or continue the checkpoint in it (launch, slurm), unless a
    launch on this host runs in it (check_not_in_use) (launch).
 9. The checkpoint: the run dir's newest, which a resume may continue (check_resumable; its data
    the same tokens as the checkpoint recorded, at the same place or a new one), else the
    one model.init_from names, or its Hugging Face directory (check_init_from); a checkpoint's
    files are checked whole against its .metadata (checkpoint/verify) (launch, slurm).

torch is imported only to count CUDA devices and read their memory (steps 3 and 3b, launch) and, for `show` of a ZeRO config on
launcher.device auto or cuda, to ask whether CUDA is visible; `plan` runs without it.
"""

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.resume import (
    NOT_SHAPE,
    check_data_there,
    check_resumable,
    flat_keys,
    resume_config,
    saved_config,
)
from partrain.checkpoint.verify import check_whole
from partrain.config.compose import compose_config
from partrain.config.frozen import is_frozen_config, load_frozen_config
from partrain.config.keys import shown
from partrain.config.resolve import MAX_WORLD_SIZE, World, resolve_world
from partrain.config.validate import check_startable, resolve_and_validate
from partrain.data.sampler import check_sources
from partrain.errors import ConfigError
from partrain.launch.cluster import NodePlace, detect_place, slurm_node_address, usable_cores
from partrain.launch.netif import (
    NodeNetwork,
    check_ifname_variables,
    check_local_addr,
    network_warnings,
    pick_network,
    port_taken,
    split_endpoint,
)
from partrain.launch.rundir import check_not_in_use, check_run_dir, default_run_dir
from partrain.launch.torchrun import count_nproc
from partrain.observe.curves import check_curves

# CONFIG is the first argument unless it has an override's shape (`key=`, `+key=`, `~key`).
OVERRIDE_SHAPE = re.compile(r"[~+]|[A-Za-z_][\w.@+-]*=|=")


@dataclass(frozen=True)
class Checks:
    """The checks a command runs past the config (step 3), which every command resolves."""

    on_this_node: bool = False  # starts workers here: steps 1, 2 and 5, and the CUDA count
    startable: bool = False  # step 4
    data: bool = False  # step 6
    curves: bool = False  # step 7
    # Step 8: "prepare" (a new or empty run dir, named by its absolute path, since the job may
    # start in another directory) or "start" (also one to join or continue); None: no run dir.
    run_dir: str | None = None
    checkpoint: bool = False  # step 9


PLAN = Checks()  # `plan` and `show`: the config only
SLURM = Checks(startable=True, data=True, curves=True, run_dir="prepare", checkpoint=True)
LAUNCH = Checks(on_this_node=True, startable=True, data=True, curves=True, run_dir="start",
                checkpoint=True)


@dataclass(frozen=True)
class Request:
    """What a command was asked: CONFIG and OVERRIDEs, its flags, and the checks it runs."""

    args: list[str] | None
    checks: Checks
    nnodes: int | None = None
    nproc_per_node: int | str | None = None  # or gpu, cpu, auto (torchrun's words), counted here
    world_size: int | None = None  # `plan --world-size`: split into nodes x ranks per node
    run_dir: Path | None = None
    resume: Path | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_from: str = "--rdzv-endpoint"  # the flag that named it, for messages
    rdzv_id: str | None = None  # the job's id at the rendezvous; default: the run's name
    local_addr: str | None = None
    ifname: str | None = None


@dataclass(frozen=True)
class ThisNode:
    """This node's place in the job (launch): what starts its workers and what it prints."""

    place: NodePlace
    rank: int
    rdzv_endpoint: str | None  # None: one node on 127.0.0.1
    network: NodeNetwork | None  # the address and interface the other nodes reach
    rdzv_id: str | None = None  # --rdzv-id; None: the SLURM job's, else the run's name


@dataclass
class Ready:
    """What passed: the resolved config and world, and what the checks found on the way."""

    cfg: DictConfig
    world: World
    warnings: list[str]
    node: ThisNode | None = None
    data: str | None = None  # check_data's description of the data
    run_dir: Path | None = None
    checkpoint: store.Checkpoint | None = None  # the run dir's newest: the start continues it
    changed: list[str] = dataclasses.field(default_factory=list)  # what the resume changes


def preflight(request: Request) -> Ready:
    """Run the request's checks in the module's order; raise ConfigError at the first refusal."""
    checks = request.checks
    resume = request.resume
    if resume is not None and request.run_dir is not None and \
            request.run_dir.absolute() != resume.absolute():
        raise ConfigError(f"--run-dir {request.run_dir} and --resume {resume} name two run dirs; "
                          "--resume continues in its own")
    if resume is not None and checks.run_dir and (resume / "config.yaml").is_file() and \
            not store.STEP_DIR.fullmatch(resume.name) and \
            store.newest(resume / store.CHECKPOINTS) is None:  # (a step dir: resume.py says)
        # Before the world's checks: a run dir prepared for several nodes that never saved was
        # refused for its missing --rdzv-endpoint first, which would not have helped.
        check_run_dir(resume, None, resuming=True)
    place = detect_place(request.nproc_per_node if isinstance(request.nproc_per_node, int)
                         else None) if checks.on_this_node else None
    cfg, world, warnings = resolve(request, place)
    on_cuda = checks.on_this_node and runs_on_cuda(cfg)
    if cfg.train.dtype == "fp16" and (cfg.launcher.device == "cpu" or
                                      (checks.on_this_node and not on_cuda)):
        # DeepSpeed's CPU accelerator has no fp16: every rank failed at the engine's start
        raise ConfigError("train.dtype=fp16 on CPU: DeepSpeed (which scales fp16's loss) does "
                          "not train in fp16 there; use train.dtype=bf16 or fp32 on CPU, fp16 on "
                          "GPUs (a DeepSpeed file's fp16 section sets train.dtype=fp16)")
    if on_cuda:
        check_memory(cfg, world, warnings)
    if checks.startable:
        check_startable(world)
    ready = Ready(cfg, world, warnings)
    if checks.on_this_node:
        ready.node = this_node(request, place, world, warnings)
    if checks.data:
        if resume is not None:
            check_data_there(cfg, resume)
        ready.data = check_sources(cfg)
    if checks.curves:
        check_curves(cfg)
    if checks.run_dir:
        ready.run_dir = _run_dir(request, cfg, place)
        # A launch joins its run dir; `partrain slurm` prepares a new one, or with --resume
        # writes the resumed config and a new script into one that holds a checkpoint.
        joins = checks.run_dir == "start" or resume is not None
        ready.checkpoint = check_run_dir(ready.run_dir, cfg if joins else None,
                                         resuming=resume is not None)
        if joins:
            check_not_in_use(ready.run_dir, world.nnodes, resuming=resume is not None)
        if ready.checkpoint is not None:
            root = ready.checkpoint.path.parent
            for path, why in store.not_committed(root, ready.checkpoint.step):
                warnings.append(f"{path} is not a committed checkpoint ({why}), so the run goes "
                                f"on from the newest one before it, step {ready.checkpoint.step}; "
                                f"move it out of {root} to keep this from being said again")
    if checks.checkpoint:
        if ready.checkpoint is not None:
            typed = frozenset(item.split("=", 1)[0].lstrip("+~") for item in request.args or ())
            ready.changed = check_resumable(
                ready.checkpoint, cfg, ready.run_dir / "config.yaml" if resume else None, typed)
            check_whole(ready.checkpoint, "--resume" if resume is not None else "--run-dir")
        else:
            check_init_from(cfg)
    return ready


def split_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    """CONFIG is the first argument unless it has an override's shape (`key=`, `+key=`, `~key`):
    a path may hold '=' (`runs/lr=1e-3/config.yaml`) where a key cannot."""
    args = list(args or [])
    if args and not OVERRIDE_SHAPE.match(args[0]):
        return args[0], args[1:]
    return None, args


def load_config(args: list[str] | None, resume: Path | None = None) -> DictConfig:
    """The config a command runs: --resume's run dir's with the overrides a resume allows, a run
    dir's frozen config.yaml as it is (never re-composed), or a recipe composed with overrides."""
    config, overrides = split_args(args)
    if resume is not None:
        if config is not None:
            raise ConfigError(f"--resume {resume} takes overrides only (key=value), not {config}: "
                              "the run dir's config.yaml is the config")
        return resume_config(resume, overrides)
    if is_frozen_config(config):
        return load_frozen_config(config, overrides)
    return compose_config(config, overrides)


def resolve(request: Request, place: NodePlace | None) -> tuple[DictConfig, World, list[str]]:
    """Step 3: the config, its world (flags win over the environment's place, which wins over
    launcher.*) and every rule; returns the warnings too."""
    cfg = load_config(request.args, request.resume)
    nnodes, nproc_per_node = request.nnodes, request.nproc_per_node
    given = {item.split("=", 1)[0].lstrip("+") for item in split_args(request.args)[1]}
    names_ranks = (nnodes is not None or nproc_per_node is not None
                   or bool(given & {"launcher.nnodes", "launcher.nproc_per_node"}))
    follows = request.resume is not None and names_ranks and "parallel.dp" not in given
    if follows:
        # A resume on the ranks it names: dp follows them (world / (pp * cp * tp), the same
        # number on the same world), as torchrun users expect of --nnodes and --nproc-per-node;
        # the frozen number would refuse every other world.
        cfg.parallel.dp = "auto"
    if nnodes is None and place is not None:
        nnodes = place.nnodes
    if request.world_size is not None:
        nnodes, nproc_per_node = split_world(cfg, request.world_size)
    cuda_devices = 0
    if request.checks.on_this_node:
        cuda_devices = visible_gpus(cfg, place.gpus_on_node)
    nproc_from = None
    if isinstance(nproc_per_node, str):  # torchrun's gpu, cpu, auto: this node's devices
        nproc_per_node, nproc_from = count_nproc(
            nproc_per_node, cuda_count(place.gpus_on_node if place else None), usable_cores(),
            cuda_devices > 0)
    world = resolve_world(cfg, nnodes, nproc_per_node, cuda_devices)
    if cuda_devices and cfg.launcher.device != "cpu" and world.nproc_per_node > cuda_devices:
        # Each rank takes the GPU of its local rank (parallel/dist.py): the rest would fail at
        # their first CUDA call, after the others had started.
        raise ConfigError(
            f"{world.nproc_per_node} ranks on this node ({world.nproc_from}), which shows "
            f"{cuda_devices} GPU(s): each rank takes a GPU of its own; give --nproc-per-node "
            f"{cuda_devices} (or fewer), or launcher.device=cpu to train on the CPU")
    if request.world_size is not None:
        world = dataclasses.replace(world, nproc_from=f"--world-size={request.world_size}")
    if nproc_from is not None:
        world = dataclasses.replace(world, nproc_from=nproc_from)
    # A resume that names neither micro-batch key has its split derived again (resume.py).
    resplit = request.resume is not None and not given & {"train.micro_batch_size",
                                                          "train.micro_batches"}
    try:
        warnings = resolve_and_validate(cfg, world, resplit)
    except ConfigError as e:
        if not follows or not re.search(r"\bdp\b", str(e)):  # a rule of dp's, not optim.lr's
            raise
        raise ConfigError(f"{e} (on a resume that names the ranks, parallel.dp follows them: "
                          "world / (pp * cp * tp); give parallel.dp=N to set it)") from None
    return cfg, world, warnings


def split_world(cfg: DictConfig, world_size: int) -> tuple[int, int]:
    """--world-size N for `plan`: keep the GPUs per node if the config has them, else the nodes."""
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


def cuda_count(gpus_on_node: int | None) -> int:
    """The CUDA devices torch sees here, no more than the scheduler's share of the node."""
    import torch

    count = torch.cuda.device_count()
    return min(count, gpus_on_node) if gpus_on_node and count else count


def visible_gpus(cfg: DictConfig, gpus_on_node: int | None) -> int:
    """The CUDA devices this node's workers may use (the scheduler's share of the node, if it
    says); 0 for launcher.device=cpu, without importing torch."""
    if cfg.launcher.device == "cpu":
        return 0
    cuda_devices = cuda_count(gpus_on_node)
    if cfg.launcher.device == "cuda" and cuda_devices == 0:
        raise ConfigError("launcher.device=cuda but no CUDA device is visible; "
                          "use launcher.device=cpu")
    return cuda_devices


def cuda_memory() -> tuple[int, str]:
    """The memory in bytes of this node's smallest visible GPU, and its name."""
    import torch

    props = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                key=lambda d: d.total_memory)
    return props.total_memory, props.name


def check_memory(cfg: DictConfig, world: World, warnings: list[str]) -> None:
    """Step 3b: each pipeline stage's predicted peak (plan/fit.py) against this node's GPU. A
    layout over the device by more than the memory model's error is refused (it would run out
    of memory once the model is built) unless launcher.allow_predicted_oom; one over the share
    a step may use is a warning."""
    from partrain.plan.fit import check_fit, fit_warnings, refusal

    total, name = cuda_memory()
    fit = check_fit(cfg, world, total, name)
    if fit["certain_oom"] and not cfg.launcher.allow_predicted_oom:
        raise ConfigError(refusal(fit))
    warnings.extend(fit_warnings(fit))


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def runs_on_cuda(cfg: DictConfig) -> bool:
    """Where this machine's workers will run: launcher.device, `auto` = CUDA when visible."""
    return cfg.launcher.device == "cuda" or (cfg.launcher.device == "auto" and has_cuda())


def this_node(request: Request, place: NodePlace, world: World, warnings: list[str]) -> ThisNode:
    """Step 5: this node's rank, the rendezvous endpoint (the flag, else the SLURM job's head
    node) and the address and interface the other nodes reach it on. Inside SLURM the rank and
    the endpoint come from the job; flags win."""
    rank_source = "--node-rank" if request.node_rank is not None else "SLURM_NODEID"
    rank = request.node_rank if request.node_rank is not None else (place.node_rank or 0)
    if not 0 <= rank < world.nnodes:
        raise ConfigError(f"{rank_source}={rank} must be in 0..{world.nnodes - 1} "
                          f"for {world.nnodes} node(s)")
    endpoint, endpoint_from = request.rdzv_endpoint, request.rdzv_from
    if world.nnodes > 1 and not endpoint:
        endpoint, endpoint_from = (place.rdzv_endpoint,
                                   "the SLURM job's first node (SLURM_JOB_NODELIST)")
        if endpoint:
            endpoint, endpoint_from = slurm_node_address(endpoint, endpoint_from)
        if not endpoint:
            raise ConfigError(f"--nnodes={world.nnodes} needs --rdzv-endpoint HOST:PORT "
                              "(node 0's address), the same on every node")
    if endpoint and rank == 0:  # node 0 hosts the store: its port must be free here
        _, port = split_endpoint(endpoint)
        taken = port_taken(port)
        if taken:
            raise ConfigError(f"--rdzv-endpoint {endpoint}: node 0 hosts the rendezvous there, "
                              f"and port {port} cannot be listened on on this node ({taken}): "
                              "another job or an old launcher holds it; pick a free port for "
                              "every node's --rdzv-endpoint")
    local_addr, ifname = request.local_addr, request.ifname
    if local_addr:
        check_local_addr(local_addr)
    check_ifname_variables()
    network = pick_network(endpoint, local_addr, ifname, endpoint_from) if endpoint else None
    if network is not None:
        warnings.extend(network_warnings(network, endpoint))
    if network is None and (local_addr or ifname):
        warnings.append("--local-addr / --ifname only matter for a multi-node job "
                        "(--rdzv-endpoint); this run stays on 127.0.0.1")
    return ThisNode(place, rank, endpoint, network, request.rdzv_id)


def _run_dir(request: Request, cfg: DictConfig, place: NodePlace | None) -> Path:
    """--resume's run dir, else --run-dir, else runs/<name>-<time> (inside a scheduler job
    runs/<name>-job<id>, the same on every node); absolute where a job runs elsewhere."""
    job_id = place.job_id if place is not None else None
    run_dir = request.resume or request.run_dir or default_run_dir(cfg.name, job_id)
    # Absolute where the job runs elsewhere, `..` folded (it lands in the script).
    return Path(os.path.abspath(run_dir)) if request.checks.run_dir == "prepare" else run_dir


def check_init_from(cfg) -> store.Checkpoint | None:
    """model.init_from names a committed checkpoint whose weights fit model.*: the checkpoint
    (None for none, and for a Hugging Face directory, `hf:DIR`, which is checked here too)."""
    if not cfg.model.init_from:
        return None
    from partrain.interop.hf import check_hf_init, is_hf  # torch: not for a plain start

    if is_hf(cfg.model.init_from):
        check_hf_init(cfg.model)
        return None
    checkpoint = store.find(Path(cfg.model.init_from), "model.init_from")
    saved = flat_keys(saved_config(checkpoint).get("model", {}), "model.")
    new = flat_keys(OmegaConf.to_container(cfg.model, resolve=True), "model.")
    for key in sorted(new):
        if key not in NOT_SHAPE and key in saved and saved[key] != new[key]:
            raise ConfigError(
                f"{key}={shown(new[key])} does not match {shown(saved[key])} of the checkpoint "
                f"model.init_from={checkpoint.path}: its weights have that model's shape")
    check_whole(checkpoint, "model.init_from")
    return checkpoint

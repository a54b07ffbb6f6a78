"""Build one worker's run once: mesh -> where to start -> model -> parallelize -> optimizer, data,
metrics, checkpointer. The loop then steps with the `Run` this returns and never builds anything.

Cross-cutting work attaches here, so the loop stays short: the MoE router accounting becomes
`Run.after_step`, the divergence guard `Run.guard`, the backend (DDP or ZeRO) hides which one
reduces and steps.
"""

import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.checkpointer import Checkpointer
from partrain.checkpoint.resume import saved_config
from partrain.checkpoint.state import load_optimizer, load_rng, load_weights
from partrain.checkpoint.verify import (
    DamagedCheckpoint,
    damaged,
    file_order,
    listed_briefly,
    move_it_aside,
)
from partrain.config.resolve import compute_dtype
from partrain.data.sampler import Batches, build_batches
from partrain.interop.hf import hf_dir, is_hf, load_hf_weights
from partrain.models.family import build_family_model, model_flops_per_token
from partrain.observe.curves import Curves
from partrain.observe.metrics import MetricsLog, ProgressDisplay, peak_flops
from partrain.observe.trace import Tracer
from partrain.parallel.data import DataParallelBackend
from partrain.parallel.dist import local
from partrain.parallel.expert import finish_moe_step, moe_modules
from partrain.parallel.float8 import float8_linears
from partrain.parallel.mesh import ParallelDims
from partrain.parallel.parallelize import checkpointed_blocks, parallelize
from partrain.train.guard import DivergenceGuard, check_finite_start
from partrain.train.shared_dir import LOOK_AGAIN_S
from partrain.train.optim import build_optimizer, param_groups
from partrain.train.step import loss_function

log = logging.getLogger("partrain")

# The slowest read a rank's share of a checkpoint's crc32 check is allowed (a network file
# system under load), on top of launcher.collective_timeout_s.
READ_FLOOR_BYTES_S = 25e6


@dataclass
class Start:
    """Where the weights come from: the run dir's newest checkpoint (a resume, optimizer too),
    else model.init_from's checkpoint or Hugging Face directory, else the seed."""
    resume: store.Checkpoint | None
    init_from: store.Checkpoint | None
    hf_from: Path | None
    # Rank 0: what interrupted saves left, renamed out of the way, for the checkpointer to delete
    # in the background (store.clean_leftovers).
    leftovers: list[Path] = field(default_factory=list)


@dataclass
class Run:
    """What a worker built once; the loop steps with it."""
    cfg: object
    run_dir: Path
    rank: int
    device: torch.device
    dims: ParallelDims
    mesh: object
    coords: dict
    backend: DataParallelBackend
    loss_fn: Callable
    autocast: object
    tracer: Tracer
    batches: Batches  # the samplers of the training and validation batches
    tp_mesh: object
    start: Start
    first_step: int
    checkpointer: Checkpointer
    metrics: MetricsLog
    display: ProgressDisplay
    after_step: Callable[[bool], dict]  # per-step accounting (MoE routers); arg: update applied
    guard: DivergenceGuard
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float | None


def find_start(cfg, run_dir: Path, rank: int) -> Start:
    """Resume from the newest committed checkpoint, if the run dir holds one. Rank 0 first removes
    what an interrupted save left, then decides (the newest checkpoint, or model.init_from's)
    and every rank takes its choice: each looking for the newest itself could disagree (a
    network file system that shows rank 0's newest commit late on another node, or a
    model.init_from run that commits meanwhile), and ranks starting from different steps train
    on silently apart. The broadcast also keeps every rank's first write after the cleanup."""
    ckpt_root = run_dir / store.CHECKPOINTS
    resume = init_from = None
    fresh_from = cfg.model.init_from
    leftovers: list[Path] = []
    chosen = [None, None]
    if rank == 0:
        for path in store.clean_leftovers(ckpt_root, leftovers.extend):
            log.info("removed %s, left by an interrupted save", path)
        resume = store.newest(ckpt_root)
        if resume is None and fresh_from and not is_hf(fresh_from):
            init_from = store.find(Path(fresh_from), "model.init_from")
        chosen = [resume and str(resume.path), init_from and str(init_from.path)]
    dist.broadcast_object_list(chosen, src=0)
    if rank != 0:
        resume, init_from = (_committed_at(Path(p), rank) if p else None for p in chosen)
    hf_from = hf_dir(fresh_from) if resume is None and is_hf(fresh_from) else None
    source = resume or init_from
    if source is not None and source.meta.get("files"):  # none: saved before crc32s were kept
        check_read_back(source, "--resume" if resume else "model.init_from",
                        cfg.launcher.collective_timeout_s)
    return Start(resume, init_from, hf_from, leftovers)


def check_read_back(checkpoint: store.Checkpoint, what: str, collective_timeout_s: float) -> None:
    """Refuse, on every rank, a checkpoint whose files do not hold what was written (a bit
    flipped on a disk or in a copy loads silently otherwise): each rank reads its share of the
    files, so the whole checkpoint is read once, before any tensor is. The ranks meet on a group
    of their own whose timeout allows each share's read at READ_FLOOR_BYTES_S, beside the
    collective timeout (a large share on slow storage would fail that one, unexplained)."""
    files = checkpoint.meta["files"]
    rank, ranks = dist.get_rank(), dist.get_world_size()
    # Shares go by whole files: fewer files than ranks leaves a rank a whole one (a checkpoint
    # of 2 ranks resumed on 64); twice the mean file for files of unequal size.
    per_rank = -(-len(files) // ranks)
    share = 2 * int(checkpoint.meta.get("bytes") or 0) * per_rank / len(files)
    group = dist.new_group(backend="gloo", timeout=timedelta(
        seconds=collective_timeout_s + share / READ_FLOOR_BYTES_S))
    started = time.monotonic()
    every: list = [None] * ranks
    dist.all_gather_object(every, damaged(checkpoint, rank, ranks), group=group)
    dist.destroy_process_group(group)
    found = sorted((problem for part in every for problem in part),
                   key=lambda problem: file_order(problem.split(" ", 1)[0]))
    if found:
        raise DamagedCheckpoint(
            f"the checkpoint {checkpoint.path} (step {checkpoint.step}) is damaged: "
            f"{listed_briefly(found)}. {move_it_aside(checkpoint, what)}")
    if rank == 0:
        log.info("the %d files of %s read back as written (crc32, %.2f s)", len(files),
                 checkpoint.path, time.monotonic() - started)


def _committed_at(path: Path, rank: int) -> store.Checkpoint:
    """The committed checkpoint at `path`, which rank 0 chose; looked for again for a while, as a
    network file system may show another client's new directory late."""
    deadline = time.monotonic() + LOOK_AGAIN_S
    while True:
        found = store.committed_at(path)
        if found:
            return found
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"rank {rank} does not find {path}, the committed checkpoint rank 0 starts from, "
                f"after looking for {LOOK_AGAIN_S:g} s: every rank must read the same run dir "
                "(one shared file system, mounted at the same path on every node)")
        time.sleep(0.2)


def load_start_weights(model: torch.nn.Module, start: Start, model_cfg, tp_mesh) -> None:
    """This rank's slices of the starting weights, whatever layout wrote them."""
    source = start.resume or start.init_from
    if source:
        load_weights(model, source.path, tp_mesh)
    elif start.hf_from:
        load_hf_weights(model, start.hf_from, model_cfg, tp_mesh)


def same_layout(cfg, checkpoint: store.Checkpoint) -> bool:
    """Whether `checkpoint` was saved by ranks in the roles these have (the same parallel.* keys,
    micro-batch size and world size): only then is rank R's generator state rank R's to go on
    with (dropout would otherwise draw masks the uninterrupted run never drew, and tp ranks that
    must draw alike could differ)."""
    saved = saved_config(checkpoint)
    now = OmegaConf.to_container(cfg, resolve=True)
    return (checkpoint.meta.get("world_size") == dist.get_world_size()
            and saved["parallel"] == now["parallel"]
            and saved["train"]["micro_batch_size"] == now["train"]["micro_batch_size"])


def build(cfg, run_dir: Path, device: torch.device) -> Run:
    p, t = cfg.parallel, cfg.train
    rank = dist.get_rank()
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, zero_stage=p.zero_stage, cp=p.cp, ep=p.ep,
                        zero_backend=p.zero_backend, dp_replicate=p.dp_replicate)
    mesh = dims.build_mesh(device.type)
    expert_mesh = dims.build_expert_mesh(device.type) if dims.ep_enabled else None
    coords = dims.coords(rank)
    log.info("rank %d of %d: mesh coordinates %s on %s%s", rank, dims.world_size, coords, device,
             f", {torch.get_num_threads()} CPU thread(s)" if device.type == "cpu" else "")
    start = find_start(cfg, run_dir, rank)

    # The full model from the seed, identical for every layout; parallelize takes it apart.
    tracer = Tracer(t.trace)
    model = build_family_model(cfg.model, t.seed).to(device)
    n_params = sum(q.numel() for q in model.parameters())
    flops = model_flops_per_token(cfg.model, model, t.seq_len, n_params)
    tp_mesh = mesh["tp"] if dims.tp_enabled else None
    built = parallelize(model, cfg, dims, mesh, expert_mesh, tracer,
                        load_weights=partial(load_start_weights, start=start,
                                             model_cfg=cfg.model, tp_mesh=tp_mesh),
                        param_groups=partial(param_groups, optim_cfg=cfg.optim),
                        build_optimizer=partial(build_optimizer, optim_cfg=cfg.optim,
                                                device=device),
                        run_dir=run_dir)
    backend = built.backend
    if start.resume:
        load_optimizer(backend.model, backend.optimizer, start.resume.path, tp_mesh,
                       dims.deepspeed_enabled)
        # Last, so that nothing draws from the generators between here and the first step.
        if not load_rng(start.resume.path, same_layout(cfg, start.resume)):
            log.info("the random generators (dropout) start from train.seed's state, not the "
                     "checkpoint's: it was saved on another layout or holds none")
    source = start.resume or start.init_from
    if source or start.hf_from:
        check_finite_start(backend.model, backend.optimizer,
                           f"the checkpoint {source.path}" if source
                           else f"the Hugging Face model in {start.hf_from}")

    # Under ZeRO, DeepSpeed keeps bf16/fp16 weights with fp32 master copies itself, and FSDP
    # gathers bf16 copies of its fp32 shards (its MixedPrecisionPolicy).
    use_bf16 = compute_dtype(t.dtype, device.type == "cuda") == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=use_bf16 and not dims.zero_enabled)
    batches = build_batches(cfg.data, t)
    first_step = start.resume.step + 1 if start.resume else 1
    metrics, display, checkpointer = _outputs(cfg, run_dir, rank, start, first_step)
    # This pipeline stage's MoE blocks, for the per-step router accounting.
    after_step = (partial(finish_moe_step, moe_modules(backend.model), cfg.model.moe,
                          built.n_moe_blocks, built.moe_load_group,
                          mesh["pp"].get_group() if dims.pp_enabled else None, device)
                  if built.n_moe_blocks else lambda applied: {})
    tokens_per_step = t.global_batch_size * t.seq_len
    guard = DivergenceGuard(backend.model, t.max_skipped_steps, coords["pp"], device)
    if start.resume:  # a checkpoint saved inside a run of skipped steps (the last, a preemption)
        guard.in_a_row = int(start.resume.meta.get("skipped_in_a_row", 0))
        if hasattr(backend, "restore_scaler"):  # ZeRO: fp16's loss scale (parallel/zero.py)
            backend.restore_scaler(start.resume.meta)
    what = (f"model.target={cfg.model.target}" if cfg.model.get("target")
            else f"model.family={cfg.model.get('family', 'llama')}")
    loss_fn = loss_function(dims, mesh, cfg.train.compile, cfg.model.vocab_size, what)
    run = Run(cfg=cfg, run_dir=run_dir, rank=rank, device=device, dims=dims, mesh=mesh,
              coords=coords, backend=backend, loss_fn=loss_fn,
              autocast=autocast, tracer=tracer, batches=batches, tp_mesh=tp_mesh, start=start,
              first_step=first_step, checkpointer=checkpointer, metrics=metrics,
              display=display, after_step=after_step,
              guard=guard,
              tokens_per_step=tokens_per_step,
              flops_per_step=flops * tokens_per_step,
              peak_flops=(peak_flops(torch.cuda.get_device_name(device))
                          if device.type == "cuda" else None))
    _announce(run, n_params, built.sequence_parallel)
    return run


def _outputs(cfg, run_dir: Path, rank: int, start: Start, first_step: int):
    """metrics.jsonl (and curves), the progress display and the checkpointer; rank 0 writes."""
    dropped = None
    if rank == 0:  # a start before any checkpoint (a restart, a requeue) trains from step 1
        dropped = _keep_metrics_until(run_dir / "metrics.jsonl",
                                      start.resume.step if start.resume else 0)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=rank == 0,
                         curves=Curves(run_dir, cfg, first_step, enabled=rank == 0))
    display = ProgressDisplay(cfg.train.max_steps, cfg.train.log_every, enabled=rank == 0)
    if dropped:  # on the console too, not in rank 0's log alone
        display.print(f"warning: {dropped}")

    def report(record: dict) -> None:
        metrics.write(record)
        if "checkpoint_refused" in record:
            display.print(f"step {record['step']:>6}  checkpoint not saved: "
                          f"{record['checkpoint_refused']}; the newest good one stays "
                          f"{record['newest'] or 'none'}")
            return
        # A preemption save is timed from the signal (the step it waited for included).
        since = " from the signal" if record["reason"] == "preemption" else ""
        display.print(f"step {record['step']:>6}  checkpoint {record['checkpoint']}: "
                      f"{record['bytes']:,} bytes in {record['seconds']:.2f} s{since}"
                      + (f" ({record['reason']})" if record["reason"] != "every" else ""))

    checkpointer = Checkpointer(run_dir, cfg.checkpoint, OmegaConf.to_yaml(cfg), report)
    if start.leftovers:
        checkpointer.delete_in_background(start.leftovers)
    return metrics, display, checkpointer


def _keep_metrics_until(path: Path, step: int) -> str | None:
    """On resume: drop the metrics lines of steps after the checkpoint (the interrupted run
    trained them, and they are trained again), so that metrics.jsonl has one line per step.
    A line that is not a JSON object is dropped too, with a warning: the end of a line the
    interrupted run was writing (a full disk, a node that lost power leaves it cut short or
    padded with NUL bytes). Kept, it would stop every resume, and the next record appended to it
    would be lost with it. Returns what was said of such lines (None: there were none)."""
    if not path.exists():
        return None
    kept, broken = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip("\x00 \t\r"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
            broken += 1
        elif record.get("step", 0) <= step:
            kept.append(line)
    said = (f"{path}: dropped {broken} line(s) that are not a metrics record (the end of a "
            "write the interrupted run did not finish)") if broken else None
    if said:
        log.warning(said)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return said


def _announce(run: Run, n_params: int, sequence_parallel: bool) -> None:
    """The run's first lines on rank 0: the model, the data, the layout, where it starts."""
    cfg, dims, t, p = run.cfg, run.dims, run.cfg.train, run.cfg.parallel
    model = run.backend.model
    # ZeRO-3 leaves each parameter empty and keeps this rank's shard in `ds_tensor`; FSDP's
    # parameters are DTensors whose local part is this rank's shard.
    rank_params = sum(local(getattr(q, "ds_tensor", q)).numel() for q in model.parameters())
    named = f"your model {cfg.model.target}" if cfg.model.get("target") else cfg.model.name
    run.display.print(
        f"partrain: {named} ({n_params:,} parameters, {rank_params:,} on rank "
        f"0), {run.batches.description}, layout pp={dims.pp} dp={dims.dp}"
        f"{f' (ep={dims.ep})' if dims.ep_enabled else ''}"
        f"{f' cp={dims.cp} ({p.cp_method})' if dims.cp_enabled else ''} tp={dims.tp}"
        f"{' +sp' if sequence_parallel else ''}"
        f"{f' ZeRO-{p.zero_stage} ({p.zero_backend})' if p.zero_stage else ''}, "
        f"{t.global_batch_size} x "
        f"{t.seq_len} tokens per step ({t.micro_batches} "
        f"micro-batch{'es' if t.micro_batches != 1 else ''} of "
        f"{t.micro_batch_size} per dp rank)"
        + (f", activation checkpointing {t.activation_checkpointing} "
           f"({checkpointed_blocks(model)} blocks on rank 0)"
           if t.activation_checkpointing != "none" else "")
        + (f", {float8_linears(model)} linear layers in FP8 ({t.float8_recipe}"
           f"{', emulated' if t.float8_emulate else ''})" if t.float8 else "")
        + (", blocks compiled" if t.compile else ""))
    start = run.start
    if start.resume:
        # The launcher said "resuming from step N" before it started the ranks; this says the
        # checkpoint is in (after a restart inside the launch, the only word of it).
        run.display.print(f"loaded step {start.resume.step}'s checkpoint ({start.resume.path}): "
                          f"training goes on at step {start.resume.step + 1}")
        run.metrics.write({"step": start.resume.step,
                           "resumed_from": str(start.resume.path.relative_to(run.run_dir)),
                           "world_size": dims.world_size})
    elif start.init_from:
        run.display.print(f"weights from {start.init_from.path} (step {start.init_from.step}); "
                          "fresh optimizer")
    elif start.hf_from:
        run.display.print(f"weights from the Hugging Face model in {start.hf_from}; "
                          "fresh optimizer")

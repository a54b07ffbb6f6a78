"""One worker's training run, top to bottom: config -> mesh -> model -> parallelize -> loop.

Started by the elastic agent as `python -m partrain.train RUN_DIR`, one process per rank. It reads
the frozen RUN_DIR/config.yaml (never Hydra), writes logs/rank-N.log, and on global rank 0 also
metrics.jsonl and the progress display. Errors are recorded in the elastic error file so that the
launcher can name the failing rank and its message.
"""

import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.checkpoint import store
from partrain.checkpoint.checkpointer import Checkpointer
from partrain.checkpoint.state import build_state, load_optimizer, load_weights
from partrain.config.deepspeed import deepspeed_config
from partrain.config.resolve import compute_dtype
from partrain.data.batches import rank_micro_batches
from partrain.data.tokens import load_tokens
from partrain.interop.hf import hf_dir, is_hf, load_hf_weights
from partrain.launch.preemption import PreemptionFlag
from partrain.models.arith import flops_per_token, moe_blocks
from partrain.models.llama import build_model
from partrain.observe.curves import Curves
from partrain.observe.memory import StepMemory, per_rank
from partrain.observe.metrics import (
    MetricsLog,
    ProgressDisplay,
    format_step,
    peak_flops,
    summary_table,
)
from partrain.observe.trace import Tracer, write_trace
from partrain.parallel.context import apply_context_parallel, shard_batch
from partrain.parallel.data import apply_data_parallel
from partrain.parallel.dist import (
    end_distributed,
    env_rank,
    init_distributed,
    pick_device,
)
from partrain.parallel.expert import (
    apply_expert_parallel,
    average_expert_gradients,
    finish_moe_step,
    moe_modules,
)
from partrain.parallel.grads import average_gradients, clip_grad_norm
from partrain.parallel.mesh import ParallelDims
from partrain.parallel.parallelize import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    compile_blocks,
)
from partrain.parallel.pipeline import apply_pipeline_parallel
from partrain.parallel.tensor import (
    apply_tensor_parallel,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from partrain.parallel.zero import apply_zero

log = logging.getLogger("partrain")

# Test-only fault hook: PARTRAIN_TEST_FAULT="RANK:STEP" makes that rank raise at that step.
FAULT_ENV = "PARTRAIN_TEST_FAULT"


def param_groups(model: torch.nn.Module, optim_cfg) -> list[dict]:
    """Weight decay on matrices and embeddings only, never on norm gains. The names are
    DeepSpeed's (its expert groups are split from named groups)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim_cfg.weight_decay,
             "name": "decay"},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(model: torch.nn.Module, optim_cfg,
                    device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    """AdamW over param_groups, torch's fused kernel on CUDA (under ZeRO, DeepSpeed builds the
    same from its config)."""
    return torch.optim.AdamW(param_groups(model, optim_cfg), lr=optim_cfg.lr,
                             betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
                             fused=device.type == "cuda")


def lr_at(step: int, optim_cfg, max_steps: int) -> float:
    """Linear warmup to optim.lr over warmup_steps, then cosine down to lr * min_lr_ratio."""
    peak, warmup = optim_cfg.lr, optim_cfg.warmup_steps
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    floor = peak * optim_cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _global_mean(value: torch.Tensor, dims: ParallelDims, mesh) -> float:
    """A per-rank mean loss -> the mean over the global batch: summed over pp (only the last
    stage holds a loss), averaged over dp x cp (cp ranks hold equal shares of the same
    sequences; tp ranks already agree)."""
    if dims.pp_enabled:
        dist.all_reduce(value, group=mesh["pp"].get_group())
    if dims.dp_cp > 1:
        dist.all_reduce(value, group=mesh["dp_cp"].get_group())
        value = value / dims.dp_cp
    return value.item()


def loss_function(dims: ParallelDims, mesh):
    """Mean cross-entropy over tokens; under tp the logits are vocabulary shards and the loss is
    computed from them without gathering (every tp rank gets the same value)."""
    if dims.tp_enabled:
        tp_group = mesh["tp"].get_group()
        return lambda logits, target: vocab_parallel_cross_entropy(logits, target, tp_group)
    return lambda logits, target: F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def forward_backward(model, micro, loss_fn, dims, device, autocast, tracer=None,
                     train=True) -> torch.Tensor:
    """This rank's mean loss over its micro-batches, with gradients accumulated when `train`.

    Each micro-batch's loss is scaled by 1/micro_batches, so the gradient is that of the mean.
    Under pp the pipeline executor runs the schedule (the loss lives on the last stage). Under
    ZeRO the engine's backward accumulates (it reduces in `engine.step()`, once per step).
    Otherwise DDP's `no_sync` on all but the last micro-batch keeps it to one gradient all-reduce
    per step.
    """
    if dims.pp_enabled:
        pipeline = model.module if dims.zero_enabled else model
        return pipeline.run(micro, loss_fn, autocast, train=train)
    tracer = tracer or Tracer(False)
    loss_sum = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        ddp = train and dims.dp_cp > 1 and not dims.zero_enabled
        with model.no_sync() if ddp and not last else nullcontext():
            with tracer.span(f"F{i}", "compute"), torch.set_grad_enabled(train), autocast:
                loss = loss_fn(model(x.to(device)), y.to(device)) / len(micro)
            if train:
                with tracer.span(f"B{i}", "compute"):
                    if dims.zero_enabled:
                        model.backward(loss, scale_wrt_gas=False)
                    else:
                        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def train_step(model, optimizer, micro, loss_fn, dims, mesh, device, autocast, grad_clip,
               sequence_parallel, tracer, before_update=lambda: None, expert_mesh=None):
    """One optimizer step over this rank's micro-batches; (global mean loss, grad norm before
    clipping). `before_update` runs after backward, before the parameters change; `expert_mesh`
    is given under expert parallelism."""
    loss = forward_backward(model, micro, loss_fn, dims, device, autocast, tracer)
    pipeline = (model.module if dims.zero_enabled else model) if dims.pp_enabled else None
    if pipeline is not None and pipeline.tied is not None:
        # Tied embeddings: the first stage's embedding and the last stage's head are copies of
        # one weight, each holding part of its gradient; both get the sum (before DeepSpeed's
        # dp reduction under ZeRO-1, which reduces p.grad at step()).
        with tracer.span("gradients: tied embedding", "comm"):
            pipeline.all_reduce_tied_grads()
    before_update()
    if dims.zero_enabled:
        # DeepSpeed reduces over dp (and syncs sequence-parallel norms first, at stage 1), clips
        # and steps; its norm is the one before clipping, summed over the replica (pp x tp).
        with tracer.span("zero: reduce, clip, step", "comm"):
            if sequence_parallel:
                sync_sequence_parallel_grads(model.module, mesh["tp"].get_group())
            model.step()
        return _global_mean(loss, dims, mesh), float(model.get_global_grad_norm())
    with tracer.span("gradients: dp average, clip", "comm"):
        if dims.pp_enabled and dims.dp_cp > 1:
            average_gradients(model.parameters(), mesh["dp_cp"].get_group())
        if expert_mesh is not None:
            # Expert slices: summed over the ranks holding the same experts, / (dp x cp).
            average_expert_gradients(model, expert_mesh["edp_cp"].get_group(), dims.dp_cp)
        tp_group = mesh["tp"].get_group() if dims.tp_enabled else None
        if sequence_parallel:
            sync_sequence_parallel_grads(model, tp_group)
        grad_norm = clip_grad_norm(model.parameters(), grad_clip if grad_clip > 0 else math.inf,
                                   tp_group, mesh["pp"].get_group() if dims.pp_enabled else None,
                                   expert_mesh["ep"].get_group() if expert_mesh else None)
    with tracer.span("optimizer", "compute"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _global_mean(loss, dims, mesh), grad_norm.item()


def _setup_moe(layers, n_moe_blocks: int, dims: ParallelDims, mesh, sequence_parallel: bool,
               micro_batches: int):
    """Wire this rank's MoE blocks into the layout; return the group whose ranks route different
    tokens (their per-expert loads are summed): dp x cp, and tp under sequence parallelism.
    Every rank takes part (new groups are collective), with MoE blocks of its own or not."""
    if not n_moe_blocks:
        return None
    # A sequence split over ranks (cp, tp's sequence shards) sums its router statistics there;
    # the balancing loss's gradient takes the language-model loss's 1/micro_batches.
    seq_dims = (("cp",) if dims.cp_enabled else ()) + (("tp",) if sequence_parallel else ())
    seq_group = None
    if len(seq_dims) == 2:
        seq_group = mesh["cp", "tp"]._flatten("cp_tp").get_group()
    elif seq_dims:
        seq_group = mesh[seq_dims[0]].get_group()
    for moe in layers:
        moe.seq_group, moe.seq_scale, moe.aux_scale = seq_group, dims.cp, 1.0 / micro_batches
    if sequence_parallel:
        return mesh["dp", "cp", "tp"]._flatten("dp_cp_tp").get_group()
    return mesh["dp_cp"].get_group() if dims.dp_cp > 1 else None


def evaluate(model, splits, loss_fn, cfg, dims, mesh, coords, device, autocast) -> float:
    """Mean loss over `eval_batches` fixed global batches of the validation split."""
    t = cfg.train
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(t.eval_batches):
        micro = rank_micro_batches(
            splits.val, i, global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size, dp=dims.dp, dp_rank=coords["dp"],
            seq_len=t.seq_len, seed=t.seed, split="val")
        if dims.cp_enabled:
            micro = shard_batch(micro, dims.cp, coords["cp"])
        total += forward_backward(model, micro, loss_fn, dims, device, autocast, train=False)
    model.train()
    return _global_mean(total / t.eval_batches, dims, mesh)


def _keep_metrics_until(path: Path, step: int) -> None:
    """On resume: drop the metrics lines of steps after the checkpoint (the interrupted run
    trained them, and they are trained again), so that metrics.jsonl has one line per step."""
    import json

    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def train(cfg, run_dir: Path, device: torch.device, preemption: PreemptionFlag) -> None:
    p, t = cfg.parallel, cfg.train
    rank = dist.get_rank()
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, zero_stage=p.zero_stage, cp=p.cp, ep=p.ep)
    mesh = dims.build_mesh(device.type)
    expert_mesh = dims.build_expert_mesh(device.type) if dims.ep_enabled else None
    coords = dims.coords(rank)
    log.info("rank %d of %d: mesh coordinates %s on %s", rank, dims.world_size, coords, device)

    # Resume from the newest committed checkpoint, if the run dir holds one. Rank 0 first removes
    # what an interrupted save left; the barrier keeps every rank's first write after that.
    ckpt_root = run_dir / store.CHECKPOINTS
    if rank == 0:
        for path in store.clean_leftovers(ckpt_root):
            log.info("removed %s, left by an interrupted save", path)
    resume = store.newest(ckpt_root)
    fresh_from = cfg.model.init_from if resume is None else None
    hf_from = hf_dir(fresh_from) if is_hf(fresh_from) else None
    init_from = (store.find(Path(fresh_from), "model.init_from")
                 if fresh_from and hf_from is None else None)
    dist.barrier()

    # The full model from the seed, identical for every layout; wrappers then take it apart in
    # the order TP -> PP -> DP/ZeRO (each sees what the one before produced).
    tracer = Tracer(t.trace)
    model = build_model(cfg.model, t.seed).to(device)
    n_params = sum(q.numel() for q in model.parameters())
    # Blocks keep their checkpointing mode through every wrapper (they stay the same modules).
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if dims.tp_enabled:
        model = apply_tensor_parallel(model, mesh["tp"], p)
    sequence_parallel = dims.tp_enabled and p.sequence_parallel
    if dims.cp_enabled:
        # Attention over the cp group; every other module works on this rank's tokens.
        model = apply_context_parallel(model, mesh["cp"], p, t.seq_len)
    n_moe_blocks = len(moe_blocks(cfg.model))
    moe_load_group = _setup_moe(moe_modules(model), n_moe_blocks, dims, mesh, sequence_parallel,
                                t.micro_batches)
    if dims.ep_enabled:
        # Each rank keeps 1/ep of every MoE's experts; tokens travel to them (all-to-all).
        model = apply_expert_parallel(model, expert_mesh["ep"])
    if dims.pp_enabled:
        # What flows between stages: the residual stream of one micro-batch (this cp rank's
        # tokens of it, and a sequence shard of those under sequence parallelism).
        seq = t.seq_len // dims.cp // (dims.tp if sequence_parallel else 1)
        model = apply_pipeline_parallel(model, mesh["pp"], p,
                                        (t.micro_batch_size, seq, cfg.model.dim), tracer)
    if t.compile:
        # The blocks as tp, cp, ep and pp left them; DDP and ZeRO then wrap the compiled blocks.
        compile_blocks(model)
    # Checkpoint weights go into this rank's shards now, before DDP or ZeRO take the model: each
    # rank reads only its slices, whatever layout wrote them.
    tp_mesh = mesh["tp"] if dims.tp_enabled else None
    source = resume or init_from
    if source:
        load_weights(model, source.path, tp_mesh)
    elif hf_from:
        load_hf_weights(model, hf_from, cfg.model, tp_mesh)
    if dims.zero_enabled:
        # ZeRO replaces DDP and the optimizer: DeepSpeed shards over dp and builds AdamW from
        # the derived config (over the same parameter groups).
        ds_config = deepspeed_config(cfg, on_cuda=device.type == "cuda")
        model, optimizer = apply_zero(model, mesh, dims, ds_config,
                                      param_groups(model, cfg.optim), expert_mesh)
    else:
        if dims.dp_cp > 1 and not dims.pp_enabled:
            # Gradients are averaged over dp x cp. Under pp the executor runs forward and
            # backward; they are averaged after the schedule (train_step) instead.
            model = apply_data_parallel(model, mesh["dp_cp"])
        optimizer = build_optimizer(model, cfg.optim, device)
    if resume:
        load_optimizer(model, optimizer, resume.path, tp_mesh, dims.zero_enabled)
    loss_fn = loss_function(dims, mesh)
    moe_layers = moe_modules(model)  # this pipeline stage's, for the per-step router accounting
    # ZeRO-3 leaves each parameter empty and keeps this rank's shard in `ds_tensor`.
    rank_params = sum(getattr(q, "ds_tensor", q).numel() for q in model.parameters())

    # Under ZeRO, DeepSpeed keeps bf16/fp16 weights with fp32 master copies itself.
    use_bf16 = compute_dtype(t.dtype, device.type == "cuda") == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=use_bf16 and not dims.zero_enabled)
    splits = load_tokens(cfg.data)
    tokens_per_step = t.global_batch_size * t.seq_len
    flops_per_step = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    fault = os.environ.get(FAULT_ENV)

    first_step = resume.step + 1 if resume else 1
    if rank == 0 and resume:
        _keep_metrics_until(run_dir / "metrics.jsonl", resume.step)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=rank == 0,
                         curves=Curves(run_dir, cfg, first_step, enabled=rank == 0))
    display = ProgressDisplay(t.max_steps, t.log_every, enabled=rank == 0)

    def report(record: dict) -> None:
        metrics.write(record)
        display.print(f"step {record['step']:>6}  checkpoint {record['checkpoint']}: "
                      f"{record['bytes']:,} bytes in {record['seconds']:.2f} s"
                      + (f" ({record['reason']})" if record["reason"] != "every" else ""))

    checkpointer = Checkpointer(run_dir, cfg.checkpoint, OmegaConf.to_yaml(cfg), report)
    display.print(f"partrain: {cfg.model.name} ({n_params:,} parameters, {rank_params:,} on rank "
                  f"0), {splits.description}, layout pp={dims.pp} dp={dims.dp}"
                  f"{f' (ep={dims.ep})' if dims.ep_enabled else ''}"
                  f"{f' cp={dims.cp} ({p.cp_method})' if dims.cp_enabled else ''} tp={dims.tp}"
                  f"{' +sp' if sequence_parallel else ''}, {t.global_batch_size} x "
                  f"{t.seq_len} tokens per step ({t.micro_batches} micro-batches of "
                  f"{t.micro_batch_size} per dp rank)"
                  + (f", activation checkpointing {t.activation_checkpointing} "
                     f"({checkpointed_blocks(model)} blocks on rank 0)"
                     if t.activation_checkpointing != "none" else "")
                  + (", blocks compiled" if t.compile else ""))
    if resume:
        display.print(f"resuming from step {resume.step} ({resume.path})")
        metrics.write({"step": resume.step, "resumed_from": str(resume.path.relative_to(run_dir)),
                       "world_size": dims.world_size})
    elif init_from:
        display.print(f"weights from {init_from.path} (step {init_from.step}); fresh optimizer")
    elif hf_from:
        display.print(f"weights from the Hugging Face model in {hf_from}; fresh optimizer")
    history, val_losses, started = [], [], time.perf_counter()
    preempted_at = None
    try:
        for step in range(first_step, t.max_steps + 1):
            if fault == f"{rank}:{step}":
                raise RuntimeError(f"injected fault ({FAULT_ENV}={fault}) on rank {rank} at step {step}")
            step_start = time.perf_counter()
            lr = lr_at(step, cfg.optim, t.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr

            micro = rank_micro_batches(
                splits.train, step, global_batch_size=t.global_batch_size,
                micro_batch_size=t.micro_batch_size, dp=dims.dp, dp_rank=coords["dp"],
                seq_len=t.seq_len, seed=t.seed)
            if dims.cp_enabled:
                micro = shard_batch(micro, dims.cp, coords["cp"])
            tracer.at_step(step)
            # train.measure_memory: the second step of the run (optimizer state made), or the only.
            meter = (StepMemory(device) if t.measure_memory and step == min(first_step + 1, t.max_steps)
                     else None)
            with tracer.span(f"step {step}", "step"), meter or nullcontext():
                # A background save's copy of the state must be done before the update.
                loss_value, grad_norm = train_step(model, optimizer, micro, loss_fn, dims, mesh,
                                                   device, autocast, cfg.optim.grad_clip,
                                                   sequence_parallel, tracer, checkpointer.staged,
                                                   expert_mesh)
                router = (finish_moe_step(moe_layers, cfg.model.moe, n_moe_blocks, moe_load_group,
                                          mesh["pp"].get_group() if dims.pp_enabled else None,
                                          device) if n_moe_blocks else {})
            step_time = time.perf_counter() - step_start
            rec = {"step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                   "tokens": step * tokens_per_step, "tokens_per_s": tokens_per_step / step_time,
                   "step_time_s": step_time, **router,
                   **(per_rank(meter, device) if meter else {})}
            if peak:
                rec["mfu"] = flops_per_step / step_time / (peak * dims.world_size)
            if device.type == "cuda":  # rank 0's peak since the start
                rec["memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            metrics.write(rec)
            history.append(rec)
            display.update(rec)
            if step % t.log_every == 0 or step == 1:
                log.info(format_step(rec))

            if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
                tracer.recording = False
                val_loss = evaluate(model, splits, loss_fn, cfg, dims, mesh, coords, device, autocast)
                metrics.write({"step": step, "val_loss": val_loss})
                val_losses.append((step, val_loss))
                log.info("step %d val_loss %.4f", step, val_loss)
                display.print(f"step {step:>6}  val_loss {val_loss:.4f}")

            # Every rank learns whether any was signalled (SIGUSR2), so all save this same step.
            signalled = preemption.agreed(device)
            if signalled is not None or checkpointer.due(step, step == t.max_steps):
                reason = ("preemption" if signalled is not None else
                          "every" if cfg.checkpoint.every and step % cfg.checkpoint.every == 0
                          else "last")
                checkpointer.save(build_state(model, optimizer, tp_mesh, dims.zero_enabled),
                                  step, reason, started=signalled)
            if signalled is not None:
                checkpointer.wait()
                preempted_at = step
                display.print(f"preemption signal: saved step {step} in "
                              f"{time.time() - signalled:.2f} s after the signal; relaunch to "
                              "resume")
                break
            checkpointer.poll()
        checkpointer.close()
    finally:
        # Also on a failure: a live display left running would leave the terminal's cursor hidden.
        display.stop()
        metrics.close()
    if t.trace:
        gathered = [None] * dims.world_size if rank == 0 else None
        dist.gather_object(tracer.spans, gathered, dst=0)
        if rank == 0:
            labels = [f"rank {r} (pp {c['pp']}, dp {c['dp']}, "
                      + (f"cp {c['cp']}, " if dims.cp_enabled else "") + f"tp {c['tp']})"
                      for r, c in ((r, dims.coords(r)) for r in range(dims.world_size))]
            write_trace(run_dir / "trace.json", gathered, labels)
    if rank == 0 and history:
        display.console.print(summary_table(history, val_losses, time.perf_counter() - started,
                                            run_dir, checkpointer.newest or resume))
    if preempted_at is not None:
        log.info("stopped at step %d on a preemption signal", preempted_at)


def _log_to_file(run_dir: Path, rank: int) -> None:
    """Send this rank's output to logs/rank-N.log. Rank 0 keeps stdout for the progress display;
    every other stream, C++ warnings included, goes to the file (file descriptors 1/2, not just
    sys.stdout)."""
    path = run_dir / "logs" / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream_fd in ((2,) if rank == 0 else (1, 2)):
        os.dup2(fd, stream_fd)
    os.close(fd)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


@record
def main(run_dir: str, preemption: PreemptionFlag | None = None) -> None:
    run_dir = Path(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    rank, local_rank, _ = env_rank()
    _log_to_file(run_dir, rank)
    device = pick_device(cfg.launcher.device, local_rank)
    init_distributed(device, cfg.launcher.collective_timeout_s)
    # train() returns before the clean end, so model, optimizer and mesh are already unreferenced.
    train(cfg, run_dir, device, preemption or PreemptionFlag())
    end_distributed()
    log.info("rank %d done", rank)

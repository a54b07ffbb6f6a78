"""One worker's training run: build it once (train.assemble), then step until train.max_steps,
evaluating and saving on the way; a preemption signal saves the step and stops.

Started by the elastic agent as `python -m partrain.train RUN_DIR`, one process per rank. It reads
the frozen RUN_DIR/config.yaml (never Hydra), writes logs/rank-N.log, and on global rank 0 also
metrics.jsonl and the progress display. Errors are recorded in the elastic error file so that the
launcher can name the failing rank and its message.
"""

import logging
import os
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.checkpoint import store
from partrain.checkpoint.state import build_state
from partrain.config.frozen import CONFIG, load_frozen_config
from partrain.launch.preemption import PreemptionFlag
from partrain.observe.hang import HangWatch, hang_limit
from partrain.observe.memory import StepMemory, per_rank
from partrain.observe.metrics import format_step, summary_table
from partrain.observe.profile import StepProfiler
from partrain.observe.trace import TRACE_STEPS, write_trace
from partrain.parallel.dist import (
    attempt,
    end_distributed,
    env_rank,
    init_distributed,
    pick_device,
)
from partrain.parallel.float8 import Float8Unavailable
from partrain.parallel.zero import OffloadUnavailable
from partrain.train.assemble import Run, build
from partrain.train.guard import Diverged, NonFiniteStart
from partrain.train.shared_dir import RunDirNotShared, check_shared_run_dir
from partrain.train.optim import lr_at, set_lr
from partrain.train.step import evaluate, micro_batches, train_step

log = logging.getLogger("partrain")

# Test-only fault hooks: PARTRAIN_TEST_FAULT="RANK:STEP" makes that rank raise at that step
# (":exit0": end its process with os._exit(0) there, ":sysexit": call sys.exit(0));
# PARTRAIN_TEST_NONFINITE (_loss_fn) gives it a NaN loss; PARTRAIN_TEST_HANG="RANK:STEP:HOW"
# (_hang) makes it hang there. Each fires in the first attempt only; ":always" in every.
FAULT_ENV = "PARTRAIN_TEST_FAULT"
NONFINITE_ENV = "PARTRAIN_TEST_NONFINITE"
HANG_ENV = "PARTRAIN_TEST_HANG"


class PreemptedUnsaved(Exception):
    """A preemption signal whose checkpoint every rank refused (the state held a NaN or an
    infinity): the job stops as signalled (the launcher exits 3, and a requeued job resumes from
    the newest good checkpoint), never as a run that finished."""


def train(cfg, run_dir: Path, device: torch.device, preemption: PreemptionFlag,
          watch: HangWatch) -> None:
    run = build(cfg, run_dir, device)
    t = cfg.train
    history, val_losses, started = [], [], time.perf_counter()
    preempted_at = None
    profiler = StepProfiler(run_dir, run.rank, device, t.profile_start, t.profile_steps,
                            run.first_step)
    if t.profile_start and run.first_step > t.profile_start + t.profile_steps - 1:
        log.info("train.profile_start=%d: its steps ran before this resume; nothing profiled",
                 t.profile_start)
    step = run.first_step
    built = parameter_names(run.backend.module)
    try:
        for step in range(run.first_step, t.max_steps + 1):
            watch.begin(step)
            profiler.begin(step)
            rec = run_step(run, step)
            if step == run.first_step:
                check_no_new_parameters(built, run.backend.module)
            watch.end(step)
            history.append(rec)
            # An evaluation or a save may take long: only a long wait in one collective is timed.
            with watch.quiet(f"in the profiler's output after step {step}"):
                table = profiler.end(step, rec["step_time_s"])
                if table is not None:
                    log.info("profiled steps %d-%d: %s (and its Chrome trace beside it)",
                             profiler.first, step, table)
                if (t.eval_every and step % t.eval_every == 0) or step == t.max_steps:
                    watch.doing(f"in the evaluation after step {step}")
                    val_losses.append((step, run_evaluation(run, step)))
                watch.doing(f"in the checkpoint save after step {step}")
                if save_if_due(run, step, preemption, skipped=rec.get("skipped", False)):
                    preempted_at = step
                    break
                run.checkpointer.poll()
        with watch.quiet(f"in the last checkpoint save, after step {step}"):
            run.checkpointer.close(preempted=preempted_at is not None)
    finally:
        # Also on a failure: a live display left running would leave the terminal's cursor hidden.
        run.display.stop()
        run.metrics.close()
        # A preemption or an error inside the profiled window: what it recorded is written
        # (and a failure to write it never hides the run's own error).
        try:
            profiler.close()
        except Exception as err:  # noqa: BLE001
            log.warning("the profile of steps %s-%d could not be written: %s", profiler.first,
                        step, err)
    with watch.quiet("in the run's end (its summary, the last collectives)"):
        finish(run, history, val_losses, time.perf_counter() - started)
    if preempted_at is not None:
        log.info("stopped at step %d on a preemption signal", preempted_at)


def parameter_names(module: torch.nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters()}


def check_no_new_parameters(built: set[str], module: torch.nn.Module) -> None:
    """After the first step: a parameter the model made in its forward (`self.head = nn.Linear(
    ...)` there) trained on no optimizer, was reduced by no backend and broke layout parity,
    without a word."""
    new = sorted(parameter_names(module) - built)
    if new:
        raise RuntimeError(
            f"the model made parameters in its forward ({', '.join(new[:4])}"
            f"{' ...' if len(new) > 4 else ''}): the optimizer, the gradient reduction and the "
            "checkpoint's layout hold only those the builder made; create every module in the "
            "model's __init__")


def run_step(run: Run, step: int) -> dict:
    """Train step `step` and report it: one metrics line (and the progress display)."""
    cfg, dims, t = run.cfg, run.dims, run.cfg.train
    fault = _test_hook(FAULT_ENV, run.rank, step)
    if fault == "exit0":  # the process ends as os._exit(0) in a library would end it
        os._exit(0)
    if fault == "sysexit":
        sys.exit(0)
    if fault is not None:
        raise RuntimeError(f"injected fault ({FAULT_ENV}={os.environ[FAULT_ENV]}) on rank "
                           f"{run.rank} at step {step}")
    _hang(run, step)
    step_start = time.perf_counter()
    lr = lr_at(step, cfg.optim, t.max_steps)
    set_lr(run.backend.optimizer, lr)
    micro = micro_batches(run.batches.train, step, cfg, dims, run.coords)
    if run.rank == 0:  # a source's next epoch (data.sampling=epochs), said once
        for line in run.batches.train.epochs_begun(step):
            log.info("%s", line)
            run.display.print(line)
    run.tracer.at_step(step)
    # train.measure_memory: the second step of the run (optimizer state made), or the only.
    meter = (StepMemory(run.device)
             if t.measure_memory and step == min(run.first_step + 1, t.max_steps) else None)
    with run.tracer.span(f"step {step}", "step"), meter or nullcontext():
        # A background save's copy of the state must be done before the update.
        loss_value, update = train_step(run.backend, micro, _loss_fn(run, step), dims, run.mesh,
                                        run.device, run.autocast, run.tracer,
                                        run.checkpointer.staged)
        skipped = run.guard.check(step, loss_value, update)
        extra = run.after_step(update.applied)
    step_time = time.perf_counter() - step_start
    rec = {"step": step, "loss": loss_value, "grad_norm": update.grad_norm, "lr": lr,
           "tokens": step * run.tokens_per_step, "tokens_per_s": run.tokens_per_step / step_time,
           "step_time_s": step_time, **run.batches.train.report(step), **skipped, **extra,
           **(per_rank(meter, run.device) if meter else {})}
    if run.peak_flops:
        rec["mfu"] = run.flops_per_step / step_time / (run.peak_flops * dims.world_size)
    if run.device.type == "cuda":  # rank 0's peak since the start
        rec["memory_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    run.metrics.write(rec)
    run.display.update(rec)
    if step % t.log_every == 0 or step == 1 or skipped:
        log.info(format_step(rec))
    if run.guard.exhausted:
        run.checkpointer.wait()  # a background save of a good step is committed first
        message = [run.guard.message(run.run_dir, cfg.optim.lr) if run.rank == 0 else None]
        dist.broadcast_object_list(message, src=0)
        raise Diverged(message[0])
    return rec


def _test_hook(name: str, rank: int, step: int) -> str | None:
    """A test hook's "RANK:STEP[:HOW][:always]" for this rank and step, or None: "" or HOW when
    it fires. It fires in the first attempt only (a restarted run goes on), ":always" in every."""
    spec = os.environ.get(name, "")
    parts = spec.split(":")
    always = parts[-1] == "always" and len(parts) > 2
    parts = parts[:-1] if always else parts
    if len(parts) < 2 or parts[:2] != [str(rank), str(step)] or (attempt() and not always):
        return None
    return parts[2] if len(parts) > 2 else ""


def _hang(run: Run, step: int) -> None:
    """Test hook PARTRAIN_TEST_HANG="RANK:STEP:sleep" makes that rank sleep inside the step;
    ":hold" holds the GIL there (its watch cannot run: the launcher's signal must fetch its
    stack); ":eval" makes it sleep in the evaluation after the step instead; ":skip" makes it
    skip ahead, past the step's first collectives, into a world all-reduce
    that the others reach only after those: a rank in a different branch."""
    how = _test_hook(HANG_ENV, run.rank, step)
    if how == "sleep":
        time.sleep(3600)
    elif how == "hold":  # stuck in C code that holds the GIL: a regex that backtracks for ages
        re.fullmatch(r"(a+)+b", "a" * 64)
    elif how == "skip":
        dist.all_reduce(torch.zeros(1, device=run.device))


def _loss_fn(run: Run, step: int):
    """The loss, or (test hook PARTRAIN_TEST_NONFINITE="RANK:FIRST[-LAST]") a NaN loss on that
    rank at those steps: a divergence on demand, on any layout."""
    spec = os.environ.get(NONFINITE_ENV, "")
    rank, _, steps = spec.partition(":")
    first, _, last = steps.partition("-")
    if spec and int(rank) == run.rank and int(first) <= step <= int(last or first):
        return lambda logits, target: run.loss_fn(logits, target) * float("nan")
    return run.loss_fn


def run_evaluation(run: Run, step: int) -> float:
    run.tracer.recording = False
    if _test_hook(HANG_ENV, run.rank, step) == "eval":  # test hook: a rank stuck in evaluation
        time.sleep(3600)
    val_loss = evaluate(run.backend, run.batches, run.loss_fn, run.cfg, run.dims, run.mesh,
                        run.coords, run.device, run.autocast)
    run.metrics.write({"step": step, "val_loss": val_loss})
    log.info("step %d val_loss %.4f", step, val_loss)
    run.display.print(f"step {step:>6}  val_loss {val_loss:.4f}")
    return val_loss


def save_if_due(run: Run, step: int, preemption: PreemptionFlag, skipped: bool) -> bool:
    """Save on the checkpoint cadence, at the end, and on a preemption signal; True when the run
    must stop here (signalled: saved, and waited for). A skipped step (divergence guard) leaves
    its cadence save to the next good step, so that the newest checkpoint is a good step's; at
    the end or on a signal it saves (the state is the last good step's, nothing is lost)."""
    ckpt, checkpointer = run.cfg.checkpoint, run.checkpointer
    # Every rank learns whether any was signalled (SIGUSR2), so all save this same step.
    signalled = preemption.agreed(run.device)
    last = step == run.cfg.train.max_steps
    saved = None
    due = checkpointer.due(step, last)
    if due and skipped and not last:
        checkpointer.owed = True  # every rank skipped this step: the next good step saves
    if signalled is not None or ((due or checkpointer.owed) and (last or not skipped)):
        reason = ("preemption" if signalled is not None else
                  "every" if (ckpt.every and step % ckpt.every == 0) or checkpointer.owed
                  else "last")
        saved = checkpointer.save(build_state(run.backend.model, run.backend.optimizer,
                                              run.tp_mesh, run.dims.deepspeed_enabled),
                                  step, reason, started=signalled,
                                  meta={"skipped_in_a_row": run.guard.in_a_row,
                                        **getattr(run.backend, "scaler_state", dict)()})
        if saved:
            checkpointer.owed = False
    if signalled is None:
        if last and saved is False:  # refused: the state held a NaN or an infinity
            # The final state is not finite: a run that ended `done` here would name no good
            # result (an update from a broken optimizer state, with a finite loss and gradient,
            # is one the guard cannot skip)
            kept = store.newest(run.run_dir / store.CHECKPOINTS)
            lower = f"optim.lr={run.cfg.optim.lr / 10:.3g}"
            raise Diverged(
                f"the state at step {step}, the last (train.max_steps), is not finite "
                f"({run.checkpointer.refused}): its checkpoint was not saved and the run did not "
                "finish. " + (f"The newest good checkpoint is {kept.path} (step {kept.step}); "
                              f"resume from it with a lower learning rate: partrain launch "
                              f"--resume {run.run_dir} {lower}" if kept else
                              "No checkpoint was committed before it: start the run again with a "
                              f"lower learning rate, e.g. the same command with {lower} and "
                              "another --run-dir (this one holds the diverged run's config)"))
        return False
    if not saved:  # every rank refused the same non-finite state: stop, and say it was not saved
        kept = store.newest(run.run_dir / store.CHECKPOINTS)
        raise PreemptedUnsaved(
            f"preemption signal at step {step}: its checkpoint was not saved "
            f"({run.checkpointer.refused}); "
            + (f"the newest good checkpoint is {kept.path} (step {kept.step}): relaunch to resume "
               f"from it (steps {kept.step + 1}-{step} are trained again)" if kept else
               "no checkpoint was committed before it: relaunch to start again from step 1"))
    run.checkpointer.wait()
    run.display.print(f"preemption signal: saved step {step} in "
                      f"{time.time() - signalled:.2f} s after the signal")
    return True


def finish(run: Run, history: list[dict], val_losses: list, seconds: float) -> None:
    """The trace (gathered on rank 0) and the summary table."""
    dims = run.dims
    if run.cfg.train.trace:
        gathered = [None] * dims.world_size if run.rank == 0 else None
        dist.gather_object(run.tracer.spans, gathered, dst=0)
        if run.rank == 0 and not any(gathered):
            log.info("train.trace: no step of this start is among the first %d; no trace written",
                     TRACE_STEPS)
        elif run.rank == 0:
            labels = [f"rank {r} (pp {c['pp']}, dp {c['dp']}, "
                      + (f"cp {c['cp']}, " if dims.cp_enabled else "") + f"tp {c['tp']})"
                      for r, c in ((r, dims.coords(r)) for r in range(dims.world_size))]
            # A resumed start's trace beside the earlier start's, not over it.
            name = ("trace.json" if run.first_step == 1 else
                    f"trace.from-step-{run.first_step}.json")
            write_trace(run.run_dir / name, gathered, labels)
    if run.rank == 0 and history:
        run.display.console.print(summary_table(history, val_losses, seconds, run.run_dir,
                                                run.checkpointer.newest or run.start.resume))


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
    cfg = load_frozen_config(str(run_dir / CONFIG), [])  # the launcher's and resume's loader
    rank, local_rank, _ = env_rank()
    _log_to_file(run_dir, rank)
    device = pick_device(cfg.launcher.device, local_rank)
    init_distributed(device, cfg.launcher.collective_timeout_s)
    watch = HangWatch(run_dir, rank, int(os.environ["WORLD_SIZE"]), hang_limit(cfg.launcher),
                      cuda=device.type == "cuda",
                      collective_timeout_s=cfg.launcher.collective_timeout_s).start()
    stopped = None
    try:
        if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1:  # several nodes: one run dir?
            check_shared_run_dir(run_dir, rank, local_rank, int(os.environ.get("GROUP_RANK", 0)))
        # train() returns before the clean end: model, optimizer and mesh are unreferenced.
        train(cfg, run_dir, device, preemption or PreemptionFlag(), watch)
    except (Diverged, NonFiniteStart, PreemptedUnsaved, RunDirNotShared, Float8Unavailable,
            OffloadUnavailable) as err:
        # Every rank stops here together: end cleanly (out of the except block, whose
        # traceback still holds the run), then report.
        stopped = (type(err), str(err))
    except SystemExit as err:
        # torch's @record would take sys.exit(0) for the rank's success, with the run unfinished
        # and the other ranks waiting for it; any code is recorded as an error, with where.
        raise RuntimeError(
            f"sys.exit({err.code!r}) was called on rank {rank} {watch.phase}, before the end "
            f"of the run (train.max_steps={cfg.train.max_steps}): a rank ends at the run's end "
            "or on an error; raise an exception to stop it") from None
    watch.stop()  # rank 0 may write the trace and the summary first: the end is not timed
    end_distributed()
    if stopped is not None:
        log.error("%s", stopped[1])
        raise stopped[0](stopped[1])
    log.info("rank %d done", rank)

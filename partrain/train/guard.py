"""The divergence guard: a step whose loss or gradient norm is not finite changes nothing, on every
rank together, and too many such steps in a row stop the run with what happened and what to do.

The backends skip the update themselves (partrain.parallel.data.Update: the global loss and
norm are the same on every rank, so every rank decides alike); the guard checks that they did
agree, names the first parameter whose gradient was not finite in backward's order (the one
nearest the output, over every rank: where the NaN or infinity entered; every parameter before
it in the model usually follows), marks the step in metrics.jsonl and on the progress line, and after
`train.max_skipped_steps` skipped steps in a row raises `Diverged` on every rank at once. The
launcher turns that into exit 4 and one `error:` line (partrain.launch.local). The checkpointer,
for its part, never commits a state holding a non-finite value, and a skipped step's regular
save waits for the next good step, so the newest committed checkpoint is always a good one.
"""

import math
from pathlib import Path

import torch
import torch.distributed as dist

from partrain.checkpoint import store
from partrain.checkpoint.state import named_parameters
from partrain.observe.metrics import recorded_losses
from partrain.parallel.data import Update
from partrain.parallel.dist import local

# The launcher recognises a divergence by this exception's name in the rank's error file.
DIVERGED = "Diverged"


class Diverged(Exception):
    """train.max_skipped_steps steps in a row had a non-finite loss or gradient norm; raised on
    every rank at once, with the same message."""


class NonFiniteStart(Exception):
    """The weights or optimizer state a run starts from hold a NaN or an infinity; raised on
    every rank at once (the launcher: exit 2, a broken input)."""


def _first_nonfinite_local(model, optimizer) -> str | None:
    """This rank's first weight or optimizer-state tensor holding a NaN or an infinity."""
    params = named_parameters(model)
    for name, param in params.items():
        # ZeRO-3 keeps this rank's part in ds_tensor, FSDP in the DTensor's local shard.
        mine = local(getattr(param, "ds_tensor", param))
        if mine.is_floating_point() and not torch.isfinite(mine).all():
            return f"model.{name}"
    names = {id(p): name for name, p in params.items()}
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO wraps the optimizer
    for param, state in inner.state.items():
        for key, value in state.items():
            value = local(value) if torch.is_tensor(value) else value
            if torch.is_tensor(value) and value.is_floating_point() and \
                    not torch.isfinite(value).all():
                return f"optim.{names.get(id(param), '(a ZeRO partition)')}.{key}"
    return None


def check_finite_start(model, optimizer, source: str) -> None:
    """Refuse, on every rank, to train from weights or optimizer state that are not finite:
    every step would be skipped (or worse, a NaN moment would poison the first update)."""
    mine = _first_nonfinite_local(model, optimizer)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    bad = [(rank, key) for rank, key in enumerate(every) if key is not None]
    if bad:
        rank, key = bad[0]
        raise NonFiniteStart(
            f"{source} holds a non-finite value: {key} (on rank {rank}) has a NaN or an "
            "infinity, so it cannot be trained from (a checkpoint saved before partrain's "
            "divergence guard, or damaged since). Start from another one: for a resume, move "
            "this checkpoint out of RUN_DIR/checkpoints/ and the run resumes from the newest "
            "that is left")


class DivergenceGuard:
    def __init__(self, model, max_skipped: int, pp_stage: int, device: torch.device):
        params = named_parameters(model)
        # (pipeline stage, place on the stage): the model's order over every rank.
        self.order = {id(p): (pp_stage, i, name) for i, (name, p) in enumerate(params.items())}
        self.max_skipped, self.device = max_skipped, device
        self.in_a_row = 0
        self.last: dict = {}

    def check(self, step: int, loss: float, update: Update) -> dict:
        """After the step's update (or its skip): what metrics.jsonl records of it."""
        applied = torch.tensor([float(update.applied)], device=self.device)
        dist.all_reduce(applied)
        world = dist.get_world_size()
        if applied.item() not in (0, world):
            raise RuntimeError(f"step {step}: {int(applied.item())} of {world} ranks applied the "
                               "update and the others skipped it; the replicas now differ. This "
                               "is a bug in partrain: please report it with the run dir's logs")
        if update.applied or update.scaler_skipped:
            self.in_a_row = 0
            return {}
        self.in_a_row += 1
        mine = self.order.get(id(update.nonfinite)) if update.nonfinite is not None else None
        every = [None] * world
        dist.all_gather_object(every, mine)
        found = sorted(x for x in every if x is not None)
        self.last = {"step": step, "loss": loss, "grad_norm": update.grad_norm,
                     "param": found[-1][2] if found else None}  # the last in the model's order
        return {"skipped": True, "skipped_in_a_row": self.in_a_row,
                "nonfinite_param": self.last["param"]}

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.max_skipped

    def message(self, run_dir: Path, lr: float) -> str:
        """Rank 0's account of the divergence (the newest committed checkpoint is a good one)."""
        last = self.last
        param = (f"the first gradient in backward that was not finite: {last['param']}"
                 if last["param"] else "every gradient was finite (the loss was not)")
        newest = store.newest(run_dir / store.CHECKPOINTS)
        lower = f"optim.lr={lr / 10:.3g}"
        losses = {} if newest is None else losses_at(run_dir, (1, newest.step))
        if newest is None:
            where = ("No checkpoint was committed before it: start the run again with a lower "
                     f"learning rate, e.g. the same command with {lower} and another --run-dir "
                     "(this one holds the diverged run's config)")
        elif losses.get(newest.step, -math.inf) > losses.get(1, math.inf):
            # Finite is all the guard asks of a checkpoint, but one whose loss is above the
            # untrained model's was saved after the run had gone wrong: a resume from it, at any
            # learning rate, trains on from broken weights.
            where = (f"The newest good checkpoint, {newest.path} (step {newest.step}), has a loss "
                     f"of {_num(losses[newest.step])}, above the untrained model's "
                     f"{_num(losses[1])} at step 1: the run had gone wrong before it was saved, "
                     "and a resume from it would go on from there. Start a new run (another "
                     f"--run-dir) with a lower learning rate, e.g. {lower}, or resume from an "
                     "older checkpoint whose loss was lower, if one is kept (move the newer ones "
                     f"out of {newest.path.parent})")
        else:
            where = (f"The newest good checkpoint is {newest.path} (step {newest.step}); resume "
                     f"from it with a lower learning rate: partrain launch --resume {run_dir} "
                     f"{lower}")
        steps = "1 step" if self.in_a_row == 1 else f"{self.in_a_row} steps in a row"
        return (f"training diverged: {steps} had a non-finite loss or "
                f"gradient norm (train.max_skipped_steps={self.max_skipped}), the last at step "
                f"{last['step']}: loss {_num(last['loss'])}, grad_norm {_num(last['grad_norm'])}; "
                f"{param}. {'Its update was' if self.in_a_row == 1 else 'Their updates were'} "
                "skipped: weights and optimizer state are those "
                f"of the last good step. {where}")


def losses_at(run_dir: Path, steps) -> dict[int, float]:
    """The training loss metrics.jsonl records at each of `steps` that it holds (the last line of
    a step, which a restart may have written again)."""
    wanted = set(steps)
    return {step: loss for step, loss in recorded_losses(run_dir) if step in wanted}


def _num(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)

"""What the divergence guard tells a person to do (partrain/train/guard.py's message): resume from
the newest good checkpoint with a lower learning rate, unless that checkpoint's loss is already
above the untrained model's, when a resume would go on from broken weights."""

import json

import pytest

from partrain.train.guard import DivergenceGuard, losses_at
from tests.unit.checkpoint.builders import write_checkpoint


def _guard() -> DivergenceGuard:
    guard = object.__new__(DivergenceGuard)  # its message needs no model or process group
    guard.max_skipped, guard.in_a_row = 5, 5
    guard.last = {"step": 13, "loss": float("nan"), "grad_norm": float("nan"),
                  "param": "output.weight"}
    return guard


def _run(tmp_path, losses: dict[int, float]):
    run_dir = tmp_path / "run"
    lines = [{"step": s, "loss": loss, "grad_norm": 1.0} for s, loss in losses.items()]
    lines.insert(1, {"step": 8, "val_loss": 1.0})  # an eval line: not a training loss
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    write_checkpoint(run_dir / "checkpoints", 8)
    return run_dir


@pytest.mark.parametrize("at_8, says", [
    (3.1, "resume from it with a lower learning rate: partrain launch --resume {run} optim.lr=3"),
    (1550.0, "has a loss of 1550, above the untrained model's 5.529 at step 1"),
])
def test_the_advice_follows_the_checkpoints_loss(tmp_path, at_8, says):
    run_dir = _run(tmp_path, {1: 5.5289, 4: 4.0, 8: at_8, 12: 9e9})
    said = _guard().message(run_dir, lr=30.0)
    assert says.format(run=run_dir) in said, said
    if at_8 > 5.5289:
        assert "Start a new run (another --run-dir) with a lower learning rate, e.g. optim.lr=3" \
            in said and "--resume" not in said, said


def test_the_losses_are_read_by_step_the_last_line_winning(tmp_path):
    run_dir = _run(tmp_path, {1: 5.5, 8: 2.0})
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss": 2.5}\n{"broken\n')  # a restart wrote step 8 again
    assert losses_at(run_dir, (1, 8, 99)) == {1: 5.5, 8: 2.5}
    assert losses_at(tmp_path / "nowhere", (1,)) == {}


def test_without_a_checkpoint_the_advice_names_another_run_dir(tmp_path):
    """The same command with a lower optim.lr was advised; with its --run-dir it is refused (the
    run dir holds the diverged run's config), exit 2 (a reviewer's run)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    said = _guard().message(run_dir, lr=30.0)
    assert ("start the run again with a lower learning rate, e.g. the same command with "
            "optim.lr=3 and another --run-dir (this one holds the diverged run's config)") in said

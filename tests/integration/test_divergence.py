"""The divergence guard through the real CLI (partrain/train/guard.py): a step whose loss or
gradient norm is not finite changes nothing on any rank, is marked in metrics.jsonl and on the
progress line, and train.max_skipped_steps of them in a row stop the run with exit 4 and one
`error:` line naming the step, the values, the parameter, the newest good checkpoint and the
resume command; no checkpoint holding a NaN is committed and rotation keeps the good ones.

A real divergence (optim.lr=30) on DDP and ZeRO-2; on the other layouts a NaN loss on one rank
(PARTRAIN_TEST_NONFINITE, the loop's test hook) makes one on demand."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from partrain.checkpoint import store
from tests.integration.conftest import (
    assert_no_abort,
    processes_mentioning,
    read_metrics,
    survivors,
)

FAST = ("launcher.device=cpu", "train.seq_len=64", "train.eval_every=0")
NONFINITE_ENV = "PARTRAIN_TEST_NONFINITE"


def _state(checkpoint: Path, tmp: Path) -> dict:
    """Every tensor a checkpoint holds, by key (DCP's own offline converter)."""
    out = tmp / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def _all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def _error_line(res) -> str:
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.stdout[-3000:] + res.stderr[-3000:]
    return lines[0]


def _unwrapped(text: str) -> str:
    """The console's text with its line wrapping undone."""
    return " ".join(text.split())


def test_a_diverging_run_stops_with_exit_4_and_keeps_its_good_checkpoints(cli, tmp_path):
    """The issue's command: lr=30 gives a NaN gradient norm from step 5; the old code trained on
    in NaN to step 16, exit 0, and kept only NaN checkpoints."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", *FAST, "parallel.dp=2", "optim.lr=30", "optim.warmup_steps=6",
                  "train.max_steps=16", "checkpoint.every=2", "checkpoint.keep=2",
                  "--run-dir", str(run_dir))
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    steps, _ = read_metrics(run_dir)
    skipped = [s for s in steps if s.get("skipped")]
    assert skipped, "no step was skipped"
    first_bad = skipped[0]["step"]
    # Every step before the first skip trained; then max_skipped_steps (5) in a row, and stop.
    assert all(math.isfinite(s["grad_norm"]) and math.isfinite(s["loss"])
               for s in steps if s["step"] < first_bad)
    assert [s["step"] for s in skipped] == list(range(first_bad, first_bad + 5))
    assert [s["skipped_in_a_row"] for s in skipped] == [1, 2, 3, 4, 5]
    assert steps[-1]["step"] == first_bad + 4 < 16
    assert all(not (math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"])) for s in skipped)
    param = skipped[-1]["nonfinite_param"]
    assert param and param.endswith(".weight"), param

    root = run_dir / store.CHECKPOINTS
    kept = store.committed(root)
    good = [c for c in kept if c.step < first_bad]
    assert kept and kept == good, [c.step for c in kept]  # nothing saved at a skipped step
    newest = store.newest(root)
    assert newest.step == max(s for s in range(2, first_bad, 2))
    for checkpoint in kept:
        assert _all_finite(_state(checkpoint.path, tmp_path)), checkpoint.path

    error = _error_line(res)
    last = skipped[-1]
    # lr=30 wrecks the model before the first NaN: the newest good checkpoint's loss is already
    # above the untrained model's, and the advice is a new run, not a resume from it.
    loss = {s["step"]: s["loss"] for s in steps}
    advice = (("has a loss of", "above the untrained model's", "Start a new run (another "
               "--run-dir) with a lower learning rate, e.g. optim.lr=3")
              if loss[newest.step] > loss[1]
              else (f"partrain launch --resume {run_dir} optim.lr=3",))
    for words in (f"the last at step {last['step']}", "train.max_skipped_steps=5", param,
                  "grad_norm nan" if math.isnan(last["grad_norm"]) else "grad_norm",
                  str(newest.path), *advice):
        assert words in error, (words, error)
    assert "skipped (non-finite; 1 in a row" in _unwrapped(res.stdout)
    assert_no_abort(run_dir, res.stdout, res.stderr)
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)

    # A resume from the good checkpoint with a lower learning rate is taken as such.
    resumed = cli.run("launch", "--resume", str(run_dir), "optim.lr=3",
                      f"train.max_steps={newest.step + 1}")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "changed on resume: optim.lr 30.0 -> 3.0" in resumed.stdout, resumed.stdout[-2000:]
    assert f"resuming from step {newest.step}" in resumed.stdout


LAYOUTS = [
    pytest.param("dp2", ("parallel.dp=2",), 1, id="ddp-dp2"),
    pytest.param("zero1 dp2", ("parallel.dp=2", "parallel.zero_stage=1"), 1, id="zero1",
                 marks=pytest.mark.slow),
    pytest.param("zero2 dp2", ("parallel.dp=2", "parallel.zero_stage=2"), 0, id="zero2",
                 marks=pytest.mark.slow),
    pytest.param("zero3 dp2", ("parallel.dp=2", "parallel.zero_stage=3"), 1, id="zero3",
                 marks=pytest.mark.slow),
    pytest.param("tp2 + sp", ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"), 0,
                 id="tp2",
                 marks=pytest.mark.slow),
    # FSDP2 with tp + sp: the optimizer's DTensor shards stay as they were.
    pytest.param("fsdp3 dp2 x tp2 + sp", ("parallel.dp=2", "parallel.tp=2",
                                          "parallel.sequence_parallel=true", "parallel.zero_stage=3",
                                          "parallel.zero_backend=fsdp"), 2,
                 id="fsdp3-tp2", marks=pytest.mark.slow),
    # The loss lives on the last stage (rank 1).
    pytest.param("pp2", ("parallel.dp=1", "parallel.pp=2", "train.micro_batch_size=2"), 1,
                 id="pp2", marks=pytest.mark.slow),  # pp2 stays quick in the exit-4 table
    pytest.param("cp2", ("parallel.dp=1", "parallel.cp=2"), 1, id="cp2", marks=pytest.mark.slow),
    pytest.param("tiny-moe dp2 x ep2", ("moe-tiny", "parallel.dp=2", "parallel.ep=2",
                                        "model.moe.balance=bias"), 1, id="moe-ep2",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("label, layout, rank", LAYOUTS)
def test_a_skipped_step_changes_nothing(cli, tmp_path, label, layout, rank):
    """A NaN loss on one rank at step 3 of 3: every rank skips the update together, so the
    state saved at the end (step 3) is the state of step 2, every tensor bit for bit: weights,
    moments, step counters, a MoE's expert bias. The run then ends well (exit 0)."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", *layout, *FAST, "train.max_steps=3", "checkpoint.every=1",
                  "checkpoint.keep=5", "--run-dir", str(run_dir),
                  env={NONFINITE_ENV: f"{rank}:3", "DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    assert [s.get("skipped", False) for s in steps] == [False, False, True], label
    assert math.isnan(steps[2]["loss"])
    assert "skipped (non-finite; 1 in a row" in _unwrapped(res.stdout)
    root = run_dir / store.CHECKPOINTS
    assert [c.step for c in store.committed(root)] == [1, 2, 3]  # the last step is saved
    before = _state(root / store.step_dir_name(2), tmp_path)
    after = _state(root / store.step_dir_name(3), tmp_path)
    first = _state(root / store.step_dir_name(1), tmp_path)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{label}: the skipped step changed {changed[:5]}"
    # ... while a good step does change the state (the comparison can fail).
    assert any(not torch.equal(first[k], before[k]) for k in before if k.startswith("model"))
    assert _all_finite(after)
    assert_no_abort(run_dir, res.stdout, res.stderr)


EXIT_4 = [
    # With a restart to spare (launcher.max_restarts): the agent restarted the workers, the
    # restart went on from step 2 and the run ended 0, or diverged again at every restart.
    pytest.param(("parallel.dp=1", "parallel.pp=2", "train.micro_batch_size=2",
                  "--max-restarts", "1"), 1, id="pp2, a restart to spare"),
    pytest.param(("parallel.dp=2", "parallel.zero_stage=3"), 0, id="zero3",
                 marks=pytest.mark.slow),
    pytest.param(("parallel.dp=2", "parallel.zero_stage=2", "parallel.zero_backend=fsdp"), 1,
                 id="fsdp2", marks=pytest.mark.slow),
    pytest.param(("moe-tiny", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2"), 3,
                 id="moe-ep2-tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layout, rank", EXIT_4)
def test_skipped_steps_in_a_row_stop_every_rank_with_exit_4(cli, tmp_path, layout, rank):
    """NaN from step 3 on, on one rank, train.max_skipped_steps=2 and checkpoint.keep=1: steps
    3 and 4 are skipped, the run stops at step 4 with exit 4 on every rank, and the one
    checkpoint kept is step 2's (rotation never removed the newest good one)."""
    run_dir = tmp_path / "run"
    res = cli.run("launch", *layout, *FAST, "train.max_steps=8", "checkpoint.every=1",
                  "checkpoint.keep=1", "train.max_skipped_steps=2", "--run-dir", str(run_dir),
                  env={NONFINITE_ENV: f"{rank}:3-8", "DS_ACCELERATOR": "cpu"})
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    error = _error_line(res)
    newest = store.newest(run_dir / store.CHECKPOINTS)
    assert [c.step for c in store.committed(run_dir / store.CHECKPOINTS)] == [2]
    # A NaN loss: backward meets it first at the output layer (on the last pipeline stage).
    for words in ("2 steps in a row", "the last at step 4", "loss nan", "output.weight",
                  str(newest.path), f"--resume {run_dir} optim.lr="):
        assert words in error, (words, error)
    assert "Traceback" not in res.stdout + res.stderr
    assert "restart 1 of" not in res.stdout + res.stderr
    assert_no_abort(run_dir, res.stdout, res.stderr)
    assert not survivors(lambda: processes_mentioning(str(run_dir)), 5)


def test_a_skipped_cadence_step_saves_at_the_next_good_one_and_the_end_is_kept(cli, tmp_path):
    """checkpoint.every=4 and a NaN at step 4, save_last=false, 7 steps: the cadence save of step
    4 goes to step 5, the next good step (it was dropped: the next came at 8, past the end, and
    the run kept no checkpoint at all). The same command again then has nothing to do: its
    metrics reached max_steps and its launch ended done (it trained steps 6-7 again from step
    5's checkpoint and wrote their metrics over the first ones)."""
    run_dir = tmp_path / "run"
    command = ("launch", "parallel.dp=1", *FAST, "train.max_steps=7", "checkpoint.every=4",
               "checkpoint.save_last=false", "--run-dir", str(run_dir))
    res = cli.run(*command, env={NONFINITE_ENV: "0:4"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in steps if s.get("skipped")] == [4]
    kept = store.committed(run_dir / store.CHECKPOINTS)
    assert [(c.step, c.reason) for c in kept] == [(5, "every")], kept
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    again = cli.run(*command)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    said = _unwrapped(again.stdout)
    assert "is trained to train.max_steps=7" in said and "nothing to do" in said, said
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_a_resume_inside_a_run_of_skips_counts_on(cli, tmp_path):
    """A checkpoint saved inside a run of skipped steps (the last step here; a preemption signal
    the same) keeps the guard's count: NaN at steps 3-5 and max_skipped_steps=3 stop the run at
    step 5 with exit 4 whether it was interrupted after step 4 or not. The resumed run counted
    from 0 again and trained on, past the limit the uninterrupted run stopped at."""
    run_dir = tmp_path / "run"
    env = {NONFINITE_ENV: "0:3-5"}
    first = cli.run("launch", "parallel.dp=1", *FAST, "train.max_steps=4", "checkpoint.every=0",
                    "train.max_skipped_steps=3", "--run-dir", str(run_dir), env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert store.newest(run_dir / store.CHECKPOINTS).meta["skipped_in_a_row"] == 2
    res = cli.run("launch", "--resume", str(run_dir), "train.max_steps=8", env=env)
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr[-3000:]
    assert "3 steps in a row" in _error_line(res)
    steps, _ = read_metrics(run_dir)
    assert [(s["step"], s.get("skipped_in_a_row")) for s in steps][-3:] == [(3, 1), (4, 2),
                                                                          (5, 3)]


def _poison_checkpoint(checkpoint: Path, key: str, tmp: Path) -> None:
    """Rewrite a committed checkpoint with a NaN in one tensor (DCP offline, one process): what
    a partrain older than the guard committed on the issue's diverging run."""
    import shutil

    import torch.distributed.checkpoint as dcp

    out = tmp / "whole.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    keep = {name: (checkpoint / name).read_bytes() for name in ("meta.json", "config.yaml")}
    shutil.rmtree(checkpoint)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(checkpoint))
    for name, data in keep.items():
        (checkpoint / name).write_bytes(data)
    # Such a partrain kept no crc32s (these would refuse the edited files as damaged).
    meta = json.loads(keep["meta.json"])
    del meta["files"]
    (checkpoint / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A dp2 run of two steps with a checkpoint at each, made once for the rows that poison a
    copy of it."""
    from tests.integration.conftest import CLI

    cli, run_dir = CLI(), tmp_path_factory.mktemp("nan") / "run"
    try:
        first = cli.run("launch", "launcher.device=cpu", "parallel.dp=2", "train.seq_len=64",
                        "train.eval_every=0", "train.max_steps=2", "checkpoint.every=1",
                        "--run-dir", str(run_dir))
    finally:
        cli.kill_all()
    assert first.returncode == 0, first.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("key", ["model.layers.1.feed_forward.w2.weight",
                                 pytest.param("optim.output.weight.exp_avg_sq",
                                              marks=pytest.mark.slow)])
def test_a_checkpoint_holding_a_nan_is_not_trained_from(cli, tmp_path, two_steps, key):
    """Resuming from a checkpoint with a NaN weight or moment (one committed before the guard
    existed) trained every step to NaN; now every rank refuses it before the first step: exit
    2 naming the tensor and the checkpoint, nothing trained."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    newest = store.newest(run_dir / store.CHECKPOINTS)
    _poison_checkpoint(newest.path, key, tmp_path)
    before = (run_dir / "metrics.jsonl").read_text()
    res = cli.run("launch", "--resume", str(run_dir), "train.max_steps=4")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    error = _error_line(res)
    for words in (f"the checkpoint {newest.path} holds a non-finite value", key,
                  "move this checkpoint out of RUN_DIR/checkpoints/"):
        assert words in error, (words, error)
    assert "Traceback" not in res.stdout + res.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert_no_abort(run_dir, res.stdout, res.stderr)

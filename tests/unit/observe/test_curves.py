"""Curves with the real libraries: TensorBoard events read back with tensorboard's own reader, a
W&B offline run's transaction log read back with wandb's own protobuf; a resumed run continues
the same curves (TensorBoard drops the steps after the checkpoint, W&B keeps the run id)."""

import json

import pytest
from omegaconf import OmegaConf

from partrain.config.schema import Config
from partrain.errors import ConfigError
from partrain.observe.curves import Curves, check_curves


def _cfg(**train):
    cfg = OmegaConf.structured(Config)
    cfg.name = "curves"
    for key, value in train.items():
        cfg.train[key] = value
    return cfg


def _records(steps, shift=0.0):
    out = []
    for step in steps:
        out.append({"step": step, "loss": 5.0 - 0.25 * step + shift, "grad_norm": 1.0 + step,
                    "lr": 1e-3 * step, "tokens": 100 * step, "tokens_per_s": 50.0,
                    "step_time_s": 0.5})
        if step % 2 == 0:
            out.append({"step": step, "val_loss": 4.0 - 0.1 * step})
    out.append({"step": steps[-1], "checkpoint": "checkpoints/x", "bytes": 1, "seconds": 0.1,
                "blocked_s": 0.1, "reason": "every"})
    return out


def _run(run_dir, cfg, steps, shift=0.0):
    curves = Curves(run_dir, cfg, first_step=steps[0], enabled=True)
    for record in _records(steps, shift):
        curves.write(record)
    curves.close()


def tensorboard_scalars(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def _wandb_records(path) -> list[bytes]:
    """The records of a .wandb transaction log. wandb 0.31 reads them only in its Go core, and
    the Python DataStore of earlier versions is gone, so this unframes them here: a 7-byte file
    header (":W&B", 0xBEE1, version 0), then LevelDB's log format (32 KiB blocks; each chunk a
    CRC32C, a 2-byte length and a type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def wandb_history(wandb_file) -> list[dict]:
    """The history rows (wandb.log calls) of an offline run, parsed with wandb's own protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for data in _wandb_records(wandb_file):
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_tensorboard_curves_and_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(tensorboard=True)
    _run(run_dir, cfg, [1, 2, 3, 4])
    # Resumed from the checkpoint of step 2: steps 3-4 are trained again (shifted values here).
    _run(run_dir, cfg, [3, 4, 5, 6], shift=0.5)
    scalars = tensorboard_scalars(run_dir)
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "perf/step_time_s",
            "val/loss"} == set(scalars)
    want = {r["step"]: r["loss"] for r in _records([1, 2]) + _records([3, 4, 5, 6], 0.5)
            if "loss" in r}
    assert scalars["train/loss"] == pytest.approx(want, rel=1e-6)
    assert sorted(scalars["val/loss"]) == [2, 4, 6]
    assert not (run_dir / "wandb").exists()


def test_tensorboard_after_a_start_again_from_step_1(tmp_path):
    """A run that starts again from its first step (stopped before its first checkpoint, an
    in-job restart before one, a requeue): the earlier start's points are dropped too. Without
    a purge marker at step 1, EventAccumulator kept both (val/loss 2, 4, 2, 4, 6)."""
    run_dir = tmp_path / "run"
    cfg = _cfg(tensorboard=True)
    _run(run_dir, cfg, [1, 2, 3, 4])
    _run(run_dir, cfg, [1, 2, 3, 4, 5, 6], shift=0.5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4, 6]  # each point once
    want = [r["loss"] for r in _records([1, 2, 3, 4, 5, 6], 0.5) if "loss" in r]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(want, rel=1e-6)


def test_wandb_offline_run_files_and_a_resume(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = _cfg(wandb="offline", wandb_project="partrain-tests")
    try:
        _run(run_dir, cfg, [1, 2])
        _run(run_dir, cfg, [3, 4])
    finally:
        wandb.teardown()
    run_id = (run_dir / "wandb" / "run-id").read_text().strip()
    # wandb names a run's directory by the second it started, plus "-1" when a directory of
    # that name is already there (both runs starting within one second).
    runs = sorted(p for pattern in (f"offline-run-*-{run_id}", f"offline-run-*-{run_id}-*")
                  for p in (run_dir / "wandb").glob(pattern))
    assert len(runs) == 2, list((run_dir / "wandb").iterdir())  # the resume kept the id
    rows = [row for run in runs for row in wandb_history(run / f"run-{run_id}.wandb")]
    losses = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert losses == pytest.approx({s: 5.0 - 0.25 * s for s in (1, 2, 3, 4)})
    assert {row["_step"]: row["val/loss"] for row in rows if "val/loss" in row} == \
        pytest.approx({2: 3.8, 4: 3.6})


def test_curves_off_write_nothing(tmp_path):
    _run(tmp_path, _cfg(), [1, 2])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key, value, package", [
    ("tensorboard", True, "tensorboard"), ("wandb", "offline", "wandb")])
def test_a_missing_library_is_refused_before_the_start(monkeypatch, key, value, package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError, match=rf"train.{key}=.* needs the {package} package.*"
                                          rf"pip install 'partrain\[{package}\]'"):
        check_curves(_cfg(**{key: value}))


@pytest.mark.parametrize("blend", [False, True], ids=["epochs", "blend"])
def test_the_epoch_is_a_curve_one_a_source_under_a_blend(tmp_path, monkeypatch, blend):
    """metrics.jsonl's `epoch` (data.sampling=epochs; a list under data.blend) in TensorBoard as
    data/epoch (data/epoch/K per source) and in W&B's history alike."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    epochs = {1: [0.25, 0.5], 2: [0.5, 1.0], 3: [0.75, 1.5]}
    curves = Curves(run_dir, _cfg(tensorboard=True, wandb="offline",
                                  wandb_project="partrain-tests"), first_step=1, enabled=True)
    try:
        for step, value in epochs.items():
            curves.write({"step": step, "loss": 1.0, "epoch": value if blend else value[1]})
        curves.close()
    finally:
        wandb.teardown()
    scalars = tensorboard_scalars(run_dir)
    run_id = (run_dir / "wandb" / "run-id").read_text().strip()
    [run] = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    rows = wandb_history(run / f"run-{run_id}.wandb")
    tags = {f"data/epoch/{k}": k for k in (0, 1)} if blend else {"data/epoch": 1}
    assert set(scalars) == {"train/loss", *tags}
    for tag, k in tags.items():
        want = {step: value[k] for step, value in epochs.items()}
        assert scalars[tag] == pytest.approx(want)
        assert {row["_step"]: row[tag] for row in rows if tag in row} == pytest.approx(want)

"""Checkpoints and run dirs built on disk the way partrain leaves them, for the launcher-side
tests (test_checkpoint.py, tests/unit/cli/test_hostile_resume.py): DCP's .metadata and shards
holding the config's real tensor shapes, partrain's meta.json, the config it was saved with."""

import functools
import json
from pathlib import Path

from omegaconf import OmegaConf

from partrain.checkpoint import store
from tests.unit.cli.hostile import frozen_text


@functools.cache
def dcp_files(model_yaml: str | None = None) -> dict[str, bytes]:
    """The files of a real DCP checkpoint of the model `model_yaml` describes (the quickstart's
    when None), its weights zeros, written once per model: shards and the .metadata, which the
    launcher checks whole and against the model before a start (partrain/checkpoint/verify.py)."""
    import tempfile
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from partrain.models.llama import Transformer

    model_cfg = OmegaConf.create(model_yaml or OmegaConf.to_yaml(
        OmegaConf.create(frozen_text()).model))
    with torch.device("meta"):
        model = Transformer(model_cfg)
    state = {f"model.{name}": torch.zeros(p.shape) for name, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        return {f.name: f.read_bytes() for f in Path(tmp).iterdir()}


def _model_yaml(config_text: str | None) -> str | None:
    """The model section of a checkpoint's config, when it has one to build."""
    try:
        return OmegaConf.to_yaml(OmegaConf.create(config_text).model)
    except Exception:  # a row's config that lies: the quickstart's tensors
        return None


def write_checkpoint(root: Path, step: int, config_text: str | None = None, *, meta=None,
                     metadata: bool = True, name: str | None = None) -> Path:
    """A checkpoint directory under `root` (RUN_DIR/checkpoints) as store.commit leaves one:
    DCP's .metadata, a shard, meta.json whose step is `step` (unless `meta` says otherwise) and
    the config it was saved with. `metadata=False` or `meta` make it lie."""
    path = root / (name or store.step_dir_name(step))
    path.mkdir(parents=True)
    model_yaml = _model_yaml(config_text) if config_text is not None else None
    for file, data in dcp_files(model_yaml).items():
        if metadata or file != store.DCP_METADATA:
            (path / file).write_bytes(data)
    if meta is not False:
        (path / store.META).write_text(json.dumps({"step": step, "reason": "every"}
                                                  if meta is None else meta))
    (path / store.SAVED_CONFIG).write_text(config_text if config_text is not None
                                           else frozen_text())
    return path


def write_run_dir(run_dir: Path, *steps: int, config_text: str | None = None) -> Path:
    """A run dir that trained and saved at `steps`: config.yaml, metrics, a rank log and the
    committed checkpoints, each holding the run's config."""
    text = config_text if config_text is not None else frozen_text()
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(text)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    (run_dir / "logs" / "rank-0.log").write_text("step 1\n")
    for step in steps:
        write_checkpoint(run_dir / store.CHECKPOINTS, step, text)
    if steps:
        (run_dir / store.CHECKPOINTS / store.LATEST).write_text(
            store.step_dir_name(max(steps)) + "\n")
    return run_dir

"""The run directory: config.yaml (frozen, exactly what the workers run), metrics.jsonl, logs/.

The nodes of one job share a run directory on a shared file system, and `partrain slurm` prepares
one before the job starts; so an existing run dir is joined, not refused, when nothing has
trained in it yet and its config.yaml is the very config this node resolved. Anything else must be
new or empty, so that the results of two runs never mix.
"""

import os
import time
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from partrain.errors import ConfigError

CONFIG = "config.yaml"


def default_run_dir(name: str, job_id: str | None = None) -> Path:
    """runs/<name>-<time>; inside a scheduler job runs/<name>-job<id>, the same on every node."""
    return Path("runs") / (f"{name}-job{job_id}" if job_id else
                           f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _trained_in(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or any((run_dir / "logs").glob("rank-*.log"))


def _same_config(path: Path, cfg: DictConfig) -> bool:
    try:
        return OmegaConf.to_container(OmegaConf.load(path)) == OmegaConf.to_container(cfg)
    except (OSError, yaml.YAMLError, OmegaConfBaseException):
        return False


def check_run_dir(run_dir: Path, cfg: DictConfig | None = None) -> None:
    """A run dir is new, empty, or prepared for this very run (see the module docstring)."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return
    frozen = run_dir / CONFIG
    joinable = (cfg is not None and run_dir.is_dir() and not _trained_in(run_dir)
                and (not frozen.exists() or _same_config(frozen, cfg)))
    if not joinable:
        raise ConfigError(f"--run-dir {run_dir} already exists and is not empty; give a new one")


def write_run_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """Create the run dir with its frozen config.yaml (written whole, then renamed into place, so
    that nodes writing the same file at once never see half of it)."""
    check_run_dir(run_dir, cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{CONFIG}.{os.getpid()}.tmp"
    tmp.write_text(OmegaConf.to_yaml(cfg))
    tmp.rename(run_dir / CONFIG)
    return run_dir


def is_frozen_config(config: str | None) -> bool:
    """A run dir's config.yaml: a resolved config (every section, no defaults list)."""
    if not config or not config.endswith((".yaml", ".yml")) or not Path(config).is_file():
        return False
    try:
        raw = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return (isinstance(raw, dict) and "defaults" not in raw
            and {"model", "parallel", "train", "launcher"} <= raw.keys())


def load_frozen_config(config: str, overrides: list[str]) -> DictConfig:
    """Run a frozen config again as it is: typed against the schema, never re-composed. It takes
    no overrides: what the workers run must be exactly what the file says."""
    from partrain.config.schema import Config

    if overrides:
        raise ConfigError(
            f"{config} is a run dir's frozen config and takes no overrides (got "
            f"{' '.join(overrides)}); compose from the recipe instead, e.g. "
            f"`partrain launch RECIPE {' '.join(overrides)}`")
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config))
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"frozen config {config} does not match partrain's schema: {e}") from None

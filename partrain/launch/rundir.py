"""The run directory: config.yaml (frozen, exactly what the workers run), metrics.jsonl, logs/."""

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from partrain.errors import ConfigError


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    """A run dir is new or empty: results of two runs never mix."""
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise ConfigError(f"--run-dir {run_dir} already exists and is not empty; give a new one")


def write_run_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """Create the run dir with its frozen config.yaml (written whole, then renamed into place)."""
    check_run_dir(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(cfg))
    tmp.rename(run_dir / "config.yaml")
    return run_dir

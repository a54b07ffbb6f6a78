"""The run directory: config.yaml (frozen, exactly what the workers run), metrics.jsonl, logs/.

The nodes of one job share a run directory on a shared file system, and `partrain slurm` prepares
one before the job starts; so an existing run dir is joined, not refused, when nothing has
trained in it yet and its config.yaml is the very config this node resolved. Anything else must be
new or empty, so that the results of two runs never mix.
"""

import os
import shutil
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from partrain.config.frozen import CONFIG
from partrain.config.paths import with_anchored_paths
from partrain.data.sampler import tokenizer_source
from partrain.data.tokenizer import RUN_TOKENIZER, copy_files, data_tokenizer_dir
from partrain.errors import ConfigError

MIN_FREE_BYTES = 1 << 20  # a run dir with less room fails at its first write of metrics


def default_run_dir(name: str, job_id: str | None = None) -> Path:
    """runs/<name>-<time>; inside a scheduler job runs/<name>-job<id>, the same on every node."""
    return Path("runs") / (f"{name}-job{job_id}" if job_id else
                           f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _trained_in(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or any((run_dir / "logs").glob("rank-*.log"))


def _same_config(path: Path, cfg: DictConfig) -> bool:
    from partrain.config.compose import read_yaml

    try:  # read_yaml refuses what is not a small regular file (a FIFO would block here)
        frozen = read_yaml(path)
    except ConfigError:
        return False
    # A run dir frozen before its paths were made absolute holds them as typed.
    if not isinstance(frozen, dict):
        return False
    frozen = with_anchored_paths(OmegaConf.create(frozen))
    return OmegaConf.to_container(frozen) == OmegaConf.to_container(with_anchored_paths(cfg))


def _prepared_by_partrain(run_dir: Path) -> bool:
    """Holds only what `partrain slurm` or another node's launcher writes before training: the
    frozen config (or its temporary file, mid-rename), logs/, the sbatch script."""
    from partrain.launch.slurm import SCRIPT

    return all(entry.name in (CONFIG, "logs", SCRIPT) or
               (entry.name.startswith(f".{CONFIG}.") and entry.name.endswith(".tmp"))
               for entry in run_dir.iterdir())


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_run_dir(run_dir: Path, cfg: DictConfig | None = None, resuming: bool = False):
    """A run dir is new, empty, prepared for this very run, or holds a committed checkpoint of
    this very config (or `resuming`: of any config; resume.py checks what may change), and can
    be made: checked before anything is written, and by --dry-run. Returns the checkpoint to
    resume from, or None."""
    from partrain.checkpoint import store

    def refuse(rule: str) -> ConfigError:
        return ConfigError(f"{'--resume' if resuming else '--run-dir'} {run_dir} {rule}")

    checkpoint = None

    try:
        if run_dir.is_symlink() and not run_dir.exists():
            raise refuse("is a broken or looping symbolic link")
        if run_dir.exists() and not run_dir.is_dir():
            raise refuse("is an existing file; give a new directory")
        if resuming and (not run_dir.is_dir() or store.newest(run_dir / store.CHECKPOINTS) is None):
            raise refuse(f"holds no committed checkpoint in {store.CHECKPOINTS}/; give the run dir "
                         "of a run that saved one (every checkpoint.every steps, at the end, and "
                         "on SIGUSR2)")
        if run_dir.is_dir() and any(run_dir.iterdir()):
            frozen = run_dir / CONFIG
            checkpoint = store.newest(run_dir / store.CHECKPOINTS) if cfg is not None else None
            if checkpoint is not None and not resuming and not (
                    frozen.exists() and _same_config(frozen, cfg)):
                raise refuse(
                    f"holds a checkpoint at step {checkpoint.step} of another config; continue it "
                    f"with `partrain launch --resume {run_dir} [OVERRIDE...]` (the layout may "
                    "change), or give a new --run-dir")
            joinable = checkpoint is not None or (
                cfg is not None and not _trained_in(run_dir) and _prepared_by_partrain(run_dir)
                and (not frozen.exists() or _same_config(frozen, cfg)))
            if not joinable:
                raise refuse("already exists and is not empty; give a new one (a run dir holds "
                             "one run: partrain writes only into a new or empty directory)")
        parent = _nearest_existing(run_dir)
        if not parent.is_dir():
            raise refuse(f"cannot be made: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            problem = "read-only file system" if _read_only_fs(parent) else "permission denied"
            raise refuse(f"cannot be written: {parent} is not writable ({problem})")
        free = shutil.disk_usage(parent).free
        if free < MIN_FREE_BYTES:
            raise refuse(f"cannot be written: {parent} has {free:,} bytes free (at least "
                         f"{MIN_FREE_BYTES:,} needed for the config, metrics and logs)")
    except OSError as e:  # a path too long, a name the file system refuses, an I/O error
        raise refuse(f"cannot be used: {e.strerror}") from None
    return checkpoint


def _read_only_fs(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def write_run_dir(cfg: DictConfig, run_dir: Path, resuming: bool = False) -> Path:
    """Create the run dir with its frozen config.yaml (written whole, then renamed into place, so
    that nodes writing the same file at once never see half of it). If the disk refuses any of
    it, what this call made is removed and the error names --run-dir."""
    check_run_dir(run_dir, cfg, resuming)
    made = _nearest_existing(run_dir)
    tmp = run_dir / f".{CONFIG}.{os.getpid()}.tmp"
    copied = not (run_dir / RUN_TOKENIZER).exists()  # and so removed again on a failure
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        tmp.write_text(OmegaConf.to_yaml(with_anchored_paths(cfg)))
        tmp.rename(run_dir / CONFIG)
        tokenizer = data_tokenizer_dir(tokenizer_source(cfg.data))
        if tokenizer is not None:  # export and sample use the run's own copy
            copy_files(tokenizer, run_dir / RUN_TOKENIZER)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
            if copied:
                shutil.rmtree(run_dir / RUN_TOKENIZER, ignore_errors=True)
            _remove_made(run_dir, made)
        except OSError:
            pass  # the message below names the run dir; what could not be removed is in it
        raise ConfigError(f"--run-dir {run_dir} cannot be written: {e.strerror}") from None
    return run_dir


def _remove_made(run_dir: Path, existed: Path) -> None:
    """Remove the directories from run_dir up to (not including) `existed`, the nearest one that
    was there before; only empty ones, so nothing of anyone else's goes."""
    for path in (run_dir.absolute() / "logs", *[run_dir.absolute(), *run_dir.absolute().parents]):
        if path == existed or existed not in path.parents:
            break
        try:
            path.rmdir()
        except OSError:
            break

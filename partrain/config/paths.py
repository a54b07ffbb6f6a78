"""Paths: where the shipped configs/ and recipes/ are, in a wheel or in a source checkout; and
what stands at a path the user gave, in words, for the messages that refuse it."""

import errno
import os
import stat
from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # the partrain package


def _find(name: str) -> Path:
    # In a wheel they sit inside the package (pyproject's force-include); in a checkout or an
    # editable install they sit beside it, at the top of the repository.
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"partrain's {name}/ directory is missing from {_PKG}")


def configs_dir() -> Path:
    return _find("configs")


def recipes_dir() -> Path:
    return _find("recipes")


def known_recipes() -> list[str]:
    """The recipes by name: recipes/*.yaml."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def what_is(path: Path) -> str:
    """What stands at `path`, said after it in a message: "is a regular file", "is a directory",
    "does not exist", "is a symlink loop", "is a symbolic link to X, which does not exist", "is not
    a regular file (a pipe, socket or device)", or why it cannot be looked at. Path.exists() and
    is_file() say False for a loop, a dangling link and an unreadable parent alike, and a message
    built on them calls all three "does not exist"."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return "does not exist"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (a link that leads back to itself)"
        if e.errno == errno.ENOTDIR:
            return "does not exist (a part of it before the last is a file, not a directory)"
        return f"cannot be looked at ({e.strerror or e})"
    except ValueError:  # a NUL byte in the path
        return "is not a valid path (it holds a NUL character)"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISREG(mode):
        return "is a regular file"
    return "is not a regular file (a pipe, socket or device)"


# The keys that name a file or directory the run reads or writes (and data.blend's paths). A
# relative value is read from the directory the command was typed in, and checked and named as
# typed; the config.yaml a run dir freezes holds it made absolute, so that a resume, a sample or
# an export typed in another directory (a requeued job, another shell) finds the same files.
PATH_KEYS = ("data.path", "model.init_from", "parallel.offload_nvme_path",
             "parallel.deepspeed_config")


def anchored(value: str) -> str:
    """A path made absolute against the current directory (`..` folded, as the shell shows it);
    `hf:DIR` keeps its prefix. An absolute path comes back as it is."""
    from partrain.config.hf_families import HF_PREFIX

    prefix = HF_PREFIX if value.startswith(HF_PREFIX) else ""
    path = value[len(prefix):]
    return value if not path or os.path.isabs(path) else prefix + os.path.abspath(path)


def with_anchored_paths(cfg):
    """A copy of `cfg` (a DictConfig) whose path keys are absolute: what a run dir freezes."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    cfg = cfg.copy()
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str):
            OmegaConf.update(cfg, key, anchored(value))
    blend = OmegaConf.select(cfg, "data.blend", default=None)
    for entry in blend if isinstance(blend, ListConfig) else ():
        if isinstance(entry, DictConfig) and isinstance(entry.get("path"), str):
            entry.path = anchored(entry.path)
    return cfg

def relative_note(path) -> str:
    """Said after a path that was not found: where a relative one was looked for."""
    return "" if os.path.isabs(str(path)) else \
        f" (a relative path is read from the current directory, {os.getcwd()})"

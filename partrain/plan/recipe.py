"""`partrain plan --search --write-recipe PATH`: the winner as a recipe that `partrain launch PATH`
and `partrain slurm PATH` run as it is; PATH is checked before the search and again before the
write, and is whole or absent afterwards."""

from omegaconf import OmegaConf


def check_recipe_path(path) -> None:
    """--write-recipe PATH, before the search: a new file in a directory partrain may write."""
    import os
    from pathlib import Path

    from partrain.config.paths import what_is
    from partrain.errors import ConfigError

    path = Path(path)
    if path.name in ("", ".", ".."):
        raise ConfigError(f"--write-recipe {str(path)!r} must name a new file")
    found = what_is(path)
    if found == "is a regular file":
        raise ConfigError(f"--write-recipe {path} exists; give a new path")
    if not found.startswith("does not exist"):  # (or under a file: said of its directory below)
        raise ConfigError(f"--write-recipe {path} {found}; give a new path")
    parent = path.parent
    found = what_is(parent)
    if found != "is a directory":
        raise ConfigError(f"--write-recipe {path}: its directory {parent} {found}")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--write-recipe {path}: its directory {parent} is not writable"
                          + (" (a read-only file system)" if _read_only(parent) else ""))


def _read_only(directory) -> bool:
    import os

    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def write_recipe(path, result: dict, command: str) -> None:
    """The winner as a recipe `partrain launch PATH` and `partrain slurm PATH` run as it is: the
    whole composed config over the defaults, written under a temporary name beside PATH and
    renamed, so that PATH is whole or absent; a failed write leaves nothing behind."""
    import os
    from pathlib import Path

    from partrain.errors import ConfigError

    if not result["best"]:
        raise ConfigError(f"--write-recipe {path}: no layout fits, nothing to write")
    best = result["best"][0]
    body = OmegaConf.to_container(best.config)
    body = {"defaults": ["config", "_self_"], **body}
    header = (f"# Written by `{command}`: {best.describe()}; predicted "
              f"{best.time['tokens_per_s']:,.0f} tokens/s per job ({best.per_gpu():,.0f} per GPU), MFU {best.time['mfu']:.1%}, "
              f"{best.memory_bytes / 2**30:.1f} GiB per GPU.\n")
    path = Path(path)
    check_recipe_path(path)  # again: the search took a while
    # A short name: PATH's own may already be as long as a file name may be.
    tmp = path.with_name(f".{path.name[:64]}.{os.getpid()}.partial")
    try:
        tmp.write_text(header + OmegaConf.to_yaml(OmegaConf.create(body)))
        os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C included: no half-written file stays
        try:
            tmp.unlink(missing_ok=True)
            left = "nothing was left behind"
        except OSError:
            left = f"could not remove {tmp}"
        if not isinstance(e, OSError):
            raise
        raise ConfigError(f"--write-recipe {path} cannot be written: {e.strerror or e}; "
                          f"{left}") from None

"""Is a checkpoint whole? Every file DCP's .metadata names must be there with at least the bytes
the metadata says were written into it.

Checked on rank 0 before a save is committed (a rank whose files went elsewhere, such as a
node-local run dir that is not the other nodes' directory, fails the save instead of committing
a checkpoint that cannot be read), and by the launcher, `export` and `sample` before a checkpoint
is read (one message naming the file, exit 2, instead of a failure inside the ranks).
"""

import re
from pathlib import Path

from partrain.checkpoint import store
from partrain.errors import ConfigError

# DCP's FileSystemWriter names a rank's files __<rank>_<n>.distcp.
SHARD = re.compile(r"__(\d+)_\d+\.distcp")


def problems(path: Path) -> list[str]:
    """What keeps the checkpoint directory `path` from being read: [] when it is whole."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as e:  # unpickling garbage raises anything; a missing file an OSError
        return [f"its {store.DCP_METADATA} cannot be read ({type(e).__name__}: {e})"]
    found = []
    for name, size in sorted(needed.items()):
        match = SHARD.fullmatch(name)
        writer = f", written by rank {match.group(1)}" if match else ""
        try:
            have = (path / name).stat().st_size
        except OSError:
            found.append(f"{name} is missing{writer}")
            continue
        if have < size:
            found.append(f"{name} holds {have:,} of its {size:,} bytes{writer}")
    return found


def check_whole(checkpoint: store.Checkpoint, what: str) -> None:
    """Refuse (ConfigError naming `what` and the files) a committed checkpoint that cannot be
    read whole."""
    found = problems(checkpoint.path)
    if found:
        raise ConfigError(
            f"{what}: the checkpoint {checkpoint.path} (step {checkpoint.step}) is broken: "
            f"{'; '.join(found)}. Give an older one (RUN_DIR/{store.CHECKPOINTS}/step-N), or "
            "move this one away to resume from the one before it")

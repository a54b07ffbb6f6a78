"""The checkpoint directory protocol: what is committed, how a save becomes visible, what is kept.

    RUN_DIR/checkpoints/
        step-00000500/          committed: DCP's files, .metadata, meta.json, config.yaml
        .tmp-step-00000600/     being written (or left by a save that was killed)
        latest                  "step-00000500\\n", replaced atomically on every commit

Every rank writes its part under the temporary name; when all are done (DCP's save returns on
every rank only after the coordinator wrote .metadata), one rank writes meta.json and renames the
directory: the rename is the commit. A SIGKILL at any moment leaves either the old set of
committed checkpoints or the new one. `latest` follows the rename; a reader that finds it stale
(a kill between the two) takes the newest committed directory, which is always right. Older
checkpoints are deleted only after a newer one is committed, each renamed to a temporary name
first (`.tmp-pruned-step-N`): a kill mid-delete leaves a leftover, never half a checkpoint. A
save that fails (a full disk, any rank's error) is discarded by its ranks at once; one that was
killed leaves its temporary directory, which the next start removes. Pure file operations: no
process group, so the launcher and the unit tests use them directly.
"""

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from partrain.errors import ConfigError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
SAVED_CONFIG = "config.yaml"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"step-(\d{8,})")
TMP_PREFIX = ".tmp-"

log = logging.getLogger("partrain")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"{TMP_PREFIX}{step_dir_name(step)}"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory and what its meta.json says."""

    path: Path
    step: int
    meta: dict

    @property
    def reason(self) -> str:
        return self.meta.get("reason", "")


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


# meta.json's fields a start reads, and the kind each must be: one edited or damaged into
# another kind failed in every rank ("invalid literal for int() with base 10: 'zero'"), with the
# advice to resume from the same checkpoint again.
WHOLE_NUMBERS = ("world_size", "skipped_in_a_row", "bytes")
KINDS = {"loss_scaler": (dict, "an object"), "data": (list, "a list"),
         "files": (dict, "an object")}


def _meta_types(meta: dict) -> str | None:
    """Why a meta.json's fields cannot be read (a field of the wrong kind), or None."""
    for key in WHOLE_NUMBERS:
        value = meta.get(key)
        if key in meta and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"its {META} says {key}={value!r}, not a whole number"
    for key, (kind, named) in KINDS.items():
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            return f"its {META} says {key}={meta[key]!r}, not {named}"
    return None


def _step_dirs(root: Path) -> list[tuple[Path, int, dict | None, str | None]]:
    """Each `step-N` directory under `root`, by step: (path, step, its meta.json, why it does not
    count as committed: None when it does)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        match = STEP_DIR.fullmatch(entry.name)
        if not match or not entry.is_dir():
            continue
        step, meta = int(match.group(1)), _read_meta(entry)
        why = (f"it has no {DCP_METADATA}" if not (entry / DCP_METADATA).is_file() else
               f"its {META} is missing or not JSON" if meta is None else
               f"its {META} says step {meta.get('step')!r}" if meta.get("step") != step else
               _meta_types(meta))
        found.append((entry, step, meta, why))
    return sorted(found, key=lambda found: found[1])


def committed(root: Path) -> list[Checkpoint]:
    """The committed checkpoints under `root`, oldest first. A directory counts only with its
    step name, DCP's .metadata and partrain's meta.json (written before the commit's rename)."""
    return [Checkpoint(path, step, meta) for path, step, meta, why in _step_dirs(root)
            if why is None]


def not_committed(root: Path, after: int = -1) -> list[tuple[Path, str]]:
    """The `step-N` directories under `root` past step `after` that do not count as committed,
    each with why. A save is renamed to its step name only once whole, so one of these was
    damaged or copied in part since: a start takes the newest committed checkpoint before it,
    and says so."""
    return [(path, why) for path, step, _, why in _step_dirs(root)
            if why is not None and step > after]


def committed_at(path: Path) -> Checkpoint | None:
    """The committed checkpoint whose directory is `path`, if it is one."""
    found = [c for c in committed(path.parent) if c.path.name == path.name]
    return found[0] if found else None


def saves_at(ckpt_cfg, step: int, last: bool) -> bool:
    """Whether checkpoint.* saves at `step`: every `every` steps, and at the last one
    (`last`: train.max_steps) with save_last."""
    every = ckpt_cfg.every
    return bool((every and step % every == 0) or (last and ckpt_cfg.save_last))


def newest(root: Path) -> Checkpoint | None:
    found = committed(root)
    return found[-1] if found else None


def leftovers(root: Path) -> list[Path]:
    """What interrupted saves left behind: temporary directories and pointer files."""
    try:
        return sorted(e for e in root.iterdir() if e.name.startswith(TMP_PREFIX))
    except OSError:
        return []


def clean_leftovers(root: Path, delete=None) -> list[Path]:
    """Remove the leftovers of interrupted saves and deletions (one rank, before any rank
    writes); returns them. With `delete`, each directory is first renamed to a name of its own,
    which no save of this start writes to (a leftover `.tmp-step-N` would take in a new save of
    step N), and `delete(renamed)` removes them: in the background on rank 0 (a large checkpoint
    on a network file system takes minutes, while the other ranks wait for rank 0)."""
    removed, dirs = leftovers(root), []
    for path in removed:
        if not path.is_dir() or path.is_symlink():
            path.unlink(missing_ok=True)
            continue
        if delete is not None:
            name = path.name[len(TMP_PREFIX):]
            name = name.split("-", 2)[2] if name.startswith("gone-") else name
            gone = root / f"{TMP_PREFIX}gone-{uuid.uuid4().hex[:8]}-{name}"
            try:
                os.rename(path, gone)
                path = gone
            except OSError:
                pass  # removed where it is, then
        dirs.append(path)
    if dirs:
        (delete or remove_trees)(dirs)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written pointer behind
        raise


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def commit(root: Path, step: int, meta: dict, config_yaml: str) -> Checkpoint:
    """Make the temporary directory of `step` the committed checkpoint (every rank's part must be
    written already): meta.json and the config inside it, then the rename, then `latest`."""
    tmp = tmp_dir(root, step)
    final = root / step_dir_name(step)
    meta = {**meta, "step": step, "bytes": dir_bytes(tmp)}
    # Both on disk before the rename (a power cut after it must not leave either empty); meta.json
    # last, as it makes the directory count as committed.
    _write_atomically(tmp / SAVED_CONFIG, config_yaml)
    _write_atomically(tmp / META, json.dumps(meta, indent=2) + "\n")
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (a resume that ended where it began)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    try:
        _write_atomically(root / LATEST, final.name + "\n")
    except OSError as err:
        # Committed all the same: the rename was the commit, and a reader that finds `latest`
        # stale takes the newest committed directory. A disk this full fails the next save.
        log.warning("%s committed, but %s could not be updated (%s)", final, root / LATEST, err)
    return Checkpoint(final, step, meta)


def discard(root: Path, step: int) -> None:
    """Remove what a failed save of `step` wrote, at once: on a full disk its space is what the
    ranks need to record their errors. Every rank of the failed save may call it together."""
    shutil.rmtree(tmp_dir(root, step), ignore_errors=True)


def prune(root: Path, keep: int, delete=None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints (called after a commit); returns
    their paths. Each is first renamed out of the committed set under the temporary prefix (a
    rename is atomic: a kill while a directory of many files is deleted never leaves part of a
    checkpoint that still looks committed, and the next start removes what is left). Then
    `delete(renamed paths)` deletes them; by default here and now. The checkpointer deletes in a
    background thread: on a network file system removing a large checkpoint can take minutes,
    and the other ranks would wait for rank 0 in their next step meanwhile."""
    old = committed(root)[:-keep] if keep > 0 else []
    pruned, renamed = [], []
    for checkpoint in old:
        gone = root / f"{TMP_PREFIX}pruned-{checkpoint.path.name}"
        try:
            os.rename(checkpoint.path, gone)
        except OSError as err:
            log.warning("%s could not be removed (kept beyond checkpoint.keep): %s",
                        checkpoint.path, err)
            continue
        pruned.append(checkpoint.path)
        renamed.append(gone)
    if renamed:
        _fsync_dir(root)
        (delete or remove_trees)(renamed)
    return pruned


def remove_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def find(path: Path, what: str) -> Checkpoint:
    """A committed checkpoint named by the user: its directory, a run dir (its newest), or a run
    dir's checkpoints/ (its newest). Raises ConfigError naming `what` (the key or flag)."""
    if path.name == LATEST and path.is_file():  # checkpoints/latest names the newest
        path = path.parent
    candidates = [path] if STEP_DIR.fullmatch(path.name) else []
    for root in (path / CHECKPOINTS, path):
        if root.is_dir() and not candidates:
            found = newest(root)
            if found:
                return found
    for candidate in candidates:
        found = committed_at(candidate)
        if found:
            return found
    if not path.exists():
        raise ConfigError(f"{what}={path} does not exist; give a checkpoint directory "
                          "(RUN_DIR/checkpoints/step-N) or a run dir that holds one")
    raise ConfigError(f"{what}={path} holds no committed checkpoint (a step-N directory with "
                      "DCP's .metadata and partrain's meta.json); give RUN_DIR/checkpoints/step-N "
                      "or a run dir that holds one")

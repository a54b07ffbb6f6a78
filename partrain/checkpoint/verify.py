"""Is a checkpoint whole? Every file DCP's .metadata names must be there with at least the bytes
the metadata says were written into it, and hold the bytes that were written (their crc32).

Checked on rank 0 before a save is committed (a rank whose files went elsewhere, such as a
node-local run dir that is not the other nodes' directory, fails the save instead of committing
a checkpoint that cannot be read), and by the launcher, `export` and `sample` before a checkpoint
is read (one message naming the file, exit 2, instead of a failure inside the ranks).

Sizes and .metadata do not see a bit flipped on a disk or in a copy: DCP keeps no checksums. So a
rank's writer takes the crc32 of each file as its bytes go out and keeps them beside it
(`__R.crc32.json`, `write_sums`), the commit folds them and the .metadata's into meta.json's
`files` (`take_sums`, which refuses a save with a file left out), and a start checks
them before it reads a tensor (`damaged`): the ranks, each its share of the files, so that the
checkpoint is read once however many nodes start (train/assemble.py), and `export` and `sample`
in full. A checkpoint saved before partrain kept them has no `files` and is not checked.
"""

import json
import re
import time
import zlib
from pathlib import Path

from partrain.checkpoint import store
from partrain.errors import ConfigError, reason

# DCP's FileSystemWriter names a rank's files __<rank>_<n>.distcp.
SHARD = re.compile(r"__(\d+)_(\d+)\.distcp")
# A rank's crc32 of the files it wrote, beside them until the commit (RUN_DIR's .tmp-step-N).
SUMS = "__{rank}.crc32.json"
# How often rank 0 looks for a rank's crc32 file at the commit, 0.2 s apart.
SUMS_LOOKS = 10
# Read in pieces: a rank's file is gigabytes; crc32 reads about 6 GB/s on one core.
CHUNK = 16 << 20


class NotWhole(Exception):
    """A save whose files are not all there, or not all summed: not committed (rank 0)."""


class DamagedCheckpoint(Exception):
    """A checkpoint's file does not hold the bytes that were written into it; raised on every
    rank at once, before any is read (the launcher: exit 2, a broken input)."""


def crc32_of(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_sums(directory: Path, sums: dict[str, str]) -> None:
    """Keep the crc32 of each file a rank wrote (by name) beside them, one file per rank."""
    ranks: dict[str, dict[str, str]] = {}
    for name, crc in sums.items():
        match = SHARD.fullmatch(name)
        if match:
            ranks.setdefault(match.group(1), {})[name] = crc
    for rank, mine in ranks.items():
        (directory / SUMS.format(rank=rank)).write_text(json.dumps(mine, sort_keys=True))


def file_order(name: str) -> tuple:
    """.metadata first, then the ranks' files by rank and number (__10_0 after __2_0)."""
    match = SHARD.fullmatch(name)
    return (1, int(match.group(1)), int(match.group(2))) if match else (0, 0, 0)


def _writer(name: str) -> str:
    match = SHARD.fullmatch(name)
    return f", written by rank {match.group(1)}" if match else ""


def files_of(metadata) -> set[str]:
    """The files DCP's `metadata` names (its tensors' places)."""
    return {info.relative_path for info in metadata.storage_data.values()}


def _listed_files(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return files_of(FileSystemReader(str(path)).read_metadata())


def take_sums(directory: Path, listed: set[str]) -> dict[str, str]:
    """Every rank's crc32s in the save `directory`, with the .metadata's own, in one mapping for
    meta.json; their files are removed (rank 0, before the commit). `listed`: the files DCP's
    .metadata names. Each rank's is opened by name (a directory listing on a network file system
    may not show another node's new file yet), looked for again for a moment. Raises NotWhole
    naming what is missing or unreadable: a checkpoint whose files are not all summed is not
    committed (a file left out would never be checked)."""
    sums: dict[str, str] = {}
    sidecars = sorted({directory / SUMS.format(rank=SHARD.fullmatch(name).group(1))
                       for name in listed if SHARD.fullmatch(name)})
    for path in sidecars:
        for attempt in range(SUMS_LOOKS):
            try:
                mine = json.loads(path.read_text())
                break
            except FileNotFoundError:
                if attempt == SUMS_LOOKS - 1:
                    mine = {}  # its files are named below
                    break
                time.sleep(0.2)
            except (OSError, ValueError) as e:
                raise NotWhole(f"{path.name} cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(mine, dict) or not all(
                SHARD.fullmatch(str(k)) and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v)
                for k, v in mine.items()):
            raise NotWhole(f"{path.name} does not hold a crc32 per file of the rank")
        sums.update(mine)
    unsummed = sorted(listed - sums.keys(), key=file_order)
    if unsummed:
        raise NotWhole(f"no crc32 was kept of {listed_briefly(unsummed, ', ')}: the rank that "
                       f"wrote it left no {SUMS.format(rank='R')} in {directory}")
    sums[store.DCP_METADATA] = crc32_of(directory / store.DCP_METADATA)
    for path in sidecars:
        path.unlink(missing_ok=True)
    return dict(sorted(sums.items(), key=lambda item: file_order(item[0])))


def damaged(checkpoint: store.Checkpoint, rank: int = 0, ranks: int = 1) -> list[str]:
    """The files of `checkpoint` that do not read back as written (their crc32 in meta.json's
    `files`), of one reader's share: every `ranks`-th file from the `rank`-th, in order. The
    first reader also names the files .metadata lists that have none (a meta.json edited)."""
    sums = checkpoint.meta.get("files") or {}
    names = sorted(sums, key=file_order)
    found = []
    for name in names[rank::ranks]:
        want = sums[name]
        if not (SHARD.fullmatch(name) or name == store.DCP_METADATA) or \
                not isinstance(want, str):  # meta.json edited: not DCP's, not a crc32
            found.append(f"its {store.META} lists {json.dumps(name)}: {json.dumps(want)}, not "
                         "a file's crc32")
            continue
        try:
            have = crc32_of(checkpoint.path / name)
        except OSError as e:
            found.append(f"{name} cannot be read ({reason(e)}){_writer(name)}")
            continue
        if have != want.lower():
            found.append(f"{name} does not hold the bytes written into it (crc32 {have}, "
                         f"{want} when saved){_writer(name)}")
    if sums and rank == 0 and not found:
        try:
            listed = _listed_files(checkpoint.path)
        except Exception:  # noqa: BLE001 (unpickling garbage raises anything): DCP says so
            listed = set()
        found += [f"{name} has no crc32 in its {store.META}{_writer(name)}"
                  for name in sorted(listed - sums.keys(), key=file_order)]
    return found


def listed_briefly(found: list[str], sep: str = "; ", most: int = 3) -> str:
    """The first `most` of `found`, and how many more."""
    more = f" (and {len(found) - most} more)" if len(found) > most else ""
    return sep.join(found[:most]) + more


def move_it_aside(checkpoint: store.Checkpoint, what: str) -> str:
    """What to do about a broken `checkpoint` that `what` (a flag or key) names."""
    folder = checkpoint.path.parent
    if what in ("--resume", "--run-dir"):  # these take a run dir, and read its newest
        if any(c.step < checkpoint.step for c in store.committed(folder)):
            return (f"Move it out of {folder} (a run dir resumes from its newest checkpoint) and "
                    "run the same command again to go on from the one before it")
        run_dir = folder.parent
        return (f"Move it out of {folder}: no checkpoint is before it, so the run starts again "
                f"from step 1 with partrain launch {run_dir / 'config.yaml'} --run-dir {run_dir}")
    return (f"Give an older one ({folder}/step-N), or move this one out of {folder} and give "
            "the run dir: its newest checkpoint left is read")


def broken(checkpoint: store.Checkpoint, what: str, found: list[str]) -> str:
    return (f"{what}: the checkpoint {checkpoint.path} (step {checkpoint.step}) is broken: "
            f"{listed_briefly(found)}. {move_it_aside(checkpoint, what)}")


def problems(path: Path) -> list[str]:
    """What keeps the checkpoint directory `path` from being read: [] when it is whole."""
    return read_whole(path)[0]


def read_whole(path: Path):
    """(problems, DCP's metadata: None when it cannot be read) of the directory `path`."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as e:  # unpickling garbage raises anything; a missing file an OSError
        return [f"its {store.DCP_METADATA} cannot be read ({type(e).__name__}: {e})"], None
    found = []
    for name, size in sorted(needed.items()):
        try:
            have = (path / name).stat().st_size
        except OSError:
            found.append(f"{name} is missing{_writer(name)}")
            continue
        if have < size:
            found.append(f"{name} holds {have:,} of its {size:,} bytes{_writer(name)}")
    return found, metadata


def shape_problems(metadata, model_cfg) -> list[str]:
    """Where the weights DCP's `metadata` lists are not the shapes of the model `model_cfg`
    describes (built on the meta device: no memory, no initialisation)."""
    import torch

    from partrain.models.llama import Transformer

    saved = {key[len("model."):]: tuple(info.size)
             for key, info in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(info, "size")}
    with torch.device("meta"):
        if model_cfg.get("target"):  # a user's model: its builder says its shapes
            from partrain.models.family import load_builder

            model = load_builder(model_cfg.target)(model_cfg)
        else:
            model = Transformer(model_cfg)
    from partrain.checkpoint.state import checkpointed_buffers

    wanted = {name: tuple(p.shape) for name, p in model.named_parameters()}
    buffers = {name: tuple(b.shape) for name, b in checkpointed_buffers(model).items()}
    wanted.update(buffers)
    found = [f"{name} is {list(saved[name])} there and {list(shape)} in the model"
             for name, shape in wanted.items() if name in saved and saved[name] != shape]
    # A checkpoint saved before partrain kept a user's buffers lacks them: the model's own
    # values stand in (partrain.checkpoint.state.load_weights says so). partrain's own models
    # have always saved theirs (a MoE's expert_bias): one missing is a broken checkpoint.
    optional = buffers if model_cfg.get("target") else {}
    found += [f"it has no {name}" for name in wanted if name not in saved and name not in optional]
    found += [f"it has {name}, which the model has not" for name in saved if name not in wanted]
    return found


def check_whole(checkpoint: store.Checkpoint, what: str, read_all: bool = False) -> None:
    """Refuse (ConfigError naming `what` and the files) a committed checkpoint that cannot be
    read whole, or whose weights are not the model its config.yaml describes (an edited or
    swapped config.yaml would otherwise fail inside the ranks). `read_all`: its files' crc32s
    too (one process reading the whole checkpoint: `export`, `sample`; a launch leaves that to
    its ranks)."""
    found, metadata = read_whole(checkpoint.path)  # .metadata read once, for both checks
    if not found and read_all:
        found = damaged(checkpoint)
    if found:
        raise ConfigError(broken(checkpoint, what, found))
    from omegaconf import OmegaConf

    from partrain.checkpoint.resume import saved_config

    model_cfg = OmegaConf.create(saved_config(checkpoint)["model"])
    found = shape_problems(metadata, model_cfg)
    if found:
        raise ConfigError(
            f"{what}: the checkpoint {checkpoint.path} (step {checkpoint.step}) does not hold "
            f"the model its {store.SAVED_CONFIG} describes: {listed_briefly(found)}. Its "
            f"model.* keys must be the ones it was trained with (was {store.SAVED_CONFIG} "
            "edited or copied from another run?)")

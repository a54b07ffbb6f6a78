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
    return _read_whole(path)[0]


def _read_whole(path: Path):
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
        match = SHARD.fullmatch(name)
        writer = f", written by rank {match.group(1)}" if match else ""
        try:
            have = (path / name).stat().st_size
        except OSError:
            found.append(f"{name} is missing{writer}")
            continue
        if have < size:
            found.append(f"{name} holds {have:,} of its {size:,} bytes{writer}")
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


def check_whole(checkpoint: store.Checkpoint, what: str) -> None:
    """Refuse (ConfigError naming `what` and the files) a committed checkpoint that cannot be
    read whole, or whose weights are not the model its config.yaml describes (an edited or
    swapped config.yaml would otherwise fail inside the ranks)."""
    found, metadata = _read_whole(checkpoint.path)  # .metadata read once, for both checks
    if found:
        folder = checkpoint.path.parent
        if what in ("--resume", "--run-dir"):  # these take a run dir, and read its newest
            instead = (f"Move it out of {folder} (a run dir resumes from its newest checkpoint) "
                       "and run the same command again to go on from the one before it")
        else:
            instead = (f"Give an older one ({folder}/step-N), or move this one out of {folder} "
                       "and give the run dir: its newest checkpoint left is read")
        raise ConfigError(
            f"{what}: the checkpoint {checkpoint.path} (step {checkpoint.step}) is broken: "
            f"{'; '.join(found)}. {instead}")
    from omegaconf import OmegaConf

    from partrain.checkpoint.resume import saved_config

    model_cfg = OmegaConf.create(saved_config(checkpoint)["model"])
    found = shape_problems(metadata, model_cfg)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise ConfigError(
            f"{what}: the checkpoint {checkpoint.path} (step {checkpoint.step}) does not hold "
            f"the model its {store.SAVED_CONFIG} describes: {'; '.join(found[:3])}{more}. Its "
            f"model.* keys must be the ones it was trained with (was {store.SAVED_CONFIG} "
            "edited or copied from another run?)")

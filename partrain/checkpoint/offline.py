"""A committed checkpoint's model on one process, with no process group: what `export` and
`sample` read."""

from pathlib import Path
from typing import Callable, TypeVar

import torch
from omegaconf import OmegaConf

from partrain.checkpoint.state import load_weights
from partrain.errors import ConfigError

T = TypeVar("T")

# Looks for the newest checkpoint again after a running launch pruned the one being read.
READ_TRIES = 3


def read_checkpoint(source: Path, what: str, read: Callable[..., T]) -> T:
    """`read(checkpoint)` of the committed checkpoint `source` names (a run dir: its newest).
    A launch still training in the run dir prunes its old checkpoints (checkpoint.keep): the
    one found may be renamed away while it is read, which failed with a missing .metadata or
    the advice to move a damaged checkpoint aside. A run dir's newest is then looked for again;
    a checkpoint named by its own directory is said to be gone."""
    from partrain.checkpoint.store import find

    for _ in range(READ_TRIES):
        checkpoint = find(source, what)
        try:
            return read(checkpoint)
        except (ConfigError, OSError, RuntimeError):
            if checkpoint.path.is_dir():
                raise
        if checkpoint.path.resolve() == Path(source).resolve():
            raise ConfigError(
                f"{what}={source} was removed while it was read: a launch training in its run "
                "dir prunes the older checkpoints (checkpoint.keep); give a newer one, or the run "
                "dir (its newest)")
    raise ConfigError(f"{what}={source}: its newest checkpoint was removed while it was read, "
                      f"{READ_TRIES} times: a launch training there prunes them quickly "
                      "(checkpoint.every, checkpoint.keep); give a checkpoint it keeps, or wait for "
                      "it to end")


@torch.no_grad()
def checkpoint_model(checkpoint, device: str = "cpu"):
    """The single-process model of a committed checkpoint with its weights, and the config it
    was saved with: what `export` and `sample` read, on one process with no process group. The
    model is built empty (no initialisation to throw away) and filled by DCP."""
    import warnings

    from partrain.checkpoint.resume import saved_config
    from partrain.models.family import builds_offline
    from partrain.models.llama import Transformer

    cfg = OmegaConf.create(saved_config(checkpoint))
    if not builds_offline(cfg.model):
        from partrain.errors import ConfigError

        whose = (f"your own model (model.target={cfg.model.target})" if cfg.model.get("target")
                 else f"a model of the family {cfg.model.family}")
        raise ConfigError(
            f"{checkpoint.path} holds {whose}: sample and export build the built-in llama "
            "family; load its DCP checkpoint in your code (torch.distributed.checkpoint, keys "
            "model.<parameter name>) or resume it with partrain launch --resume")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_rope(device)
    with warnings.catch_warnings():  # DCP's note that it loads in a single process: it does
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            load_weights(model, checkpoint.path, None)
        except RuntimeError as err:  # damaged files of the right size (the checks passed)
            from partrain.errors import ConfigError

            raise ConfigError(
                f"{checkpoint.path} could not be read: its files are damaged ({err}); give an "
                f"older checkpoint ({checkpoint.path.parent}/step-N)") from None
    return model.eval(), cfg

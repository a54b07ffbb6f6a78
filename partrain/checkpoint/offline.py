"""A committed checkpoint's model on one process, with no process group: what `export` and
`sample` read."""

import torch
from omegaconf import OmegaConf

from partrain.checkpoint.state import load_weights


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

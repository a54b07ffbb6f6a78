"""Keys of a DeepSpeed config that DeepSpeed would ignore or fail on later, found before the start.

DeepSpeed's config models check the keys inside their sections (check_raw_deepspeed in
validate.py), but not the top level: `gradient_accumulation_step` (for ..._steps) or
`train_micro_batch_size_per_gpus` in a user's file were passed on and never read, and the run
trained with another batch than the file said, exit 0. And the optimizer's `params` go to the
optimizer's constructor as keyword arguments: one that partrain's torch optimizer does not take
(`bias_correction`, DeepSpeed's own Adam's) failed inside every rank.

A top-level key is known when DeepSpeed's source names it anywhere (a string literal of the
installed package): a superset of what it reads, which a misspelling is not in.
"""

import difflib
import functools
import importlib.util
import inspect
import re
from pathlib import Path

from partrain.errors import ConfigError

_WORD = re.compile(r"""["']([a-z][a-z0-9_]{1,60})["']""")
# What DeepSpeed's engine takes out of optimizer.params before it builds the optimizer
# (runtime/engine.py, _configure_basic_optimizer and get_optimizer_configuration).
DS_OPTIMIZER_KEYS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach"}


@functools.lru_cache(maxsize=1)
def deepspeed_words() -> frozenset[str]:
    """Every identifier-like string literal in the installed DeepSpeed's Python source."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return frozenset()
    words = set()
    for path in Path(spec.origin).parent.rglob("*.py"):
        try:
            words.update(_WORD.findall(path.read_text(errors="replace")))
        except OSError:
            continue
    return frozenset(words)


def check_top_level(config: dict) -> None:
    """Every top-level key is one DeepSpeed knows."""
    words = deepspeed_words()
    if not words:
        return
    unknown = sorted(key for key in config if key not in words)
    if unknown:
        said = []
        for key in unknown:
            close = difflib.get_close_matches(key, words, n=1, cutoff=0.8)
            said.append(f"{key}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError(f"parallel.deepspeed: DeepSpeed has no key {', '.join(said)}: it would "
                          "ignore it and train without it")


def check_optimizer_params(config: dict) -> None:
    """optimizer.params are keyword arguments of the torch optimizer DeepSpeed builds (torch's
    Adam or AdamW with torch_adam, SGD): each one it takes. (DeepSpeed's CPU Adam under
    offload takes its own; not checked.)"""
    import torch

    optimizer = config.get("optimizer") or {}
    params = optimizer.get("params") or {}
    kind = str(optimizer.get("type", "")).lower()
    if kind == "sgd":
        cls = torch.optim.SGD
    elif kind in ("adam", "adamw") and params.get("torch_adam"):
        w_mode = kind == "adamw" or params.get("adam_w_mode", True)
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
    else:
        return
    takes = set(inspect.signature(cls).parameters) - {"params"} | DS_OPTIMIZER_KEYS
    unknown = sorted(set(params) - takes)
    if unknown:
        raise ConfigError(
            f"parallel.deepspeed.optimizer.params: {', '.join(unknown)} "
            f"{'is' if len(unknown) == 1 else 'are'} not a keyword of {cls.__module__}."
            f"{cls.__name__}, the optimizer DeepSpeed builds here (it takes "
            f"{', '.join(sorted(takes - DS_OPTIMIZER_KEYS))}); drop "
            f"{'it' if len(unknown) == 1 else 'them'}")

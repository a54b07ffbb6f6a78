"""Helpers for the unit tests: compose and validate configs in-process, run the CLI."""

import copy
import functools
import subprocess
import sys
from dataclasses import dataclass

import yaml
from omegaconf import OmegaConf

from partrain.config.compose import compose_config
from partrain.config.resolve import resolve_world
from partrain.config.validate import resolve_and_validate


def compose(*overrides: str, config: str | None = None):
    """The composed (not yet validated) config: the quickstart recipe unless `config` is given."""
    return compose_config(config, list(overrides))


def resolved(*overrides: str, config: str | None = None, nnodes: int | None = None,
             nproc: int | None = None, cuda_devices: int = 0):
    """(cfg, world, warnings) after resolve_world and resolve_and_validate, as the CLI does it."""
    cfg = compose_config(config, list(overrides))
    world = resolve_world(cfg, nnodes, nproc, cuda_devices)
    warnings = resolve_and_validate(cfg, world)
    return cfg, world, warnings


@functools.lru_cache(maxsize=None)
def _composed_once(config: str | None):
    return compose_config(config, [])


def quick(*overrides: str, config: str | None = None):
    """Like compose(), for `key=value` overrides only, without a Hydra compose per call: the
    recipe is composed once and the overrides merged into a copy of its typed config (which still
    rejects unknown keys and wrong types). `+key=value` adds a key, as in Hydra's grammar. The
    validation tests use it to stay fast."""
    cfg = copy.deepcopy(_composed_once(config))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in overrides if o[0] != "+"]))
    for added in (o[1:] for o in overrides if o[0] == "+"):
        key, value = added.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def validated(*overrides: str, config: str | None = None, nnodes: int | None = None,
              nproc: int | None = None, cuda_devices: int = 0):
    """resolved() on a quick() config."""
    cfg = quick(*overrides, config=config)
    world = resolve_world(cfg, nnodes, nproc, cuda_devices)
    warnings = resolve_and_validate(cfg, world)
    return cfg, world, warnings


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def start_cli(*args: str, cwd=None) -> subprocess.Popen:
    """`python -m partrain ARGS...` in a subprocess (started, not waited for)."""
    return subprocess.Popen([sys.executable, "-m", "partrain", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> CliResult:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return CliResult(proc.returncode, out, err)


def word_tokenizer(words: int, eot: bool = True, prefix: str = "w") -> str:
    """A small tokenizer.json the tokenizers library reads: `words` words (prefix0, prefix1, ...),
    and <|endoftext|> after them when `eot`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"{prefix}{i}": i for i in range(words)}
    if eot:
        vocab["<|endoftext|>"] = words
    tok = Tokenizer(models.WordLevel(vocab, unk_token=f"{prefix}0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def one_line(text: str) -> str:
    """Rich wraps stdout at the terminal width; compare messages with whitespace collapsed."""
    return " ".join(text.split())


def save_checkpoint(model, cfg, run_dir, step: int = 1) -> None:
    """Commit `model` (with a fresh AdamW's state) as run_dir's checkpoint of `step`, saved by
    DCP on one process as a run saves it, with `cfg` as its config."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from partrain.checkpoint import store
    from partrain.checkpoint.state import build_state

    root = run_dir / store.CHECKPOINTS
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(build_state(model, torch.optim.AdamW(model.parameters()), None, zero=False),
                 checkpoint_id=store.tmp_dir(root, step))
    store.commit(root, step, {"reason": "test"}, OmegaConf.to_yaml(cfg))


def assert_rule(bad, bad_world, fragments, good, good_world):
    """A row of a rules table: `bad` (on its world: nnodes, nproc_per_node; None keeps the
    config's) is one ConfigError of one line holding every fragment; `good` validates."""
    from partrain.errors import ConfigError

    try:
        validated(*bad, nnodes=bad_world[0], nproc=bad_world[1])
    except ConfigError as e:
        message = str(e)
    else:
        raise AssertionError(f"{bad} on {bad_world} was not refused")
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message  # one line: key, value, rule
    cfg, world, _ = validated(*good, nnodes=good_world[0], nproc=good_world[1])
    p, t = cfg.parallel, cfg.train
    assert p.pp * p.dp * p.cp * p.tp == world.size
    assert t.global_batch_size == t.micro_batch_size * t.micro_batches * p.dp

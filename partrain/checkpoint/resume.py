"""What may change between a checkpoint and the run that continues from it, checked in the
launcher before anything starts.

A resume continues the same training: the model, the data, the seed, the global batch, the
sequence length, the dtype and the optimizer (optim.name: its state is that optimizer's) must be
those the checkpoint was saved with.
The layout may change (parallel.*, launcher.*, the node count, the micro-batch split at the same
global batch, activation checkpointing, compile), as may how the run logs, evaluates and saves,
train.max_steps, up or down to no less than the checkpoint's step (the learning-rate schedule
is then the one of a run planned for the new max_steps: warmup is unchanged, the decay is fitted
to the new end or, under wsd, moves to it) and the
optimizer's schedule and hyperparameters (a lower optim.lr after a loss spike; optim.schedule=wsd
from a cosine run's checkpoint).

The data may move: data.path (or a data.blend path) may name another place on a resume when it
holds the same tokens, as the fingerprints in the checkpoint's meta.json say (check_same_data);
other tokens are refused at a new place and at the old one.

Another optimizer is refused rather than started with fresh state: the moments (or SGD's
momentum) are half of what a resume continues, and dropping them quietly makes a "resume" that is
not one. Megatron-LM (--no-load-optim) and torchtitan (checkpoint.exclude_from_loading) make
dropping them something the user asks for; here that is `model.init_from`: the weights, a fresh
optimizer of any kind. `check_resumable` returns what changed, which the launcher prints.
"""

import os
from pathlib import Path

from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.config.keys import shown
from partrain.errors import ConfigError

# Keys (or key prefixes ending in '.') a resume may change: the layout, how the run logs,
# evaluates and saves, and the optimizer's schedule and hyperparameters (after a loss spike,
# Megatron-LM's --override-opt_param-scheduler: the state, Adam's moments or SGD's momentum, keeps
# its shapes and meaning). The model, the data, the seed, the batch, the dtype and the optimizer
# itself (optim.name) stay.
RESUMABLE = ("name", "parallel.", "launcher.", "checkpoint.", "train.micro_batch_size",
             "train.micro_batches", "train.max_steps", "train.eval_every", "train.eval_batches",
             "train.log_every", "train.max_skipped_steps", "train.trace", "train.profile_start",
             "train.profile_steps", "train.tensorboard", "train.wandb",
             "train.wandb_project", "train.activation_checkpointing", "train.compile",
             "train.measure_memory", "optim.lr", "optim.warmup_steps",
             "optim.min_lr_ratio", "optim.grad_clip", "optim.weight_decay", "optim.beta1",
             "optim.beta2", "optim.eps", "optim.schedule", "optim.decay_ratio", "optim.momentum",
             "optim.nesterov")
# Model keys that do not change the weights' shapes (init_from may point anywhere).
NOT_SHAPE = ("model.name", "model.init_from", "model.init_std")


def flat_keys(tree, prefix: str = "") -> dict:
    """A config tree as {dotted key: value} (parallel.deepspeed's free keys kept as one value)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and not f"{prefix}{key}".startswith("parallel.deepspeed"):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resumable(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE)


def saved_config(checkpoint: store.Checkpoint) -> dict:
    """The config a checkpoint was saved with, typed against today's schema like a run dir's
    frozen config: keys added to partrain since take their defaults, which are the behaviour the
    checkpoint was trained with."""
    from partrain.config.frozen import load_frozen_config

    try:
        frozen = load_frozen_config(str(checkpoint.path / store.SAVED_CONFIG), [])
    except ConfigError as e:
        folder = checkpoint.path.parent
        raise ConfigError(
            f"the checkpoint {checkpoint.path} (step {checkpoint.step}) cannot be used: {e} "
            f"(the config it was saved with). Move it out of {folder} to go on from the one "
            f"before it (a run dir's newest checkpoint is read), or give an older one "
            f"({folder}/step-N)") from None
    return OmegaConf.to_container(frozen, resolve=True)


def check_resumable(checkpoint: store.Checkpoint, cfg, from_file: Path | None = None,
                    given: frozenset = frozenset()) -> list[str]:
    """Refuse (ConfigError, naming the key) a config that changes what the checkpoint trained;
    return what it changes that a resume may ("optim.lr 0.003 -> 0.0001"), for the launcher to
    say. `from_file`: the run dir's config.yaml a --resume read, where a value no override
    (`given`, the keys typed) set comes from: an edit of that file is named as one."""
    from partrain.config.paths import with_anchored_paths

    # Paths compare as absolute: a checkpoint saved before they were frozen so holds them as typed.
    typed = saved_config(checkpoint)
    saved_tree = OmegaConf.to_container(with_anchored_paths(OmegaConf.create(typed)))
    new_tree = OmegaConf.to_container(with_anchored_paths(cfg), resolve=True)
    saved, new = flat_keys(saved_tree), flat_keys(new_tree)
    moved = _moved(saved_tree["data"], new_tree["data"])
    changed = []
    for key in sorted(saved.keys() | new.keys()):
        if saved.get(key) == new.get(key) or (moved and key in ("data.path", "data.blend")):
            continue
        if _resumable(key):
            changed.append(f"{key} {shown(saved.get(key))} -> {shown(new.get(key))}")
            continue
        if key == "model.init_from":  # it would be written down, and never read
            raise ConfigError(
                f"model.init_from={shown(new.get(key))} differs from {shown(saved.get(key))} in "
                f"the checkpoint at step {checkpoint.step} ({checkpoint.path}): a resume takes "
                "its weights from that checkpoint, and model.init_from is read only at a run's "
                "first start. To start from those weights, launch a new run (a new --run-dir, "
                "no --resume) with it")
        # Not typed, and no typed key that a resume keeps differs (which could bring it along):
        # the value is the file's.
        typed = any(k in given and not _resumable(k) and saved.get(k) != new.get(k)
                    for k in saved.keys() | new.keys())
        edited = (f" (in {from_file}, not an override: was it edited?)"
                  if from_file is not None and not typed else "")
        raise ConfigError(
            f"{key}={shown(new.get(key))}{edited} differs from {shown(saved.get(key))} in the checkpoint "
            f"at step {checkpoint.step} ({checkpoint.path}): it changes the math of the run, so a "
            "resume keeps it; a resume may change the layout (parallel.*, launcher.*, nodes, the "
            "micro-batch split, activation checkpointing, compile), train.max_steps, the "
            "optimizer's schedule and hyperparameters (optim.* but optim.name), logging, "
            "evaluation and checkpoint.*. To start "
            f"a new run from these weights: model.init_from={checkpoint.path} in a new run dir")
    changed += check_same_data(checkpoint, saved_tree["data"], new_tree["data"], moved,
                               typed["data"])
    if cfg.train.max_steps < checkpoint.step:
        raise ConfigError(
            f"train.max_steps={cfg.train.max_steps} is below the checkpoint's step "
            f"{checkpoint.step} ({checkpoint.path}); a resume continues from there (raise "
            "train.max_steps, or start a new run with model.init_from)")
    return changed


def _moved_places(data: dict) -> list[tuple[str, str | None]]:
    """(key, path) of each token dir a data section names: data.path, data.blend[k].path."""
    return [("data.path", data.get("path"))] + [
        (f"data.blend[{k}].path", entry.get("path"))
        for k, entry in enumerate(data.get("blend") or [])]


def _moved(saved: dict, new: dict) -> list[tuple[str, str, str]]:
    """Where the data section differs only in its token dirs' places: (key, old, new) for each
    path that changed (data.path, data.blend[k].path); [] where nothing moved or more changed."""
    def rest(data):
        return {**data, "path": None,
                "blend": [{**e, "path": None} for e in data["blend"]] if data.get("blend") else
                data.get("blend")}

    if saved == new or rest(saved) != rest(new):
        return []
    return [(key, old, now)
            for (key, old), (_, now) in zip(_moved_places(saved), _moved_places(new))
            if old != now]


def check_same_data(checkpoint: store.Checkpoint, saved: dict, new: dict,
                    moved: list[tuple[str, str, str]], typed: dict | None = None) -> list[str]:
    """A resume reads the tokens the checkpoint trained on: the fingerprints its meta.json
    recorded (sampler.data_fingerprints) against the data the resume names, at the same place
    (a token dir prepared again in place is other data) or at a new one (`moved`: the same
    tokens copied elsewhere may be read from there). A checkpoint saved before partrain recorded
    them is compared through its old dirs where they still are. Returns what moved, for the
    launcher to say."""
    from partrain.data.sampler import data_fingerprints

    recorded = checkpoint.meta.get("data")
    recorded = recorded if isinstance(recorded, list) else None
    if recorded is None and not moved:
        return []  # saved before the record, read from where it was: nothing to compare with
    keys = ", ".join(key for key, _, _ in moved)
    start_new = ("to train on other data from these weights, start a new run: "
                 f"model.init_from={checkpoint.path}")
    if recorded is None:
        try:
            recorded = data_fingerprints(OmegaConf.create(saved))
        except OSError:
            olds = ", ".join(old for _, old, _ in moved)
            relative = [path for _, path in _moved_places(typed or {})
                        if path and not os.path.isabs(path)]
            if relative:  # as the run was launched: from another directory than this one
                raise ConfigError(
                    f"{keys} differs from the checkpoint at step {checkpoint.step} "
                    f"({checkpoint.path}), which was saved before partrain recorded what its "
                    f"data holds, with {', '.join(relative)} as typed: relative to the "
                    "directory the run was launched in, not this one. Resume from that "
                    f"directory without {keys}; or {start_new}") from None
            raise ConfigError(
                f"{keys} differs from the checkpoint at step {checkpoint.step} "
                f"({checkpoint.path}), which was saved before partrain recorded what its data "
                f"holds, and {olds} cannot be read to compare: put the token dir back there (a "
                f"symbolic link to its new place will do) and resume without {keys}; or "
                f"{start_new}") from None
    try:
        now = data_fingerprints(OmegaConf.create(new))
    except OSError as e:  # check_sources has read it; a dir gone since
        raise ConfigError(f"the data cannot be read to compare with the checkpoint at step "
                          f"{checkpoint.step}: {e.strerror or e}") from None
    if now != recorded:
        said = (", ".join(f"{key}={place}" for key, _, place in moved) if moved else
                f"data.path={new.get('path')}" if not new.get("blend") else "data.blend")
        raise ConfigError(
            f"{said} holds other tokens than the checkpoint at step {checkpoint.step} "
            f"({checkpoint.path}) trained on: its meta.json, a shard or index file's size or its "
            "tokenizer differs from what the checkpoint recorded (prepared again, or another "
            "dir). A resume continues the same data (to move it, copy the token dir whole: "
            f"cp -r, rsync); {start_new}")
    return [f"{key} {old} -> {place} (the same tokens)" for key, old, place in moved]


def check_data_there(cfg, run_dir: Path) -> None:
    """Before a resume reads its data: a token dir that is gone from where the run read it is
    named with the way to give its new place (the checks of the data itself come after)."""
    from partrain.config.frozen import CONFIG, load_frozen_config
    from partrain.config.paths import anchored, relative_note, with_anchored_paths, what_is

    def places(data):
        return dict(_moved_places(OmegaConf.to_container(data)))

    try:  # what the run read, against an override's new place (checked as any data.path)
        trained = places(with_anchored_paths(load_frozen_config(str(run_dir / CONFIG), [])).data)
    except ConfigError:
        return
    for key, path in places(cfg.data).items():
        if path and what_is(Path(path)) == "does not exist" and \
                trained.get(key) == anchored(path):
            how = (f"`partrain launch --resume {run_dir} data.path=NEW`" if key == "data.path"
                   else f"data.blend again with its new paths, in `partrain launch --resume "
                        f"{run_dir} 'data.blend=[...]'`")
            raise ConfigError(
                f"{key}={path} does not exist{relative_note(path)}: this run trained on it. If "
                f"the token dir moved, give its new place: {how}; the resume checks that it "
                "holds the same tokens")


def resume_config(run_dir: Path, overrides: list[str]):
    """The frozen config of `run_dir` with the layout overrides of a resume on top. Keys derived
    from the old layout that the overrides do not set are derived again: the micro-batch split
    (at the same global batch) when dp changes, pp_layers when pp changes, the processes per
    node when a degree changes."""
    from partrain.config.frozen import CONFIG, load_frozen_config
    from partrain.config.keys import check_overrides, groups

    if store.STEP_DIR.fullmatch(run_dir.name) and run_dir.parent.name == store.CHECKPOINTS:
        raise ConfigError(f"--resume {run_dir} is a checkpoint, not a run dir: give the run dir "
                          f"({run_dir.parent.parent}); it resumes from its newest checkpoint")
    frozen = run_dir / CONFIG
    if not run_dir.is_dir():
        rule = "is not a directory" if run_dir.exists() else "does not exist"
        raise ConfigError(f"--resume {run_dir} {rule}: give the run dir of a partrain run that "
                          "saved a checkpoint")
    if not frozen.is_file():
        kept = store.newest(run_dir / store.CHECKPOINTS)
        if kept is not None:  # its config.yaml deleted or lost: each checkpoint holds a copy
            raise ConfigError(
                f"--resume {run_dir} holds no {CONFIG}, though it holds the checkpoint "
                f"{kept.path}: copy that checkpoint's {CONFIG} back ({kept.path / CONFIG} to "
                f"{frozen}) and resume again")
        raise ConfigError(f"--resume {run_dir} holds no {CONFIG}: give the run dir of a partrain "
                          "run that saved a checkpoint")
    cfg = load_frozen_config(str(frozen), [])
    overrides = check_overrides(overrides)
    plain, known_groups = [], groups()
    for item in overrides:
        if item.split("=", 1)[0] in known_groups:
            raise ConfigError(f"--resume takes key=value overrides; {item!r} would replace a whole "
                              "config group: set the keys that change instead")
        if item.startswith(("+", "~")) and not item.startswith("++parallel.deepspeed"):
            raise ConfigError(f"--resume takes key=value overrides of existing keys; got {item!r}")
        plain.append(item.lstrip("+"))
    given = {item.split("=", 1)[0] for item in plain}
    if "parallel.deepspeed_config" in given:  # it was recorded, and its file never read
        raise ConfigError(
            "--resume takes no parallel.deepspeed_config: a DeepSpeed file is read once, at a "
            f"run's start, into the keys it sets, which {frozen} holds; a resume reads those. "
            "Give what the resume changes as keys instead (optim.lr=..., optim.grad_clip=..., "
            "parallel.zero_stage=..., ++parallel.deepspeed.KEY=... for DeepSpeed's own keys)")
    try:
        cfg.merge_with(OmegaConf.from_dotlist(plain))
    except Exception as e:  # a value of the wrong type for the schema
        from partrain.config.compose import explain

        raise ConfigError(f"--resume {run_dir}: {explain(e)}") from None
    t, p = cfg.train, cfg.parallel
    if (given & {"parallel.zero_stage", "parallel.zero_backend"}
            and (p.zero_stage == 0 or p.zero_backend == "fsdp")):
        # A resume that leaves DeepSpeed (for DDP or FSDP2) leaves its keys: the file's, folded
        # into partrain's keys at the run's start (its path is a record), and the raw ones, which
        # only DeepSpeed reads. Said in "changed on resume". A raw key given with it stays, and is
        # refused as on any launch.
        p.deepspeed_config = None
        if not any(item.startswith("parallel.deepspeed") for item in given):
            p.deepspeed = {}
    # The global batch stays; of the split, what the overrides give stays and the rest follows
    # (given neither, the micro-batch size stays where the new dp allows it, else the largest
    # that fits and is no larger: config/resolve.py's resplit).
    if "train.micro_batches" not in given:
        t.micro_batches = None
    elif "train.micro_batch_size" not in given:
        t.micro_batch_size = None
    if "parallel.pp" in given and "parallel.pp_layers" not in given:
        p.pp_layers = None
    if given & {"parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp"} and \
            "launcher.nproc_per_node" not in given:
        cfg.launcher.nproc_per_node = None  # the old layout's count: follow the new degrees
    return cfg

"""What a resume may change (resume.py check_resumable), the config a resume runs
(resume_config) and model.init_from's shape check, without a process group. Checkpoints are
directories built on disk the way store.commit leaves them (builders.py); the tensors are
tests/integration/test_checkpoint.py's business. The store itself is test_checkpoint.py's."""

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.resume import check_resumable, resume_config, saved_config
from partrain.config.resolve import resolve_world
from partrain.config.validate import resolve_and_validate
from partrain.errors import ConfigError
from partrain.launch.preflight import check_init_from
from tests.unit.checkpoint.builders import write_checkpoint, write_run_dir
from tests.unit.cli.hostile import frozen_text
from tests.unit.helpers import one_line, validated


# ------------------------------------------------------------------------------------------------
# resume: what a resume may change


@pytest.fixture
def saved(tmp_path) -> store.Checkpoint:
    """The quickstart run's checkpoint at step 100."""
    write_checkpoint(tmp_path / "checkpoints", 100)
    return store.newest(tmp_path / "checkpoints")


def _refusal(checkpoint, *overrides: str) -> str:
    cfg, _, _ = validated(*overrides)
    with pytest.raises(ConfigError) as e:
        check_resumable(checkpoint, cfg)
    return one_line(str(e.value))


@pytest.mark.parametrize("override, key, new, old", [
    ("model.dim=256", "model.dim", "256", "128"),
    ("model.n_layers=2", "model.n_layers", "2", "4"),
    ("model.vocab_size=512", "model.vocab_size", "512", "256"),
    ("model.init_std=0.01", "model.init_std", "0.01", "0.02"),
    ("model.tie_embeddings=true", "model.tie_embeddings", "true", "false"),
    ("train.seed=5", "train.seed", "5", "0"),
    ("train.global_batch_size=32", "train.global_batch_size", "32", "16"),
    ("train.seq_len=128", "train.seq_len", "128", "256"),
    ("train.dtype=fp32", "train.dtype", "fp32", "auto"),
    ("data.val_fraction=0.1", "data.val_fraction", "0.1", "0.05"),
    ("data.stdlib_max_bytes=1000000", "data.stdlib_max_bytes", "1000000", "8000000"),
    # The checkpoint holds AdamW's moments: another optimizer is a new run (model.init_from).
    ("optim.name=sgd", "optim.name", "sgd", "adamw"),
])
def test_resume_refuses_a_change_of_the_math(saved, override, key, new, old):
    message = _refusal(saved, override)
    assert f"{key}={new} differs from {old} in the checkpoint at step 100" in message
    assert str(saved.path) in message and "model.init_from=" in message


def test_a_key_the_checkpoint_lacks_is_its_default(tmp_path):
    """A checkpoint's config saved before a key existed reads it as the key's default (the
    behaviour it trained with): the run resumes with the default, and is refused with another."""
    text = frozen_text().replace("  seed: 0\n", "")
    write_checkpoint(tmp_path / "checkpoints", 100, text)
    checkpoint = store.newest(tmp_path / "checkpoints")
    check_resumable(checkpoint, validated()[0])
    assert "train.seed=5 differs from 0" in _refusal(checkpoint, "train.seed=5")


@pytest.mark.parametrize("overrides", [
    (),
    ("parallel.dp=1", "launcher.nproc_per_node=1"),
    ("parallel.dp=1", "launcher.nproc_per_node=1", "train.micro_batch_size=16"),
    ("parallel.dp=2", "parallel.tp=2", "launcher.nproc_per_node=4"),
    ("parallel.dp=1", "parallel.pp=2", "launcher.nproc_per_node=2"),
    ("train.micro_batch_size=2",),
    ("launcher.device=auto", "launcher.collective_timeout_s=60"),
    ("checkpoint.every=7", "checkpoint.keep=5", "checkpoint.save_last=false",
     "checkpoint.async_save=true"),
    ("train.max_steps=1000", "train.eval_every=10", "train.eval_batches=2", "train.log_every=1",
     "train.trace=true"),
    ("train.max_steps=100",),
    ("name=resumed",),
    ("optim.lr=0.001", "optim.warmup_steps=5", "optim.weight_decay=0.0", "optim.grad_clip=0.5"),
    ("optim.min_lr_ratio=0.0", "optim.beta2=0.99", "optim.eps=1e-6"),
    ("optim.schedule=wsd", "optim.decay_ratio=0.2", "optim.momentum=0.5"),
    ("train.activation_checkpointing=selective", "train.compile=true"),
])
def test_resume_allows_the_layout_the_bookkeeping_and_the_schedule(saved, overrides):
    cfg, _, _ = validated(*overrides)
    changed = check_resumable(saved, cfg)
    # What it changes is said, key by key: each override that moved a value is there.
    for item in overrides:
        key = item.split("=")[0]
        if key not in ("launcher.nproc_per_node",) and OmegaConf.select(cfg, key) is not None:
            saved_value = OmegaConf.select(OmegaConf.create(saved_config(saved)), key)
            if saved_value != OmegaConf.select(cfg, key):
                assert any(line.startswith(f"{key} ") for line in changed), (key, changed)


def test_resume_says_what_it_changes(saved):
    cfg, _, _ = validated("optim.lr=0.0001")
    assert check_resumable(saved, cfg) == ["optim.lr 0.003 -> 0.0001"]
    assert check_resumable(saved, validated()[0]) == []


@pytest.mark.parametrize("max_steps", [1, 99])
def test_resume_refuses_max_steps_below_the_checkpoint(saved, max_steps):
    message = _refusal(saved, f"train.max_steps={max_steps}")
    assert f"train.max_steps={max_steps} is below the checkpoint's step 100" in message


def test_init_from_checks_the_shape(tmp_path):
    write_checkpoint(tmp_path / "checkpoints", 100)
    cfg, _, _ = validated(f"model.init_from={tmp_path}", "train.seed=7", "optim.lr=0.01",
                          "model.init_std=0.01")
    assert check_init_from(cfg).step == 100, "a new run may change all but the model's shape"
    assert check_init_from(validated()[0]) is None
    for override, key, new, old in [("model.dim=256", "model.dim", 256, 128),
                                    ("model.n_kv_heads=4", "model.n_kv_heads", 4, 2),
                                    ("model.vocab_size=512", "model.vocab_size", 512, 256),
                                    ("model.tie_embeddings=true", "model.tie_embeddings", "true",
                                     "false")]:
        cfg, _, _ = validated(f"model.init_from={tmp_path}", override)
        with pytest.raises(ConfigError) as e:
            check_init_from(cfg)
        assert f"{key}={new} does not match {old} of the checkpoint model.init_from=" \
            f"{tmp_path / 'checkpoints' / 'step-00000100'}" in one_line(str(e.value))


# ------------------------------------------------------------------------------------------------
# resume: the config of a resume


def _resumed(run_dir: Path, *overrides: str, nproc: int | None = None):
    cfg = resume_config(run_dir, list(overrides))
    resolve_and_validate(cfg, resolve_world(cfg, None, nproc, 0))
    return cfg


def _batch(cfg) -> tuple:
    t = cfg.train
    return t.global_batch_size, t.micro_batch_size, t.micro_batches


def test_resume_config_without_overrides_is_the_frozen_config(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", 100)
    cfg = _resumed(run_dir)
    assert OmegaConf.to_yaml(cfg) == frozen_text()


@pytest.mark.parametrize("overrides, batch", [
    (("parallel.dp=1", "launcher.nproc_per_node=1"), (16, 4, 4)),   # micro_batches follows dp
    (("parallel.dp=4", "launcher.nproc_per_node=4"), (16, 4, 1)),
    (("parallel.dp=1", "launcher.nproc_per_node=1", "train.micro_batch_size=16"), (16, 16, 1)),
    (("parallel.dp=1", "launcher.nproc_per_node=1", "train.micro_batches=8"), (16, 2, 8)),
    (("train.micro_batch_size=2",), (16, 2, 4)),
    (("train.micro_batches=1",), (16, 8, 1)),
])
def test_resume_config_derives_the_split_again(tmp_path, overrides, batch):
    """The frozen config holds the split of the old layout; the global batch stays and what the
    overrides do not give follows from it."""
    run_dir = write_run_dir(tmp_path / "run", 100)
    cfg = _resumed(run_dir, *overrides)
    assert _batch(cfg) == batch
    check_resumable(store.newest(run_dir / store.CHECKPOINTS), cfg)


@pytest.mark.parametrize("overrides, said", [
    # micro_batch_size 4 * dp 8 > the global batch 16: the size is derived again, no larger
    ((), "train.micro_batch_size 4 -> 2"),
    (("train.micro_batches=1",), "train.micro_batch_size 4 -> 2"),
])
def test_a_resume_on_more_ranks_derives_a_micro_batch_that_fits(tmp_path, run_main, monkeypatch,
                                                                overrides, said):
    """The split is derived again for the new dp (docs/checkpoints.md): the kept micro-batch size
    where it fits, else the largest that does and is no larger. It was refused: `global_batch_size=
    16 is not divisible by micro_batch_size(4) * dp(8)`, a size the user never typed."""
    monkeypatch.chdir(tmp_path)
    write_run_dir(tmp_path / "run", 100)
    result = run_main("launch", "--resume", "run", "--dry-run", "parallel.dp=8",
                      "launcher.nproc_per_node=8", *overrides)
    assert result.code == 0, result.stderr
    assert said in one_line(result.stdout), result.stdout
    assert "train.micro_batches 2 -> 1" in one_line(result.stdout), result.stdout


def test_a_resume_keeps_a_micro_batch_size_it_is_given(tmp_path, run_main, monkeypatch):
    """Given by the user, the size stays, and a split it cannot make is refused as at a start."""
    monkeypatch.chdir(tmp_path)
    write_run_dir(tmp_path / "run", 100)
    result = run_main("launch", "--resume", "run", "--dry-run", "parallel.dp=8",
                      "launcher.nproc_per_node=8", "train.micro_batch_size=4")
    assert result.code == 2
    assert "micro_batch_size(4) * dp(8) = 32" in one_line(result.stderr), result.stderr


def test_resume_config_derives_pp_layers_again(tmp_path):
    text = frozen_text().replace("  pp: 1\n", "  pp: 2\n").replace(
        "  pp_layers: null\n", "  pp_layers:\n  - 1\n  - 3\n").replace(
        "  dp: 2\n", "  dp: 1\n").replace("  micro_batches: 2\n", "  micro_batches: 4\n")
    run_dir = write_run_dir(tmp_path / "run", 100, config_text=text)
    assert list(_resumed(run_dir).parallel.pp_layers) == [1, 3], "kept when pp does not change"
    cfg = _resumed(run_dir, "parallel.pp=4", "launcher.nproc_per_node=4")
    assert cfg.parallel.pp_layers is None, "[1, 3] splits 2 stages, not 4: split evenly again"
    cfg = _resumed(run_dir, "parallel.pp=3", "launcher.nproc_per_node=3",
                   "parallel.pp_layers=[2,1,1]")
    assert list(cfg.parallel.pp_layers) == [2, 1, 1]


@pytest.mark.parametrize("override, fragments", [
    ("model=tiny", ["'model=tiny'", "config group", "set the keys"]),
    ("parallel=default", ["'parallel=default'", "config group"]),
    ("+train.max_steps=400", ["existing keys", "'+train.max_steps=400'"]),
    ("+foo=1", ["+foo=1", "unknown config key"]),
    ("train.max_step=400", ["train.max_step=400", "did you mean train.max_steps?"]),
    ("~train.seed", ["~train.seed", "cannot be removed"]),
    ("train.max_steps=abc", ["--resume", "train.max_steps", "abc"]),
])
def test_resume_config_refuses(tmp_path, override, fragments):
    run_dir = write_run_dir(tmp_path / "run", 100)
    with pytest.raises(ConfigError) as e:
        resume_config(run_dir, [override])
    for fragment in fragments:
        assert fragment in one_line(str(e.value))


def test_resume_config_needs_the_run_dirs_config(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", 100)
    os.remove(run_dir / "config.yaml")
    with pytest.raises(ConfigError, match=r"--resume \S+run holds no config.yaml"):
        resume_config(run_dir, [])


@pytest.mark.parametrize("leave", [("parallel.zero_stage=0",),
                                   ("parallel.zero_backend=fsdp", "parallel.zero_stage=2")])
def test_a_run_started_from_a_deepspeed_file_resumes_on_ddp_or_fsdp(tmp_path, run_main,
                                                                     monkeypatch, leave):
    """The frozen config records the file (folded into partrain's keys at the start) and its raw
    keys: a resume on DDP or FSDP2 was refused ("is a DeepSpeed config, but ... runs DDP"), and
    `parallel.deepspeed_config=null` too ("--resume takes no parallel.deepspeed_config"), so the
    run could not leave DeepSpeed but by editing config.yaml. A resume that leaves DeepSpeed now
    leaves its keys, and says so."""
    import json

    from tests.unit.helpers import resolved

    monkeypatch.chdir(tmp_path)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}, "steps_per_print": 10}))
    cfg, _, _ = resolved("launcher.device=cpu", f"parallel.deepspeed_config={ds}")
    assert cfg.parallel.deepspeed == {"steps_per_print": 10}
    write_run_dir(tmp_path / "run", 100, config_text=OmegaConf.to_yaml(cfg))
    ds.unlink()  # read once, at the start: a resume never reads it again
    result = run_main("launch", "--resume", "run", "--dry-run", *leave)
    assert result.code == 0, result.stderr
    said = one_line(result.stdout)
    assert f"parallel.deepspeed_config {ds} -> null" in said, said
    resumed = resume_config(tmp_path / "run", list(leave))
    assert resumed.parallel.deepspeed_config is None and resumed.parallel.deepspeed == {}
    # Staying on DeepSpeed keeps both.
    kept = resume_config(tmp_path / "run", ["parallel.zero_stage=2"])
    assert kept.parallel.deepspeed_config == str(ds) and kept.parallel.deepspeed

"""Hostile and careless input, part three: checkpoints. `--resume` on what is no run dir or
holds no committed checkpoint, overrides a resume must refuse (the math of the run, a
max_steps below the checkpoint, config groups), bad checkpoint.* values, `model.init_from` on a
missing checkpoint or one of another shape, and a run dir that holds another config's checkpoint.
The contract and the checks are test_hostile.py's (tests/unit/cli/hostile.py): exit 2, one `error:`
line naming the key or flag and the value, no traceback, nothing written (the run dirs the rows
build included) and nothing started.

Run dirs here are built on disk as a run that trained and saved leaves them (config.yaml of the
quickstart recipe as `partrain show` prints it, metrics, a rank log, committed checkpoints with
DCP's .metadata and partrain's meta.json): the launcher decides from those files alone, before
anything starts. Paths are given relative to the cwd (the test's directory) so that the message
can be matched exactly.
"""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.verify import crc32_of
from tests.unit.checkpoint.builders import dcp_files, write_checkpoint, write_run_dir
from tests.unit.cli.hostile import (
    Ctx,
    assert_untouched,
    check_row,
    frozen_text,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    row,
    tree,
)
from tests.unit.helpers import one_line


def _run(*steps: int, name: str = "run", config_text: str | None = None):
    """A row's argv builder part: a trained run dir `name` with checkpoints at `steps`."""
    def build(c: Ctx) -> str:
        write_run_dir(c.root / name, *steps, config_text=config_text)
        return name
    return build


def _seed5() -> str:
    return frozen_text().replace("\n  seed: 0\n", "\n  seed: 5\n")


def _dim256() -> str:
    return frozen_text().replace("\n  dim: 128\n", "\n  dim: 256\n")


def _interrupted(c: Ctx) -> str:
    """A run killed in its first save: a temporary dir and a step dir without DCP's .metadata."""
    write_run_dir(c.root / "run")
    write_checkpoint(c.root / "run" / store.CHECKPOINTS, 100, name=".tmp-step-00000100")
    write_checkpoint(c.root / "run" / store.CHECKPOINTS, 50, metadata=False)
    return "run"


def _without_saved_config(c: Ctx) -> str:
    write_run_dir(c.root / "run", 100)
    (c.root / "run" / store.CHECKPOINTS / "step-00000100" / store.SAVED_CONFIG).unlink()
    return "run"


def _edited_dim(c: Ctx) -> str:
    write_run_dir(c.root / "run", 100)
    (c.root / "run" / "config.yaml").write_text(_dim256())
    return "run"


def _without_run_config(c: Ctx) -> str:
    write_run_dir(c.root / "run", 100)
    (c.root / "run" / "config.yaml").unlink()
    return "run"


def _empty_saved_config(c: Ctx) -> str:
    write_run_dir(c.root / "run", 50, 100)
    (c.root / "run" / store.CHECKPOINTS / "step-00000100" / store.SAVED_CONFIG).write_text("")
    return "run"


def _resume(build, *args: str):
    return lambda c: ["launch", "--resume", build(c), *args]


ROWS_RESUME = [
    row("--resume a missing dir", ["launch", "--resume", "nosuch"],
        "--resume nosuch", "does not exist"),
    row("--resume a file", lambda c: ["launch", "--resume", Path(c.file("afile")).name],
        "--resume afile", "not a directory"),
    row("--resume an empty dir", lambda c: ["launch", "--resume", Path(c.dir("empty")).name],
        "--resume empty", "holds no config.yaml"),
    row("--resume a run dir without a checkpoint", _resume(_run()),
        "--resume run", "holds no committed checkpoint in checkpoints/"),
    row("--resume a run dir with only interrupted saves", _resume(_interrupted),
        "--resume run", "holds no committed checkpoint in checkpoints/ (step-00000050: it has "
        "no .metadata)"),
    row("--resume a step dir, not its run dir",
        lambda c: ["launch", "--resume", _run(100)(c) + "/checkpoints/step-00000100"],
        "--resume run/checkpoints/step-00000100", "is a checkpoint, not a run dir",
        "give the run dir (run)"),
    row("--resume with a CONFIG positional", _resume(_run(100), "quickstart"),
        "--resume run", "quickstart", "overrides only"),
    row("--resume with a frozen config positional", _resume(_run(100), "run/config.yaml"),
        "--resume run", "run/config.yaml", "overrides only"),
    row("--resume with --run-dir naming another dir", _resume(_run(100), "--run-dir", "other"),
        "--run-dir other", "--resume run", "two run dirs"),
    row("--resume train.seed=5", _resume(_run(100), "train.seed=5"),
        "train.seed=5", "differs from 0", "step 100", "model.init_from="),
    row("--resume --dry-run model.dim=256", _resume(_run(100), "--dry-run", "model.dim=256"),
        "model.dim=256 differs from 128", absent=("was it edited",)),
    row("--resume a run dir whose config.yaml was edited (model.dim)", _resume(_edited_dim),
        "model.dim=256 (in run/config.yaml, not an override: was it edited?) differs from 128"),
    row("--resume train.global_batch_size=32 (the split follows, the batch may not)",
        _resume(_run(100), "train.global_batch_size=32"),
        "train.global_batch_size=32", "differs from 16"),
    row("--resume data.val_fraction=0.1", _resume(_run(100), "data.val_fraction=0.1"),
        "data.val_fraction=0.1", "differs from 0.05"),
    row("--resume train.max_steps below the checkpoint",
        _resume(_run(100), "train.max_steps=50"),
        "train.max_steps=50", "below the checkpoint's step 100"),
    row("--resume a run saved at step 300 with train.max_steps=299",
        _resume(_run(100, 300), "--dry-run", "train.max_steps=299"),
        "train.max_steps=299", "step 300"),
    row("--resume model=tiny (a group)", _resume(_run(100), "model=tiny"),
        "--resume", "'model=tiny'", "config group"),
    row("--resume +foo=1", _resume(_run(100), "+foo=1"), "+foo=1", "unknown config key"),
    row("--resume +train.max_steps=400", _resume(_run(100), "+train.max_steps=400"),
        "'+train.max_steps=400'", "existing keys"),
    row("--resume train.max_steps=abc", _resume(_run(100), "train.max_steps=abc"),
        "--resume run", "train.max_steps", "abc"),
    row("--resume checkpoint.keep=0", _resume(_run(100), "checkpoint.keep=0"),
        "checkpoint.keep=0", "at least 1"),
    row("--resume a checkpoint without its config.yaml", _resume(_without_saved_config),
        "step-00000100/config.yaml does not exist",
        "Move it out of run/checkpoints to go on from the one before it"),
    row("--resume model.init_from=another run (it would never be read)",
        lambda c: ["launch", "--resume", _run(100)(c), "model.init_from=" + _run(50, name="a")(c)],
        "model.init_from=", "differs from null in the checkpoint at step 100",
        "model.init_from is read only at a run's first start",
        "a new --run-dir, no --resume"),
    # It was recorded as changed, and the run trained on with the old file's settings
    row("--resume parallel.deepspeed_config=another file",
        lambda c: ["launch", "--resume", _run(100)(c),
                   "parallel.deepspeed_config=" + c.file("z1.json", '{"zero_optimization": '
                                                         '{"stage": 1}}')],
        "--resume takes no parallel.deepspeed_config", "read once, at a run's start",
        "run/config.yaml holds", "optim.lr=..."),
    row("--resume a run dir whose config.yaml was deleted", _resume(_without_run_config),
        "--resume run holds no config.yaml, though it holds the checkpoint "
        "run/checkpoints/step-00000100", "copy that checkpoint's config.yaml back"),
    # A power cut after the commit, before the file's data reached the disk (it is fsynced now).
    row("--resume a checkpoint whose config.yaml is empty", _resume(_empty_saved_config),
        "the checkpoint run/checkpoints/step-00000100 (step 100) cannot be used",
        "step-00000100/config.yaml is empty", "Move it out of run/checkpoints"),
]

ROWS_CHECKPOINT_KEYS = [
    row("checkpoint.every=-1", ["launch", "--dry-run", "checkpoint.every=-1"],
        "checkpoint.every=-1", ">= 0"),
    row("checkpoint.keep=0", ["launch", "--dry-run", "checkpoint.keep=0"],
        "checkpoint.keep=0", "at least 1"),
    row("checkpoint.keep=-3", ["show", "checkpoint.keep=-3"], "checkpoint.keep=-3", "at least 1"),
    row("checkpoint.every=abc", ["show", "checkpoint.every=abc"],
        "checkpoint.every", "'abc'", "Integer"),
    row("checkpoint.save_last=maybe", ["show", "checkpoint.save_last=maybe"],
        "checkpoint.save_last", "'maybe'", "bool"),
    row("checkpoint.evry", ["show", "checkpoint.evry=5"],
        "checkpoint.evry=5", "did you mean checkpoint.every?"),
]

ROWS_INIT_FROM = [
    row("model.init_from=/nonexistent",
        ["launch", "model.init_from=/nonexistent", "--run-dir", "new"],
        "model.init_from=/nonexistent", "does not exist"),
    row("model.init_from a run dir without a checkpoint",
        lambda c: ["launch", "model.init_from=" + _run()(c), "--run-dir", "new"],
        "model.init_from=run", "holds no committed checkpoint"),
    row("model.init_from an interrupted save",
        lambda c: ["launch", "--dry-run",
                   "model.init_from=" + _interrupted(c) + "/checkpoints/.tmp-step-00000100"],
        "model.init_from=run/checkpoints/.tmp-step-00000100", "holds no committed checkpoint"),
    row("model.init_from a checkpoint of model.dim=256",
        lambda c: ["launch", "model.init_from=" + _run(100, config_text=_dim256())(c),
                   "--run-dir", "new"],
        "model.dim=128", "does not match 256", "model.init_from=run/checkpoints/step-00000100"),
    row("model.init_from a checkpoint of another shape, by its step dir",
        lambda c: ["launch", "--dry-run", "model.n_layers=2", "model.init_from="
                   + _run(100)(c) + "/checkpoints/step-00000100"],
        "model.n_layers=2", "does not match 4"),
    row("slurm model.init_from=/nonexistent",
        ["slurm", "--nodes", "1", "--dry-run", "model.init_from=/nonexistent", "--run-dir", "new"],
        "model.init_from=/nonexistent", "does not exist"),
]

ROWS_RUN_DIR_WITH_CHECKPOINT = [
    row("show RUN_DIR (its config.yaml was meant)", lambda c: ["show", "./" + _run(100)(c)],
        "/run is a directory; give a YAML file (the run dir's config: ", "/run/config.yaml)"),
    row("launch RECIPE --run-dir holding a checkpoint of another config",
        lambda c: ["launch", "quickstart", "--run-dir", _run(100, config_text=_seed5())(c)],
        "--run-dir run", "checkpoint at step 100 of another config (train.seed: 5 there, 0 here)",
        "--resume run"),
    row("launch --run-dir holding the recipe's checkpoint, with train.seed=5",
        lambda c: ["launch", "--dry-run", "train.seed=5", "--run-dir", _run(100)(c)],
        "--run-dir run", "of another config (train.seed: 0 there, 5 here)",
        "partrain launch --resume run"),
    # The same config in it starts the run again (test_a_run_dir_without_a_checkpoint_...).
    row("launch --run-dir that trained without a committed checkpoint, another config",
        lambda c: ["launch", "--dry-run", "train.seed=5", "--run-dir", _run()(c)],
        "--run-dir run", "holds another config (train.seed: 0 there, 5 here)"),
    row("launch --run-dir whose run was killed in its first save, another config",
        lambda c: ["launch", "--dry-run", "train.seed=5", "--run-dir", _interrupted(c)],
        "--run-dir run", "holds another config (train.seed: 0 there, 5 here)"),
    row("slurm --run-dir holding a checkpoint",
        lambda c: ["slurm", "--nodes", "1", "--dry-run", "--run-dir", _run(100)(c)],
        "--run-dir", "run", "holds a run with a checkpoint at step 100",
        "continue it with `partrain slurm --resume ", "--nodes N`", "new --run-dir"),
]

def _broken(how: str):
    """A run dir whose step-100 checkpoint lost its shard, has it cut short, whose .metadata
    is garbage, or whose tensors are another model's: committed as far as the directory says,
    unreadable all the same."""
    def build(c: Ctx) -> str:
        write_run_dir(c.root / "run", 50, 100)  # the one before it: what the advice goes on from
        step = c.root / "run" / store.CHECKPOINTS / "step-00000100"
        shard = step / "__0_0.distcp"
        if how == "missing":
            shard.unlink()
        elif how == "truncated":
            shard.write_bytes(shard.read_bytes()[:10])
        elif how == "flipped":  # one bit, the size unchanged, under partrain's crc32s
            meta = json.loads((step / store.META).read_text())
            meta["files"] = {shard.name: crc32_of(shard)}
            (step / store.META).write_text(json.dumps(meta))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 1
            shard.write_bytes(bytes(data))
        elif how == "swapped":  # another model's tensors under this config.yaml
            model = OmegaConf.create(frozen_text()).model
            model.n_layers, model.dim = 2, model.dim * 2
            for name in (store.DCP_METADATA, "__0_0.distcp"):
                (step / name).unlink()
            for name, data in dcp_files(OmegaConf.to_yaml(model)).items():
                (step / name).write_bytes(data)
        else:
            (step / store.DCP_METADATA).write_bytes(b"\x80\x04garbage")
        return "run"
    return build


# What to do instead: a run dir's command goes on from the checkpoint before a broken one once
# that is moved away; a command that takes a checkpoint's own folder can be given an older one.
MOVE_IT, OLDER_ONE = "and run the same command again", "Give an older one ("
ROWS_BROKEN = [
    row(f"{command} of a checkpoint whose {what}", argv, *fragments,
        *(() if how == "swapped" else (MOVE_IT if command.startswith("launch --") else OLDER_ONE,)))
    for how, what, fragments in (
        ("missing", "shard is gone", ("__0_0.distcp is missing", "written by rank 0")),
        ("flipped", "shard has a bit flipped",
         ("__0_0.distcp does not hold the bytes written into it", "written by rank 0")),
        ("truncated", "shard is cut short", ("__0_0.distcp holds 10 of its",)),
        ("garbage", ".metadata is garbage", (".metadata cannot be read",)),
        ("swapped", "tensors are another model's",
         ("does not hold the model its config.yaml describes",
          "tok_embeddings.weight is [256, 256] there and [256, 128] in the model",
          "more)", "was config.yaml edited")))
    for command, argv in (
        ("launch --resume", _resume(_broken(how), "--dry-run")),
        ("launch --run-dir", lambda c, how=how: ["launch", "--dry-run", "--run-dir", _broken(how)(c)]),
        ("model.init_from", lambda c, how=how: ["launch", "--dry-run", "--run-dir", "new",
                                                 "model.init_from=" + _broken(how)(c)]),
        ("export", lambda c, how=how: ["export", _broken(how)(c), "--out", "out"]),
        ("sample", lambda c, how=how: ["sample", _broken(how)(c), "--prompt", "x"]))
    # A launch leaves the crc32s to its ranks (each reads its share: tests/integration/
    # test_checkpoint.py); a dry run starts none.
    if how != "flipped" or command in ("export", "sample")
]

def _metrics_a_directory(c: Ctx) -> str:
    """metrics.jsonl replaced by a directory: rank 0 failed on it (IsADirectoryError, exit 1)
    after every rank had started."""
    run = _run(100)(c)
    (c.root / run / "metrics.jsonl").unlink()
    (c.root / run / "metrics.jsonl").mkdir()
    return run


def _prepared_for_two_nodes(c: Ctx) -> str:
    """What `partrain slurm --nodes 2 --dry-run` leaves: a config for two nodes, nothing trained."""
    (c.root / "prep" / "logs").mkdir(parents=True)
    (c.root / "prep" / "config.yaml").write_text(
        frozen_text().replace("\n  nnodes: 1\n", "\n  nnodes: 2\n"))
    return "prep"


ROWS_RUN_DIR_ENTRIES = [
    # dp follows the ranks a resume names: a refusal of dp's says so, one of another key not.
    row("launch --resume on 1 rank with cp=2", _resume(_run(100), "--dry-run", "parallel.cp=2",
                                                        "--nproc-per-node", "1"),
        "parallel.dp=auto needs the world size 1", "on a resume that names the ranks, "
        "parallel.dp follows them", "give parallel.dp=N"),
    row("launch --resume on 2 ranks with optim.lr=-1", _resume(_run(100), "--dry-run",
                                                               "optim.lr=-1", "--nproc-per-node",
                                                               "2"),
        "optim.lr=-1.0 must be positive", absent=("parallel.dp follows",)),
    # Named before the second node's missing --rdzv-endpoint, which would not have helped.
    row("launch --resume of a run dir prepared for 2 nodes that never trained",
        _resume(_prepared_for_two_nodes, "--dry-run"), "--resume prep holds no committed "
        "checkpoint", absent=("--rdzv-endpoint",)),
    row("launch --resume of a run dir whose metrics.jsonl is a directory",
        _resume(_metrics_a_directory, "--dry-run"), "--resume run holds metrics.jsonl, which is "
        "not a file: a start appends to it"),
]

TABLE = [*ROWS_RESUME, *ROWS_RUN_DIR_ENTRIES, *ROWS_CHECKPOINT_KEYS, *ROWS_INIT_FROM, *ROWS_RUN_DIR_WITH_CHECKPOINT,
         *ROWS_BROKEN]


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------------
# Allowed by design (controls: the table's refusals are not refusals of everything). Each one
# writes nothing either: a dry run, or a run with nothing left to do.


def _allowed(run_main, tmp_path, monkeypatch, argv) -> str:
    args = argv(Ctx(tmp_path, monkeypatch))
    before = tree(tmp_path)
    result = run_main(*args)
    assert result.code == 0, f"exit {result.code}\n{result.stdout}\n{result.stderr}"
    assert "error:" not in result.stderr, result.stderr
    assert_untouched(tmp_path, before)
    return one_line(result.stdout)


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "for real"])
def test_resume_of_a_finished_run_has_nothing_to_do(dry_run, run_main, tmp_path, monkeypatch):
    """The quickstart run trains to 300 steps and saved there: a relaunch starts nothing."""
    out = _allowed(run_main, tmp_path, monkeypatch, _resume(_run(100, 300), *dry_run))
    assert "run is trained to step 300 = train.max_steps" in out
    assert "run/checkpoints/step-00000300" in out and "nothing to do" in out
    assert "partrain launch --resume run train.max_steps=N" in out


def _frozen_by_an_older_partrain() -> str:
    """The quickstart's config.yaml as a partrain before launcher.start_method and
    data.sampling froze it."""
    text = frozen_text()
    for line in ("\n  start_method: auto\n", "\n  sampling: random\n"):
        assert line in text, line
        text = text.replace(line, "\n")
    return text


@pytest.mark.parametrize("command", ["job script", "--run-dir"])
def test_a_run_dir_of_an_older_partrain_goes_on(command, run_main, tmp_path, monkeypatch):
    """Keys partrain gained since a run froze its config take their defaults, as --resume's
    do: the same command (or a requeued job's script, after an upgrade) was refused at every
    node (`of another config (data.sampling: null there, random here; ...)`)."""
    def argv(c):
        run = _run(100, config_text=_frozen_by_an_older_partrain())(c)
        return (["launch", "--dry-run", f"{run}/config.yaml", "--run-dir", run]
                if command == "job script" else ["launch", "--dry-run", "--run-dir", run])
    out = _allowed(run_main, tmp_path, monkeypatch, argv)
    assert "resuming from step 100 (run/checkpoints/step-00000100); nothing started" in out


def test_relaunch_of_a_finished_run_has_nothing_to_do(run_main, tmp_path, monkeypatch):
    out = _allowed(run_main, tmp_path, monkeypatch,
                   lambda c: ["launch", "--run-dir", _run(300)(c)])
    assert "trained to step 300" in out and "nothing to do" in out


@pytest.mark.parametrize("argv, says", [
    (_resume(_run(50, 100), "--dry-run"), "1 rank"),
    (_resume(_run(100), "--dry-run", "--run-dir", "run"), "worker(s)"),
    (_resume(_run(100), "--dry-run", "parallel.dp=1", "launcher.nproc_per_node=1"),
     "start 1 worker(s)"),
    (_resume(_run(100), "--dry-run", "train.max_steps=1000", "checkpoint.every=10",
             "train.micro_batch_size=2"), "worker(s)"),
    (lambda c: ["launch", "--dry-run", "--run-dir", _run(100)(c)], "worker(s)"),
    # The first run's process count follows the new degrees (it said "world size 1 ... from
    # launcher.nproc_per_node", a count the user never gave, when cp changed).
    (_resume(_run(100), "--dry-run", "parallel.cp=2"), "start 2 worker(s)"),
    # A job script's launch line (CONFIG --run-dir, its own --nnodes and --nproc-per-node) after
    # a `launch --resume` on another world: it was refused at every node ("of another config
    # (launcher.nnodes: 1 there, 2 here ...)").
    (lambda c: ["launch", "--dry-run", str(Path(_run(100)(c)) / "config.yaml"), "--run-dir",
                "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                "127.0.0.1:29999"], "start 1 worker(s)"),
], ids=["newest of two", "--run-dir the same dir", "another layout", "bookkeeping keys",
        "the same command again", "cp changes the world", "a job script on another world"])
def test_resume_dry_run_says_where_it_resumes(argv, says, run_main, tmp_path, monkeypatch):
    out = _allowed(run_main, tmp_path, monkeypatch, argv)
    assert "dry run: would write run" in out
    assert "resuming from step 100 (run/checkpoints/step-00000100); nothing started" in out


def test_init_from_dry_run(run_main, tmp_path, monkeypatch):
    """A new run from another run's weights may change all but the model's shape."""
    out = _allowed(run_main, tmp_path, monkeypatch,
                   lambda c: ["launch", "--dry-run", "model.init_from=" + _run(100)(c),
                              "train.seed=3", "optim.lr=0.01", "--run-dir", "new"])
    assert "dry run: would write new" in out and "resuming" not in out


@pytest.mark.parametrize("ranks, dp, split", [("1", "parallel.dp 2 -> 1", "micro_batches 2 -> 4"),
                                               ("4", "parallel.dp 2 -> 4", "micro_batches 2 -> 1")])
def test_a_resume_on_other_ranks_has_dp_follow_them(ranks, dp, split, run_main, tmp_path,
                                                     monkeypatch):
    """`--nproc-per-node N` on resume: dp follows (world / (pp * cp * tp)) and the micro-batch
    split with it, as torchrun users expect; it was refused (`pp(1) * dp(2) * tp(1) = 2 != world
    size 1`) unless parallel.dp was given too."""
    out = _allowed(run_main, tmp_path, monkeypatch,
                   _resume(_run(100), "--dry-run", "--nproc-per-node", ranks))
    assert f"changed on resume: launcher.nproc_per_node 2 -> {ranks}, {dp}, train.{split}" in out


def test_resume_may_change_the_schedule(run_main, tmp_path, monkeypatch):
    """After a spike: a lower learning rate (and the other optimizer hyperparameters) on resume,
    said on the way in; the model, the data and the batch stay refused (the table above)."""
    out = _allowed(run_main, tmp_path, monkeypatch,
                   _resume(_run(100), "--dry-run", "optim.lr=0.0001", "optim.warmup_steps=0",
                           "train.activation_checkpointing=full"))
    assert ("changed on resume: optim.lr 0.003 -> 0.0001, optim.warmup_steps 20 -> 0, "
            "train.activation_checkpointing none -> full") in out
    assert "resuming from step 100 (run/checkpoints/step-00000100); nothing started" in out


@pytest.mark.parametrize("made", [_run(), _interrupted], ids=["stopped", "killed-in-first-save"])
def test_a_run_dir_without_a_checkpoint_starts_again_with_the_same_command(
        made, run_main, tmp_path, monkeypatch):
    """A run stopped (or killed in its first save) before it committed a checkpoint: the same
    command in its run dir, as a requeued job runs it, starts it again from step 1."""
    out = _allowed(run_main, tmp_path, monkeypatch,
                   lambda c: ["launch", "--dry-run", "--run-dir", made(c)])
    assert ("it trained before without committing a checkpoint, so the run starts again from "
            "step 1") in out, out


def test_resume_with_the_same_config_says_no_change(run_main, tmp_path, monkeypatch):
    out = _allowed(run_main, tmp_path, monkeypatch, _resume(_run(100), "--dry-run"))
    assert "changed on resume" not in out

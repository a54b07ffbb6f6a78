"""The checkpoint protocol without a process group: which directories count as committed
(store.py), how a save is committed and old ones pruned, how a user's path names a checkpoint,
and the wrapper-free parameter names (state.py). What a resume may change is test_resume.py's.

Checkpoints here are directories built on disk the way store.commit leaves them (DCP's .metadata,
partrain's meta.json, the config; builders.py): the launcher-side rules read nothing else. The
tensors are tests/integration/test_checkpoint.py's business.
"""

import json
from pathlib import Path

import pytest

from partrain.checkpoint import store
from partrain.checkpoint.state import canonical_name
from partrain.errors import ConfigError
from tests.unit.checkpoint.builders import write_checkpoint, write_run_dir
from tests.unit.helpers import one_line


def names(paths) -> list[str]:
    return [Path(p).name for p in paths]


def steps(root: Path) -> list[int]:
    return [c.step for c in store.committed(root)]


# ------------------------------------------------------------------------------------------------
# store: what is committed


def test_committed_counts_only_complete_step_dirs(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 20)
    write_checkpoint(root, 4)
    write_checkpoint(root, 30, name=".tmp-step-00000030")          # being written
    write_checkpoint(root, 40, metadata=False)                     # DCP never finished
    write_checkpoint(root, 50, meta=False)                         # killed before meta.json
    write_checkpoint(root, 60, meta={"step": 61})                  # meta.json of another step
    write_checkpoint(root, 70, meta=[70])                          # meta.json not a mapping
    write_checkpoint(root, 80, meta={"reason": "every"})           # meta.json without a step
    (write_checkpoint(root, 90) / store.META).write_text('{"step": 9')  # truncated meta.json
    # Fields a start reads, of another kind (each failed in every rank with the advice to
    # resume from it again)
    write_checkpoint(root, 91, meta={"step": 91, "skipped_in_a_row": "zero"})
    write_checkpoint(root, 92, meta={"step": 92, "world_size": 2.5})
    write_checkpoint(root, 93, meta={"step": 93, "loss_scaler": [1]})
    write_checkpoint(root, 95, name="step-95")                     # not a step-NNNNNNNN name
    write_checkpoint(root, 96, name="step-00000096.old")
    (root / "step-00000099").write_text("a file, not a directory")
    (root / store.LATEST).write_text("step-00000099\n")

    found = store.committed(root)
    assert [(c.step, c.path.name) for c in found] == [(4, "step-00000004"), (20, "step-00000020")]
    assert found[-1].meta == {"step": 20, "reason": "every"} and found[-1].reason == "every"
    assert store.newest(root).step == 20
    # The step dirs past the newest that do not count, and why: a start says it passes them.
    assert [(p.name, why) for p, why in store.not_committed(root, 20)] == [
        ("step-00000040", "it has no .metadata"),
        ("step-00000050", "its meta.json is missing or not JSON"),
        ("step-00000060", "its meta.json says step 61"),
        ("step-00000070", "its meta.json is missing or not JSON"),
        ("step-00000080", "its meta.json says step None"),
        ("step-00000090", "its meta.json is missing or not JSON"),
        ("step-00000091", "its meta.json says skipped_in_a_row='zero', not a whole number"),
        ("step-00000092", "its meta.json says world_size=2.5, not a whole number"),
        ("step-00000093", "its meta.json says loss_scaler=[1], not an object")]
    assert store.not_committed(root, 93) == []


def test_a_start_says_it_passes_a_broken_newer_step_dir(tmp_path, run_main, monkeypatch):
    """step-8 lost its .metadata (a damaged disk, a copy cut short): the resume goes on from
    step 5, and says why it does not take step 8, instead of rolling back without a word."""
    monkeypatch.chdir(tmp_path)
    write_run_dir(tmp_path / "run", 50, 100)
    (tmp_path / "run" / "checkpoints" / "step-00000100" / store.DCP_METADATA).unlink()
    result = run_main("launch", "--resume", "run", "--dry-run")
    assert result.code == 0, result.stderr
    said = one_line(result.stderr + result.stdout)
    assert ("run/checkpoints/step-00000100 is not a committed checkpoint (it has no .metadata), "
            "so the run goes on from the newest one before it, step 50") in said, said
    assert "resuming from step 50" in said, said


def test_newest_of_nothing(tmp_path):
    assert store.committed(tmp_path / "missing") == []
    assert store.newest(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert store.newest(tmp_path / "empty") is None
    write_checkpoint(tmp_path / "only-tmp", 5, name=".tmp-step-00000005")
    assert store.newest(tmp_path / "only-tmp") is None


def test_newest_orders_by_step_not_by_name(tmp_path):
    """Nine digits sort before eight as text: step-100000000 is newer than step-99999999."""
    write_checkpoint(tmp_path, 99_999_999)
    write_checkpoint(tmp_path, 100_000_000)
    assert store.newest(tmp_path).path.name == "step-100000000"


def test_a_stale_latest_does_not_change_newest(tmp_path):
    """A kill between the commit's rename and the `latest` update leaves `latest` one behind."""
    run_dir = write_run_dir(tmp_path / "run", 10, 20, 30)
    root = run_dir / store.CHECKPOINTS
    (root / store.LATEST).write_text("step-00000010\n")
    assert store.newest(root).step == 30
    assert store.find(run_dir, "--resume").step == 30
    (root / store.LATEST).write_text("step-00000040\n")  # names what was pruned or never made
    assert store.newest(root).step == 30
    (root / store.LATEST).unlink()
    assert store.newest(root).step == 30


def test_clean_leftovers_removes_only_temporaries(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 10)
    write_checkpoint(root, 20, metadata=False)
    write_checkpoint(root, 30, name=".tmp-step-00000030")
    (root / ".tmp-step-00000040").mkdir()
    (root / ".tmp-latest.1234").write_text("step-00000010\n")
    (root / store.LATEST).write_text("step-00000010\n")
    (root / ".hidden").write_text("not ours")
    outside = write_checkpoint(tmp_path, 50, name=".tmp-step-00000050")  # not under root

    removed = store.clean_leftovers(root)

    assert names(removed) == [".tmp-latest.1234", ".tmp-step-00000030", ".tmp-step-00000040"]
    assert sorted(p.name for p in root.iterdir()) == [
        ".hidden", "latest", "step-00000010", "step-00000020"]
    assert steps(root) == [10] and outside.is_dir()
    assert store.clean_leftovers(root) == []
    assert store.clean_leftovers(tmp_path / "missing") == []


def test_clean_leftovers_does_not_follow_a_symlink(tmp_path):
    """A `.tmp-*` link to someone's directory: the link goes, what it points to stays."""
    root, theirs = tmp_path / "checkpoints", tmp_path / "theirs"
    root.mkdir()
    theirs.mkdir()
    (theirs / "data").write_text("keep me")
    (root / ".tmp-step-00000001").symlink_to(theirs)
    assert names(store.clean_leftovers(root)) == [".tmp-step-00000001"]
    assert list(root.iterdir()) == [] and (theirs / "data").read_text() == "keep me"


# ------------------------------------------------------------------------------------------------
# store: commit and prune


def _written(root: Path, step: int, shard_bytes: int = 100) -> Path:
    """What every rank's DCP save leaves before the commit: the temporary dir with its files."""
    tmp = store.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"\1" * shard_bytes)
    (tmp / "__1_0.distcp").write_bytes(b"\2" * (shard_bytes + 1))
    (tmp / store.DCP_METADATA).write_bytes(b"m" * 7)
    return tmp


def test_commit_renames_and_points_latest(tmp_path):
    root = tmp_path / "checkpoints"
    tmp = _written(root, 5)
    checkpoint = store.commit(root, 5, {"reason": "every", "step": 999}, "name: x\n")

    assert not tmp.exists()
    assert checkpoint.path == root / "step-00000005" and checkpoint.step == 5
    saved = json.loads((checkpoint.path / store.META).read_text())
    assert saved == checkpoint.meta
    assert saved["step"] == 5, "the step committed wins over a step in the given meta"
    assert saved["reason"] == "every"
    assert saved["bytes"] == 100 + 101 + 7  # what the ranks wrote
    assert (checkpoint.path / store.SAVED_CONFIG).read_text() == "name: x\n"
    assert (root / store.LATEST).read_text() == "step-00000005\n"
    assert store.newest(root) == checkpoint
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000005"], \
        "the temporary file of `latest` is left behind"


def test_commit_replaces_latest_atomically(tmp_path):
    """`latest` is replaced by a rename, never rewritten in place: a reader that opened the old
    one reads it whole, and no moment exists at which it is empty or half written."""
    root = tmp_path / "checkpoints"
    _written(root, 5)
    store.commit(root, 5, {}, "")
    _written(root, 10)
    with open(root / store.LATEST) as reader:
        store.commit(root, 10, {}, "")
        assert reader.read() == "step-00000005\n"
    assert (root / store.LATEST).read_text() == "step-00000010\n"
    assert steps(root) == [5, 10]


def test_commit_of_a_step_already_committed_replaces_it(tmp_path):
    """A resume that ends where it began saves the same step again."""
    root = tmp_path / "checkpoints"
    _written(root, 5, shard_bytes=10)
    store.commit(root, 5, {"reason": "every"}, "")
    _written(root, 5, shard_bytes=20)
    again = store.commit(root, 5, {"reason": "last"}, "")
    assert steps(root) == [5] and store.newest(root).reason == "last"
    assert again.meta["bytes"] == 20 + 21 + 7
    assert not store.tmp_dir(root, 5).exists()


def test_prune_deletes_only_older_committed(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        write_checkpoint(root, step)
    uncommitted = write_checkpoint(root, 5, metadata=False)
    tmp = write_checkpoint(root, 50, name=".tmp-step-00000050")

    assert names(store.prune(root, 2)) == ["step-00000010", "step-00000020"]
    assert steps(root) == [30, 40]
    assert uncommitted.is_dir() and tmp.is_dir(), "prune only touches committed checkpoints"
    assert store.prune(root, 2) == []
    assert store.prune(root, 10) == [] and steps(root) == [30, 40]
    assert names(store.prune(root, 1)) == ["step-00000030"]
    assert steps(root) == [40]
    assert store.prune(root, 1) == [] and store.prune(root, 0) == [], "the newest always stays"
    assert steps(root) == [40]


def test_prune_takes_a_checkpoint_out_of_the_committed_set_before_deleting_it(tmp_path):
    """The rename comes first: while a large checkpoint is deleted (in the checkpointer's
    background thread) or if the deletion is killed, what is left is no checkpoint any reader
    would take, and the next start removes it as a leftover."""
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        write_checkpoint(root, step)
    handed = []
    assert names(store.prune(root, 1, delete=handed.extend)) == ["step-00000010", "step-00000020"]
    assert steps(root) == [30], "no longer committed, though not deleted yet"
    assert [p.name for p in handed] == [".tmp-pruned-step-00000010", ".tmp-pruned-step-00000020"]
    assert all((p / "meta.json").is_file() for p in handed)
    assert store.leftovers(root) == handed
    assert store.clean_leftovers(root) == handed and not any(p.exists() for p in handed)
    assert steps(root) == [30]


def test_clean_leftovers_renames_aside_what_it_hands_to_a_deleter(tmp_path):
    """At a start, rank 0 renames each leftover directory to a name no save of this start
    writes to, and hands them on (the checkpointer deletes them in the background): a large
    half-written save on a slow file system no longer holds up the other ranks. A name given
    before (a start that ended first) is not stacked."""
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 20)
    half = write_checkpoint(root, 30, name=".tmp-step-00000030")
    again = write_checkpoint(root, 10, name=".tmp-gone-0123abcd-pruned-step-00000010")
    (root / ".tmp-latest.77").write_text("step-00000020\n")
    handed = []
    assert store.clean_leftovers(root, handed.extend) == sorted(
        [half, again, root / ".tmp-latest.77"])
    assert sorted(p.name[19:] for p in handed) == ["pruned-step-00000010", "step-00000030"]
    assert all(p.name.startswith(".tmp-gone-") and (p / "meta.json").is_file() for p in handed)
    assert not half.exists() and not again.exists() and not (root / ".tmp-latest.77").exists()
    assert store.leftovers(root) == sorted(handed) and steps(root) == [20]


# ------------------------------------------------------------------------------------------------
# store: a checkpoint named by the user


def test_find_takes_a_step_dir_a_run_dir_or_its_checkpoints(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", 10, 20)
    root = run_dir / store.CHECKPOINTS
    assert store.find(root / "step-00000010", "model.init_from").step == 10, \
        "a step dir is that checkpoint, not the newest"
    assert store.find(root / "step-00000020", "model.init_from").path == root / "step-00000020"
    assert store.find(run_dir, "model.init_from").step == 20
    assert store.find(root, "model.init_from").step == 20
    assert store.find(Path(str(root / "step-00000010") + "/"), "x").step == 10
    # checkpoints/latest, the file that names the newest (it "held no committed checkpoint")
    assert (root / store.LATEST).is_file()
    assert store.find(root / store.LATEST, "RUN_DIR_OR_CHECKPOINT").step == 20


@pytest.mark.parametrize("where, rule", [
    ("nosuch", "does not exist"),
    ("nosuch/step-00000010", "does not exist"),
    ("run/checkpoints/step-00000030", "does not exist"),
    ("empty", "holds no committed checkpoint"),
    ("run-no-checkpoint", "holds no committed checkpoint"),
    ("run/checkpoints/step-00000020", "holds no committed checkpoint"),
    ("run/checkpoints/.tmp-step-00000040", "holds no committed checkpoint"),
    ("run/config.yaml", "holds no committed checkpoint"),
])
def test_find_refuses_naming_the_key(tmp_path, where, rule):
    run_dir = write_run_dir(tmp_path / "run", 10)
    write_checkpoint(run_dir / store.CHECKPOINTS, 20, metadata=False)
    write_checkpoint(run_dir / store.CHECKPOINTS, 40, name=".tmp-step-00000040")
    write_run_dir(tmp_path / "run-no-checkpoint")
    (tmp_path / "empty").mkdir()
    path = tmp_path / where
    with pytest.raises(ConfigError) as e:
        store.find(path, "model.init_from")
    assert f"model.init_from={path} " in str(e.value) and rule in str(e.value)


def test_find_names_the_flag_it_is_given(tmp_path):
    with pytest.raises(ConfigError, match=r"^--resume=\S*nosuch does not exist"):
        store.find(tmp_path / "nosuch", "--resume")


# ------------------------------------------------------------------------------------------------
# state: parameter names without the wrappers' prefixes


@pytest.mark.parametrize("wrapped, canonical", [
    ("layers.7.attention.wq.weight", "layers.7.attention.wq.weight"),
    ("module.layers.7.attention.wq.weight", "layers.7.attention.wq.weight"),
    ("chunks.0.layers.7.attention.wq.weight", "layers.7.attention.wq.weight"),
    ("chunks.12.norm.weight", "norm.weight"),
    ("module.chunks.1.layers.7.attention.wq.weight", "layers.7.attention.wq.weight"),
    ("chunks.1.module.layers.0.ffn.w1.weight", "layers.0.ffn.w1.weight"),
    ("module.module.tok_embeddings.weight", "tok_embeddings.weight"),
    ("output.weight", "output.weight"),
    # Only a leading prefix is a wrapper's: a name that holds the words further in keeps them.
    ("layers.3.module.weight", "layers.3.module.weight"),
    ("layers.3.chunks.2.weight", "layers.3.chunks.2.weight"),
    ("modules.weight", "modules.weight"),
    ("chunks.x.weight", "chunks.x.weight"),
])
def test_canonical_name(wrapped, canonical):
    assert canonical_name(wrapped) == canonical


def test_export_and_sample_look_again_when_a_running_launch_prunes_the_newest(tmp_path):
    """A launch still training prunes old checkpoints (checkpoint.keep): the newest that
    `export` or `sample` found could be renamed away while it was read (half of 8 exports of a
    live run failed: a missing .metadata, or the advice to move a damaged checkpoint aside).
    Here the prune comes between the find and the read, as store.prune renames."""
    from partrain.checkpoint.offline import read_checkpoint
    from partrain.checkpoint.verify import check_whole
    from partrain.errors import ConfigError
    from tests.unit.checkpoint.builders import write_run_dir

    run_dir = write_run_dir(tmp_path / "run", 100, 200, 300)
    read = []

    def pruned_meanwhile(checkpoint):
        if checkpoint.step == 300:  # pruned as it is read; the run's newest is now 200
            checkpoint.path.rename(checkpoint.path.parent / ".tmp-pruned-step-00000300")
        check_whole(checkpoint, "RUN_DIR_OR_CHECKPOINT", read_all=True)
        read.append(checkpoint.step)
        return checkpoint.step

    assert read_checkpoint(run_dir, "RUN_DIR_OR_CHECKPOINT", pruned_meanwhile) == 200
    assert read == [200]
    named = run_dir / "checkpoints" / "step-00000200"

    def gone(checkpoint):
        checkpoint.path.rename(checkpoint.path.parent / ".tmp-pruned-step-00000200")
        return check_whole(checkpoint, "RUN_DIR_OR_CHECKPOINT", read_all=True)

    with pytest.raises(ConfigError, match=rf"RUN_DIR_OR_CHECKPOINT={named} was removed while it "
                                          r"was read: a launch training in its run dir prunes"):
        read_checkpoint(named, "RUN_DIR_OR_CHECKPOINT", gone)
    # A damaged checkpoint that stays where it is: its own message, no second look.
    with pytest.raises(ConfigError, match="is broken"):
        read_checkpoint(run_dir, "RUN_DIR_OR_CHECKPOINT",
                        lambda c: check_whole(store.Checkpoint(tmp_path, 1, {}), "X"))

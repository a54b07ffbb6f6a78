"""A resume reads the tokens its checkpoint trained on (checkpoint/resume.py check_same_data): the
token dirs' fingerprints in the checkpoint's meta.json against the data the resume names. The
same tokens copied to another place may be read from there (data.path=NEW on --resume); other
tokens, at a new place or prepared again at the old one, are refused with exit 2."""

import shutil

import numpy as np
import pytest
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.resume import check_data_there, check_resumable
from partrain.data.sampler import data_fingerprints
from partrain.data.tokens import fingerprint
from partrain.errors import ConfigError
from tests.unit.checkpoint.builders import write_checkpoint
from tests.unit.cli.hostile import write_tokens
from tests.unit.helpers import one_line, validated

OTHER = np.arange(600) % 100  # other tokens, the same count: only the shard's bytes differ


def _tokens(cfg_path: str, blend=None) -> tuple:
    data = (f"+data.blend=[{', '.join(f'{{path: {p}, weight: 1}}' for p in blend)}]",) \
        if blend else (f"data.path={cfg_path}",)
    return ("data.source=tokens", *data)


def _checkpoint(tmp_path, *overrides, record=True) -> store.Checkpoint:
    """A run's checkpoint at step 100 trained on `overrides`' data, with the fingerprints the
    checkpointer records (or, `record=False`, as saved before it recorded them)."""
    cfg, _, _ = validated(*overrides)
    meta = {"step": 100, "reason": "every"}
    if record:
        meta["data"] = data_fingerprints(cfg.data)
    write_checkpoint(tmp_path / "run" / "checkpoints", 100, OmegaConf.to_yaml(cfg), meta=meta)
    return store.newest(tmp_path / "run" / "checkpoints")


def _resume(checkpoint, *overrides) -> list[str]:
    cfg, _, _ = validated(*overrides)
    return check_resumable(checkpoint, cfg)


def _refusal(checkpoint, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        _resume(checkpoint, *overrides)
    return one_line(str(e.value))


def test_the_fingerprint_is_the_dirs_tokens_not_its_place(tmp_path):
    a = write_tokens(tmp_path / "a")
    copy = shutil.copytree(a, tmp_path / "copy")
    (copy / "notes.txt").write_text("not the data's\n")
    assert fingerprint(copy) == fingerprint(a)
    assert fingerprint(write_tokens(tmp_path / "other", train=OTHER)) != fingerprint(a)
    (copy / "tokenizer.json").write_text("{}")
    assert fingerprint(copy) != fingerprint(a)


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "saved-before-the-record"])
def test_the_same_tokens_at_a_new_place_resume(tmp_path, record):
    a = write_tokens(tmp_path / "a")
    checkpoint = _checkpoint(tmp_path, *_tokens(a), record=record)
    moved = shutil.copytree(a, tmp_path / "moved")
    assert _resume(checkpoint, *_tokens(a)) == []
    assert _resume(checkpoint, *_tokens(moved)) == [f"data.path {a} -> {moved} (the same tokens)"]
    shutil.rmtree(a)
    if record:
        assert _resume(checkpoint, *_tokens(moved)) == [
            f"data.path {a} -> {moved} (the same tokens)"]
    else:  # nothing left to compare with
        message = _refusal(checkpoint, *_tokens(moved))
        assert (f"data.path differs from the checkpoint at step 100 ({checkpoint.path}), which "
                f"was saved before partrain recorded what its data holds, and {a} cannot be "
                "read to compare: put the token dir back there") in message


def test_other_tokens_are_refused_at_a_new_place_and_at_the_old_one(tmp_path):
    a = write_tokens(tmp_path / "a")
    checkpoint = _checkpoint(tmp_path, *_tokens(a))
    other = write_tokens(tmp_path / "other", train=OTHER)
    message = _refusal(checkpoint, *_tokens(other))
    assert (f"data.path={other} holds other tokens than the checkpoint at step 100 "
            f"({checkpoint.path}) trained on") in message
    assert f"start a new run: model.init_from={checkpoint.path}" in message
    shutil.rmtree(a)
    write_tokens(a, train=OTHER)  # prepared again in place
    assert f"data.path={a} holds other tokens" in _refusal(checkpoint, *_tokens(a))


def test_a_move_with_another_change_of_the_data_is_still_refused(tmp_path):
    a = write_tokens(tmp_path / "a")
    checkpoint = _checkpoint(tmp_path, *_tokens(a))
    moved = shutil.copytree(a, tmp_path / "moved")
    message = _refusal(checkpoint, *_tokens(moved), "data.sampling=epochs")
    assert f"data.path={moved} differs from {a} in the checkpoint at step 100" in message


def test_a_blend_source_may_move(tmp_path):
    a, b = write_tokens(tmp_path / "a"), write_tokens(tmp_path / "b", train=OTHER)
    checkpoint = _checkpoint(tmp_path, *_tokens("", blend=[a, b]))
    moved = shutil.copytree(b, tmp_path / "moved")
    assert _resume(checkpoint, *_tokens("", blend=[a, moved])) == [
        f"data.blend[1].path {b} -> {moved} (the same tokens)"]
    assert "data.blend[0].path=" in _refusal(checkpoint, *_tokens("", blend=[b, a]))


def test_a_resume_whose_data_is_gone_says_how_to_give_its_new_place(tmp_path):
    from partrain.launch.rundir import write_run_dir

    cfg, _, _ = validated(*_tokens(tmp_path / "gone"))
    run_dir = write_run_dir(cfg, tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        check_data_there(cfg, run_dir)
    assert str(e.value) == (
        f"data.path={tmp_path / 'gone'} does not exist: this run trained on it. If the token dir "
        f"moved, give its new place: `partrain launch --resume {run_dir} "
        "data.path=NEW`; the resume checks that it holds the same tokens")
    # A new place given that does not exist either is not what the run trained on: the data's
    # own check names it.
    check_data_there(validated(*_tokens(tmp_path / "typo"))[0], run_dir)
    check_data_there(validated()[0], run_dir)  # the standard library's source


def test_the_checkpointer_records_the_fingerprints(tmp_path):
    """What the checkpointer puts in meta.json (checkpointer.Checkpointer.data), without a
    process group: the fingerprints of the frozen config's token dirs."""
    from partrain.checkpoint.checkpointer import Checkpointer

    a = write_tokens(tmp_path / "a")
    cfg, _, _ = validated(*_tokens(a))
    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.config_yaml, checkpointer._data = OmegaConf.to_yaml(cfg), False
    assert checkpointer.data() == [fingerprint(a)]


def test_an_old_relative_data_path_read_from_elsewhere_says_where_to_resume(tmp_path,
                                                                           monkeypatch):
    """A checkpoint saved before paths were frozen absolute, with data.path as typed (relative)
    and no fingerprints: resumed from another directory with the true place given, it cannot
    compare, and says that the run's path was relative to where the run was launched."""
    monkeypatch.chdir(tmp_path)
    write_tokens(tmp_path / "a")
    checkpoint = _checkpoint(tmp_path, *_tokens("a"), record=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    message = _refusal(checkpoint, *_tokens(tmp_path / "a"))
    assert ("which was saved before partrain recorded what its data holds, with a as typed: "
            "relative to the directory the run was launched in, not this one. Resume from that "
            "directory without data.path") in message
    monkeypatch.chdir(tmp_path)
    assert _resume(checkpoint, *_tokens("a")) == []

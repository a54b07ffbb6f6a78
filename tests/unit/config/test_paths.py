"""Paths in a config (config/paths.py): checked and named as typed, read from the directory the
command runs in, frozen absolute in the run dir (so that a resume typed elsewhere reads the same
files), and compared absolute between a run dir, its checkpoints and a new command."""

import os

import pytest
from omegaconf import OmegaConf

from partrain.config.paths import with_anchored_paths
from partrain.data.tokens import check_data
from partrain.errors import ConfigError
from tests.unit.helpers import quick, resolved


def test_relative_paths_are_frozen_absolute_and_the_rest_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = quick("data.source=tokens", "data.path=tokens/../web", "model.init_from=hf:models/llama",
                "parallel.offload_nvme_path=/nvme", "+data.blend=[{path: code, weight: 1}]")
    frozen = with_anchored_paths(cfg)
    assert frozen.data.path == str(tmp_path / "web")
    assert frozen.model.init_from == f"hf:{tmp_path / 'models' / 'llama'}"
    assert frozen.parallel.offload_nvme_path == "/nvme"
    assert frozen.data.blend[0].path == str(tmp_path / "code")
    assert frozen.parallel.deepspeed_config is None
    # The config the checks ran on keeps what was typed.
    assert (cfg.data.path, cfg.data.blend[0].path) == ("tokens/../web", "code")
    assert with_anchored_paths(frozen) == frozen


def test_a_missing_relative_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_data(quick("data.source=tokens", "data.path=tokens"))
    assert str(info.value) == ("data.path=tokens is not a directory: it does not exist (a "
                               f"relative path is read from the current directory, {tmp_path})")
    with pytest.raises(ConfigError) as info:
        check_data(quick("data.source=tokens", f"data.path={tmp_path / 'tokens'}"))
    assert "current directory" not in str(info.value)


def test_a_run_dir_frozen_with_paths_as_typed_is_the_same_config(tmp_path, monkeypatch):
    """A run dir written before paths were frozen absolute holds data.path as typed: the same
    command in the same directory still joins it, as it did."""
    from partrain.launch.rundir import check_run_dir, write_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokens").mkdir()
    cfg, _, _ = resolved("data.source=tokens", "data.path=tokens")
    run_dir = write_run_dir(cfg, tmp_path / "run")
    assert OmegaConf.load(run_dir / "config.yaml").data.path == str(tmp_path / "tokens")
    check_run_dir(run_dir, cfg)  # joined: the same config
    old = OmegaConf.load(run_dir / "config.yaml")
    old.data.path = "tokens"
    OmegaConf.save(old, run_dir / "config.yaml")
    check_run_dir(run_dir, cfg)
    other, _, _ = resolved("data.source=tokens", f"data.path={tmp_path / 'other'}")
    with pytest.raises(ConfigError, match="holds another config"):
        check_run_dir(run_dir, other)
    old.data.path = str(tmp_path / "tokens")  # as written today: typed elsewhere, the same
    OmegaConf.save(old, run_dir / "config.yaml")  # text names another directory
    os.chdir(tmp_path / "tokens")
    with pytest.raises(ConfigError, match="holds another config"):
        check_run_dir(run_dir, cfg)

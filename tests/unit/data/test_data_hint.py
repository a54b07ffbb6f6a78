"""data.path that names text still to be tokenized says the `partrain data prepare` command to
run, with its paths (data/tokens.py check_data): exit 2, one line, nothing started."""

import shlex

import pytest

from partrain.data.tokens import check_data
from partrain.errors import ConfigError
from tests.unit.helpers import quick


def _refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        check_data(quick(*overrides))
    return str(info.value)


@pytest.mark.parametrize("name, what", [
    ("corpus.jsonl", "a JSON Lines file"), ("corpus.txt", "a text file"),
    ("corpus.parquet", "a Parquet file"), ("corpus.json", "a JSON file"),
    ("corpus", "a file"),
])
def test_a_raw_file_gets_the_prepare_command(tmp_path, name, what):
    raw = tmp_path / name
    raw.write_text('{"text": "hello"}\n')
    message = _refusal("data.source=tokens", f"data.path={raw}")
    out = tmp_path / "corpus-tokens"
    assert f"data.path={raw} is {what}, not a token dir" in message
    assert f"`partrain data prepare {raw} --out {out}`" in message
    assert f"then data=tokens data.path={out}" in message


def test_a_directory_of_raw_files_gets_it_too(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "part-0.jsonl").write_text("{}\n")
    message = _refusal("data.source=tokens", f"data.path={tmp_path / 'raw'}")
    assert "a directory of text files" in message
    assert f"partrain data prepare {tmp_path / 'raw'} --out {tmp_path / 'raw-tokens'}" in message


def test_a_path_with_a_space_is_quoted(tmp_path):
    raw = tmp_path / "my corpus.jsonl"
    raw.write_text("{}\n")
    message = _refusal("data.source=tokens", f"data.path={raw}")
    assert f"partrain data prepare {shlex.quote(str(raw))} --out" in message


def test_a_file_inside_a_token_dir_names_the_dir(tmp_path):
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "train.bin").write_bytes(b"")
    message = _refusal("data.source=tokens", f"data.path={tmp_path / 'train.bin'}")
    assert f"give the directory: data=tokens data.path={tmp_path}" in message


def test_a_path_the_stdlib_source_would_ignore_is_refused(tmp_path):
    """Without data=tokens, data.path used to be ignored and the run trained on the stdlib."""
    raw = tmp_path / "corpus.jsonl"
    raw.write_text("{}\n")
    assert "partrain data prepare" in _refusal(f"data.path={raw}")
    assert "data.source=stdlib does not read it" in _refusal(f"data.path={tmp_path / 'tok'}")


def test_the_cli_says_it_on_one_line(run_main, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello"}\n')
    result = run_main("launch", "--dry-run", "data=tokens", "data.path=corpus.jsonl",
                      "--run-dir", "run")
    assert result.code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "`partrain data prepare corpus.jsonl --out corpus-tokens`" in lines[0]
    assert not (tmp_path / "run").exists()

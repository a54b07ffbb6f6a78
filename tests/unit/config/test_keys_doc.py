"""Config keys are documented once, in the schema's field docstrings: every key and section has
its help, and docs/config-keys.md is exactly what the schema renders (it fails on drift)."""

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from partrain.config import schema
from partrain.config.keys import (
    REGENERATE,
    SCHEMA_KEYS,
    field_docs,
    key_table,
    render_markdown,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "config-keys.md"
SCHEMA_CLASSES = [cls for cls in vars(schema).values()
                  if dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__]


def test_every_field_has_help():
    missing = [f"{cls.__name__}.{name}" for cls in SCHEMA_CLASSES
               for name, text in field_docs(cls).items() if not text.strip()]
    assert not missing, (f"schema fields without a docstring (the string on the line after the "
                         f"field, saying what it means and its unit): {missing}")


def test_key_table_is_the_schema():
    table = key_table()
    assert [row.key for row in table] == list(SCHEMA_KEYS)
    assert all(row.help and row.type for row in table)
    rows = {row.key: row for row in table}
    assert rows["parallel.dp"].default == "auto"
    assert rows["train.global_batch_size"][1:3] == ("int or null", None)
    assert rows["parallel.pp_layers"].type == "list of int or null"
    assert rows["parallel.deepspeed"][1:3] == ("mapping", {})
    assert rows["model.moe.norm_topk"][1:3] == ("bool", True)


def test_defaults_are_the_structured_configs():
    """The table's defaults are what OmegaConf builds from the schema (the docstrings change
    nothing there)."""
    base = OmegaConf.structured(schema.Config)
    for row in key_table():
        value = OmegaConf.select(base, row.key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        assert value == row.default, row.key


def test_rendered_cells_stay_in_their_column():
    for line in render_markdown().splitlines():
        if line.startswith("| `"):
            assert line.replace("\\|", "").count("|") == 5, line


def test_docs_key_table_is_current():
    assert DOC.exists(), f"{DOC} is missing: regenerate it with `{REGENERATE}`"
    assert DOC.read_text() == render_markdown(), (
        f"docs/config-keys.md differs from partrain/config/schema.py's docstrings: regenerate "
        f"it with `{REGENERATE}`")


def test_show_keys_lists_every_key_with_its_help(run_main):
    """`partrain show --keys` prints the same table the docs are generated from."""
    result = run_main("show", "--keys")
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    table = key_table()
    assert len(lines) == len(table)
    for line, row in zip(lines, table):
        assert line.startswith(f"{row.key} ({row.type}, default ") and line.endswith(row.help)


def test_show_keys_takes_no_config(run_main):
    result = run_main("show", "--keys", "parallel.tp=2")
    assert result.code == 2
    assert "--keys" in result.stderr and "parallel.tp=2" in result.stderr

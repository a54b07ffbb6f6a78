"""Fixtures for the unit tests: run the CLI in-process through `partrain.cli.main` (the entry
point that turns ConfigError into exit code 2)."""

import sys

import pytest

from tests.unit.helpers import CliResult


@pytest.fixture
def run_main(monkeypatch, capsys):
    """Run `partrain ARGS...` in this process as the console script does: main() with sys.argv."""
    from partrain.cli import main

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["partrain", *args])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


# Two small text files to prepare a token dir from (test_data_prepare.py, test_data_tokens.py).
@pytest.fixture
def text_files(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes(("first file, with some text é\n" * 40).encode())
    b.write_bytes(b"second file\x00\xff bytes too\n" * 30)
    return [a, b]

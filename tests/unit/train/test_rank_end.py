"""How a rank's process ends when its training raises (train/rank.py): exit code 1, its
traceback on stderr, except for a Ctrl-C, which the launcher reports once for every rank (a
Ctrl-C as a restart began printed each rank's KeyboardInterrupt traceback to the terminal)."""

import os
import subprocess
import sys

import pytest

RAISES = """
import sys
import partrain.train.rank as rank

def main(*args, **kwargs):
    raise {error}("from the test")

rank.main = main
rank.run(sys.argv[1])
"""


@pytest.mark.parametrize("error, traceback", [("KeyboardInterrupt", False),
                                              ("RuntimeError", True)])
def test_a_rank_that_raises_exits_1_and_prints_its_traceback_unless_interrupted(
        tmp_path, error, traceback):
    (tmp_path / "logs").mkdir()
    done = subprocess.run([sys.executable, "-c", RAISES.format(error=error), str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0"})
    assert done.returncode == 1, done.stderr
    assert ("Traceback (most recent call last)" in done.stderr) == traceback, done.stderr

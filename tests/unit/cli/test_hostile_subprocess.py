"""Hostile input run as a user runs it: a few refusals of test_hostile_io.py's kinds as real
`python -m partrain` subprocesses, all started at once. The contract and the checks are
test_hostile.py's (tests/unit/cli/hostile.py).
"""

import os
import threading

import numpy as np
import pytest

from tests.unit.helpers import finish, start_cli
from tests.unit.cli.hostile import (
    ENV_PREFIXES,
    RECIPE_HEAD,
    Ctx,
    assert_refused,
    assert_untouched,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    tree,
)

# ------------------------------------------------------------------------------------------------
# As a user runs it: `python -m partrain` in a subprocess, all started at once


def _bomb_yaml(c: Ctx) -> str:
    """600 bytes of YAML whose aliases expand to 10**9 list items, inside parallel.deepspeed
    (the one key that takes anything)."""
    lines = [RECIPE_HEAD.rstrip("\n"), "parallel:", "  zero_stage: 1", "  deepspeed:",
             "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return c.file("bomb.yaml", "\n".join(lines) + "\n")


SUBPROCESS_CASES = {
    # OmegaConf's grammar printed a UserWarning with its source path before the error line
    "show-env-interpolation-with-an-empty-default": (
        lambda c: ["show", "name=${oc.env:PARTRAIN_TEST_UNSET_X,}"],
        ["name=''", "plain name"], None),
    "launch-bad-value-with-run-dir": (
        lambda c: ["launch", "optim.lr=nan", "--run-dir", c.path("run")],
        ["optim.lr=nan", "finite"], None),
    "show-non-utf8-config": (
        lambda c: ["show", c.file("latin1.yaml", RECIPE_HEAD.encode() + b"name: caf\xe9\n")],
        ["latin1.yaml", "not UTF-8", "0xe9"], None),
    "launch-nproc-per-node-abc": (
        lambda c: ["launch", "--nproc-per-node", "abc", "--run-dir", c.path("run")],
        ["--nproc-per-node", "'abc'", "whole number"], None),
    "launch-run-dir-under-a-file": (
        lambda c: ["launch", "--run-dir", c.file("afile") + "/run"],
        ["--run-dir", "afile/run", "is a file"], None),
    "launch-lying-token-dir": (
        lambda c: ["launch", "data=tokens", "--run-dir", c.path("run"), "data.path=" + c.tokens(
            "tok", dtype="uint16", vocab=256, train=np.arange(600))],
        ["data.path=", "token id 599", "vocab_size=256"], None),
    "prepare-out-under-a-file": (
        lambda c: ["data", "prepare", c.text(), "--out", c.file("afile") + "/out"],
        ["--out", "afile/out", "is a file"], None),
    "launch-node-rank-1-bad-endpoint-with-local-addr": (
        lambda c: ["launch", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                   "127.0.0.1:70000", "--local-addr", "127.0.0.1", "parallel.dp=4",
                   "launcher.rdzv_timeout_s=5", "--run-dir", c.path("run")],
        ["--rdzv-endpoint", "127.0.0.1:70000", "1..65535"], None),
    "show-yaml-alias-bomb": (
        lambda c: ["show", _bomb_yaml(c)],
        ["bomb.yaml", "100,000 values", "aliases"], None),
}
SUBPROCESS_TIMEOUT_S = 60
BOMB_TIMEOUT_S = 30
SUBPROCESS_TEST = "test_refused_as_a_user_runs_it"


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
    """The selected subprocess cases, all started when the module starts so that they run beside
    each other: each with its inputs in its own directory (its cwd and TMPDIR), and killed at its
    deadline. Their tests, below, collect the results."""
    cases = [item.callspec.params["case"] for item in request.session.items
             if getattr(item, "originalname", None) == SUBPROCESS_TEST]
    procs, timers = {}, []
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(ENV_PREFIXES):
                mp.delenv(name)
        for case in cases:
            root = tmp_path_factory.mktemp(case)
            (root / "systmp").mkdir()
            mp.setenv("TMPDIR", str(root / "systmp"))
            argv = SUBPROCESS_CASES[case][0](Ctx(root, mp))
            before = tree(root)
            proc = start_cli(*argv, cwd=root)
            timer = threading.Timer(BOMB_TIMEOUT_S if "bomb" in case else SUBPROCESS_TIMEOUT_S,
                                    proc.kill)
            timer.daemon = True
            timer.start()
            timers.append(timer)
            procs[case] = (proc, root, before)
    yield procs
    for timer in timers:
        timer.cancel()
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=[pytest.mark.xfail(strict=True, reason=xfail)] if xfail else [])
    for case, (_, _, xfail) in SUBPROCESS_CASES.items()])
def test_refused_as_a_user_runs_it(case, started):
    """A process killed at its deadline exits -9, which fails like any other wrong code."""
    proc, root, before = started[case]
    result = finish(proc, timeout=SUBPROCESS_TIMEOUT_S + 10)
    assert_refused(result, SUBPROCESS_CASES[case][1])
    assert_untouched(root, before)

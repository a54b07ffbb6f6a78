"""SIGTERM to the launcher during a save (a scheduler's kill, a user's `kill`): every worker stops,
exit 130, and the save under way is not committed: the previous checkpoint stays the newest, byte
for byte, and reads back; `partrain launch --resume` removes what the save left and goes on from
it, ending as a run that nothing interrupted. The test hook PARTRAIN_TEST_SAVE_PAUSE
(checkpoint/checkpointer.py) holds the moment: a rank sleeps once it has written the first file
of its part, or with every part and DCP's .metadata written, before the commit; with
checkpoint.async_save the write is a background thread's, and training goes on meanwhile."""

import hashlib
import re
import signal
import time

import pytest

from tests.integration.conftest import CLI, processes_mentioning, read_metrics

COMMON = ("launcher.device=cpu", "parallel.dp=2", "train.seq_len=64", "train.eval_every=0",
          "train.max_steps=8", "checkpoint.every=2", "checkpoint.keep=10")
PAUSE = "PARTRAIN_TEST_SAVE_PAUSE"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run with nothing in its way: its steps."""
    cli = CLI()
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    try:
        res = cli.run("launch", *COMMON, "--run-dir", str(run_dir))
    finally:
        cli.kill_all()
    assert res.returncode == 0, res.stderr[-2000:]
    return read_metrics(run_dir)[0]


def _files(path) -> dict[str, str]:
    """Every file under `path` with a digest of its bytes."""
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def _wait_for_pause(proc, log, tmp, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and f"{PAUSE}: rank" in log.read_text() and tmp.is_dir():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"the save pause ({log}) not within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("where, extra", [
    pytest.param("0:4:after", (), id="written-not-committed"),
    pytest.param("1:4:during", (), id="part-written"),
    pytest.param("0:4:during", ("checkpoint.async_save=true",), id="async-part-written"),
])
def test_sigterm_mid_save_keeps_the_previous_checkpoint(cli, tmp_path, uninterrupted, where,
                                                         extra):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from partrain.checkpoint import store
    from partrain.checkpoint.verify import problems

    run_dir = tmp_path / "run"
    root = run_dir / store.CHECKPOINTS
    tmp = store.tmp_dir(root, 4)
    proc = cli.start("launch", *COMMON, *extra, "--run-dir", str(run_dir), env={PAUSE: where})
    _wait_for_pause(proc, run_dir / "logs" / f"rank-{where[0]}.log", tmp)
    [previous] = store.committed(root)
    assert previous.step == 2
    before = _files(previous.path)
    written = set(_files(tmp))
    assert written and "meta.json" not in written  # the save is under way
    assert (".metadata" in written) == where.endswith("after"), written

    proc.send_signal(signal.SIGTERM)  # the launcher alone, as `kill PID` does
    stdout, stderr = proc.communicate(timeout=60)
    said = " ".join((stdout + stderr).split())
    assert proc.returncode == 130, said[-3000:]
    assert "interrupted: all workers stopped" in said, said[-3000:]
    assert (f"the newest checkpoint is {previous.path} (step 2); go on from it with partrain "
            f"launch --resume {run_dir}") in said, said[-3000:]
    assert "Traceback" not in said
    assert processes_mentioning(str(run_dir)) == []

    # Committed: the previous checkpoint alone, as it was; the save under way counts for nothing.
    assert [c.step for c in store.committed(root)] == [2]
    assert (root / store.LATEST).read_text() == "step-00000002\n"
    assert not any(re.fullmatch(r"step-0*4", p.name) for p in root.iterdir())
    assert _files(previous.path) == before
    assert problems(previous.path) == []
    dcp_to_torch_save(previous.path, tmp_path / "previous.pt")  # every tensor reads back

    resumed = cli.run("launch", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from step 2" in resumed.stdout
    assert store.leftovers(root) == []
    assert [c.step for c in store.committed(root)] == [2, 4, 6, 8]
    steps = read_metrics(run_dir)[0]
    assert [s["step"] for s in steps] == list(range(1, 9))
    for got, want in zip(steps, uninterrupted):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]

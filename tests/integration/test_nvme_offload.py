"""ZeRO-Infinity's offload to NVMe (parallel.offload_optimizer / offload_params = nvme) with real
DeepSpeed on CPU: its async_io op (libaio) swaps the fp32 partitions, the Adam moments and the
parameters through files under parallel.offload_nvme_path. It trains exactly as offload to the
host does (the same CPU Adam on the same numbers; only where they rest between steps differs), a
checkpoint written under it resumes exactly, and a node that cannot offload there is refused
before DeepSpeed starts, on every rank, with exit 2."""

import re
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.conftest import assert_no_abort, read_metrics

COMMON = ("launcher.device=cpu", "launcher.nproc_per_node=2", "parallel.dp=2",
          "parallel.zero_stage=3", "train.eval_every=0", "train.log_every=1", "train.seq_len=64")
STEPS = 6


# The first test to want the async_io op waits for its build, which on a fresh machine with this
# file run alone (the DeepSpeed ops built beside it) outlasts the suite's 300 s per test.
BUILD_WAIT = pytest.mark.timeout(900)


@pytest.mark.slow
@BUILD_WAIT
def test_nvme_offload_trains_as_host_offload_and_resumes_exactly(cli, tmp_path, deepspeed_aio):
    """Two runs at once on one offload_nvme_path (two jobs on a node), optimizer and parameters
    on the disk, each equal to offload to the host step for step: one straight through, one
    stopped half way with a checkpoint and resumed. Each swaps in a folder of its own, gone
    when it ends."""
    host, straight, halves, swap = (tmp_path / n for n in ("host", "straight", "halves", "nvme"))
    reference = cli.start("launch", "--run-dir", str(host), *COMMON, f"train.max_steps={STEPS}",
                          "parallel.offload_optimizer=cpu", "checkpoint.every=0",
                          "checkpoint.save_last=false")
    nvme = (*COMMON, "parallel.offload_optimizer=nvme", "parallel.offload_params=nvme",
            f"parallel.offload_nvme_path={swap}")
    first = cli.start("launch", "--run-dir", str(straight), *nvme, f"train.max_steps={STEPS}",
                      "checkpoint.every=0", "checkpoint.save_last=false")
    second = cli.start("launch", "--run-dir", str(halves), *nvme,
                       f"train.max_steps={STEPS // 2}", f"checkpoint.every={STEPS // 2}")
    outputs = []
    for proc in (reference, first, second):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        outputs.append(out + err)
    resumed = cli.run("launch", "--resume", str(halves), f"train.max_steps={STEPS}", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected = read_metrics(host)[0]
    for run_dir in (straight, halves):
        got = read_metrics(run_dir)[0]
        assert [r["step"] for r in got] == list(range(1, STEPS + 1)), run_dir.name
        for want, have in zip(expected, got):
            for key in ("loss", "grad_norm"):
                assert have[key] == pytest.approx(want[key], rel=1e-6, abs=0), \
                    (run_dir.name, have["step"], key)
        log = (run_dir / "logs" / "rank-1.log").read_text()
        assert f"offload to nvme: the swap files in {swap}/{run_dir.name}-" in log
        assert_no_abort(run_dir, *outputs, resumed.stdout + resumed.stderr)
    assert swap.is_dir() and not list(swap.iterdir())  # each run's folder removed at its end
    # The two runs swapped at the same time (else sharing one folder would go unseen): each
    # one's span from its swap folder's announcement to its first launch's last step overlaps
    # the other's.
    spans = [_swap_span(straight, STEPS), _swap_span(halves, STEPS // 2)]
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans


def _swap_span(run_dir, last_step: int) -> tuple[datetime, datetime]:
    """When rank 0 of the run's first launch announced its swap folder, and logged `last_step`."""
    start = end = None
    for line in (run_dir / "logs" / "rank-0.log").read_text().splitlines():
        stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) rank0 (.*)", line)
        if not stamp:
            continue
        when = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f")
        if start is None and stamp[2].startswith("offload to nvme: the swap files in"):
            start = when
        if end is None and re.match(rf"step +{last_step} ", stamp[2]):
            end = when
    assert start and end, f"{run_dir.name}: no swap announcement or step {last_step} in rank 0's log"
    return start, end


def test_nvme_path_that_cannot_be_written_is_refused_on_every_rank(cli, tmp_path):
    """The path is checked on each node when the ranks start (it is node-local): a path under a
    file is refused before DeepSpeed builds anything (no libaio needed), exit 2, no traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    result = cli.run("launch", "--run-dir", str(run_dir), *COMMON, "train.max_steps=2",
                     "parallel.offload_optimizer=nvme",
                     f"parallel.offload_nvme_path={blocker / 'nvme'}")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert (f"error: parallel.offload_optimizer=nvme: parallel.offload_nvme_path={blocker / 'nvme'}"
            " (this run's folder in it, run-") in out and "cannot be made or written" in out
    assert "Not a directory" in out and "Traceback" not in out
    assert not (run_dir / "metrics.jsonl").exists()
    assert_no_abort(run_dir, out)


def _one_rank_cannot(rank: int, world_size: int, root: str) -> None:
    from omegaconf import OmegaConf

    from partrain.parallel.zero import OffloadUnavailable, check_nvme_offload

    parallel = OmegaConf.create({"offload_optimizer": "nvme", "offload_params": "none",
                                 "offload_nvme_path": root})
    # rank 1's node cannot make its folder (a file where a directory should be); rank 0's can
    folder = Path(root) / ("swap" if rank == 0 else "a-file/swap")
    with pytest.raises(OffloadUnavailable) as refused:
        check_nvme_offload(parallel, "cpu", folder)
    if rank == 0:
        assert "a rank on another node cannot offload to nvme" in str(refused.value)
    else:
        assert "cannot be made or written" in str(refused.value)


@pytest.mark.slow  # the async_io op's build: 150 s on a fresh machine
@BUILD_WAIT
def test_a_rank_that_cannot_offload_stops_the_others_too(tmp_path, deepspeed_aio):
    """Two real gloo ranks, as on two nodes (the path is node-local): one cannot write its
    folder, the other can (libaio here, so its own check passes) and is refused all the same,
    saying that another rank's node is the cause, instead of going on alone into DeepSpeed's
    collectives and waiting there until the timeout."""
    from tests.distributed.helpers import run_distributed

    (tmp_path / "a-file").write_text("")
    run_distributed(_one_rank_cannot, 2, str(tmp_path))

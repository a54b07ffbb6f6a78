"""A save is committed only when rank 0 finds every file of it (partrain/checkpoint/verify.py), on
real gloo processes and real DCP: two ranks whose run dirs are not the same directory (node-local
disks) fail the save, naming the file rank 1 wrote elsewhere, and commit nothing; the same ranks
with one shared run dir commit."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from partrain.checkpoint import store
from partrain.checkpoint.checkpointer import Checkpointer
from tests.distributed.helpers import run_distributed

CKPT = SimpleNamespace(every=1, keep=2, save_last=True, async_save=False)


def _save(run_dir, step: int) -> Checkpointer:
    rank = dist.get_rank()
    checkpointer = Checkpointer(run_dir, CKPT, "name: test\n", report=lambda record: None)
    # A tensor of each rank's own, so that each rank writes a file.
    state = {f"model.rank{rank}": torch.full((64,), float(rank)), "model.shared": torch.ones(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpointer.save(state, step, "every")
    return checkpointer


def _check(rank, world_size, tmp):
    from pathlib import Path

    tmp = Path(tmp)
    local = tmp / f"node{rank}"  # each rank its own directory, as node-local run dirs are
    if rank == 0:
        with pytest.raises(RuntimeError) as refused:
            _save(local, 3)
        message = str(refused.value)
        assert "checkpoint of step 3 is not committed" in message, message
        assert "__1_0.distcp is missing, written by rank 1" in message, message
        assert "same path (--run-dir)" in message and "is still none" in message, message
        assert store.newest(local / store.CHECKPOINTS) is None
        assert store.leftovers(local / store.CHECKPOINTS)  # cleaned at the next start
    else:
        _save(local, 3)  # ranks other than 0 never commit: DCP's save returned
    dist.barrier()
    shared = tmp / "shared"
    _save(shared, 3)
    dist.barrier()
    newest = store.newest(shared / store.CHECKPOINTS)
    assert newest is not None and newest.step == 3


def test_a_save_that_rank_0_cannot_see_whole_is_not_committed(tmp_path):
    run_distributed(_check, 2, str(tmp_path))


def _nonfinite(rank, world_size, tmp):
    from pathlib import Path

    run_dir = Path(tmp)
    records = []
    checkpointer = Checkpointer(run_dir, CKPT, "name: test\n", report=records.append)
    good = {f"model.rank{rank}": torch.full((64,), float(rank)), "model.shared": torch.ones(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert checkpointer.save(good, 2, "every")
        # Rank 1's moments hold a NaN: no rank writes, nothing is committed, step 2 stays newest.
        bad = dict(good, **{"optim.exp_avg.model.shared": torch.tensor([0.0, float("nan")])
                            if rank == 1 else torch.zeros(2)})
        assert not checkpointer.save(bad, 4, "every")
    dist.barrier()
    root = run_dir / store.CHECKPOINTS
    assert [c.step for c in store.committed(root)] == [2]
    assert not store.leftovers(root)  # not even begun
    if rank == 0:
        refused = records[-1]
        assert refused["step"] == 4
        assert refused["checkpoint_refused"] == "optim.exp_avg.model.shared on rank 1 is not finite"
        assert refused["newest"].endswith(store.step_dir_name(2)), refused


def test_a_state_holding_a_nan_is_never_committed(tmp_path):
    run_distributed(_nonfinite, 2, str(tmp_path))


def _unsummed(rank, world_size, tmp):
    """Rank 1's crc32 file never appears (lost; a network file system that never shows it):
    the save fails on rank 0 with what is missing, is discarded, and the step before stays."""
    from pathlib import Path

    from partrain.checkpoint import checkpointer as module
    from partrain.checkpoint import verify

    run_dir = Path(tmp)
    _save(run_dir, 2)
    dist.barrier()
    verify.SUMS_LOOKS = 2
    if rank == 1:
        module.write_sums = lambda directory, sums: None
    if rank == 0:
        with pytest.raises(RuntimeError) as refused:
            _save(run_dir, 4)
        message = str(refused.value)
        assert message.startswith("committing the checkpoint of step 4 failed: NotWhole: no "
                                  "crc32 was kept of __1_0.distcp"), message
        assert "Nothing of it was kept; the newest checkpoint is still" in message, message
    else:
        _save(run_dir, 4)
    dist.barrier()
    root = run_dir / store.CHECKPOINTS
    assert [c.step for c in store.committed(root)] == [2]
    assert not store.leftovers(root)  # discarded at once, not at the next start


def test_a_save_without_every_ranks_crc32s_is_discarded(tmp_path):
    run_distributed(_unsummed, 2, str(tmp_path))

"""Where a start begins (train/assemble.py find_start), on real gloo processes: rank 0 decides and
every rank takes its choice. Each rank is given a run dir (and a model.init_from) of its own here,
as nodes whose views of one directory differ (a network file system that shows a new commit to one
node first, a model.init_from run that commits meanwhile): rank 1 sees a newer checkpoint than
rank 0, and still starts from rank 0's. Looking for the newest on each rank, they started from
different steps and trained on apart without a word."""

from pathlib import Path

from omegaconf import OmegaConf

from partrain.checkpoint import store
from tests.distributed.helpers import run_distributed
from tests.unit.checkpoint.builders import write_checkpoint


def _start(rank, world_size, tmp):
    import torch.distributed as dist

    from partrain.train.assemble import find_start

    tmp = Path(tmp)
    run_dir = tmp / f"view{rank}"
    start = find_start(OmegaConf.create({"model": {"init_from": None}}), run_dir, rank)
    assert start.resume.step == 10, (rank, start.resume)
    assert start.resume.path == tmp / "view0" / store.CHECKPOINTS / "step-00000010"
    assert start.init_from is None and start.hf_from is None
    if rank == 0:  # the killed save's leftover, renamed aside for the checkpointer to delete
        [gone] = start.leftovers
        assert gone.name.startswith(".tmp-gone-") and gone.name.endswith("-step-00000015")
        assert store.leftovers(run_dir / store.CHECKPOINTS) == [gone]
    else:
        assert start.leftovers == []
    init_from = tmp / f"source{rank}"
    start = find_start(OmegaConf.create({"model": {"init_from": str(init_from)}}),
                       tmp / f"new{rank}", rank)
    assert start.resume is None and start.init_from.step == 20, (rank, start.init_from)
    assert start.init_from.path == tmp / "source0" / store.CHECKPOINTS / "step-00000020"
    dist.barrier()


def test_every_rank_starts_from_rank_0s_choice(tmp_path):
    for step in (5, 10):
        write_checkpoint(tmp_path / "view0" / store.CHECKPOINTS, step)
    write_checkpoint(tmp_path / "view0" / store.CHECKPOINTS, 15, name=".tmp-step-00000015")
    for step in (5, 10, 15):
        write_checkpoint(tmp_path / "view1" / store.CHECKPOINTS, step)
    write_checkpoint(tmp_path / "source0" / store.CHECKPOINTS, 20)
    for step in (20, 30):
        write_checkpoint(tmp_path / "source1" / store.CHECKPOINTS, step)
    run_distributed(_start, 2, str(tmp_path))

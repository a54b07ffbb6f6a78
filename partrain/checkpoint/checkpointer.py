"""Saving during training: when, synchronously or in the background, and the commit.

`Checkpointer.save` writes the state of one step with DCP under a temporary name and commits it
(store.commit, on global rank 0) once every rank has written its part. With
`checkpoint.async_save` the copy of the state to memory runs in a background thread too, overlapped
with the next step's forward and backward: the loop waits for it only before the optimizer changes
the parameters again (`staged`). The write runs in another background thread on its own gloo
group (so its collectives never interleave with the training's), and rank 0 commits when it
completes: at a later step boundary, at the next save, or at the end, whichever comes first.
"""

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from partrain.checkpoint import store
from partrain.checkpoint.state import said
from partrain.checkpoint.verify import problems

log = logging.getLogger("partrain")

# Test-only hook: PARTRAIN_TEST_SAVE_PAUSE="RANK:STEP:before|after" makes that rank sleep at that
# step's save, before it writes its part or after every part is written and before the commit,
# so that a test can kill the job mid-save.
PAUSE_ENV = "PARTRAIN_TEST_SAVE_PAUSE"

# Writer threads per rank, as Megatron's torch_dist checkpoints have them: a rank's files are
# written and fsync'ed two at a time. DCP's default of one left a tp2 save of a 75M model at
# 0.74 of every rank's plain torch.save (scripts/bench_checkpoint.py); two bring it to 0.85.
WRITE_THREADS = 2


def storage_writer(path: Path) -> FileSystemWriter:
    """How partrain writes a checkpoint directory (also what the benchmark measures)."""
    return FileSystemWriter(path, thread_count=WRITE_THREADS)


def _test_pause(rank: int, step: int, where: str) -> None:
    if os.environ.get(PAUSE_ENV) == f"{rank}:{step}:{where}":
        log.info("%s: rank %d pauses %s writing step %d", PAUSE_ENV, rank, where, step)
        time.sleep(600)


class Checkpointer:
    def __init__(self, run_dir: Path, ckpt_cfg, config_yaml: str, report):
        """`report(record)` gets one dict per committed save (rank 0: metrics.jsonl, display)."""
        self.root = run_dir / store.CHECKPOINTS
        self.cfg, self.config_yaml, self.report = ckpt_cfg, config_yaml, report
        self.rank = dist.get_rank()
        # Every rank creates the group, in the same place of the flow, as new_group requires.
        self.group = dist.new_group(backend="gloo") if ckpt_cfg.async_save else None
        # Copies on a background thread (no pinned or shared memory: CPU tensors, one process).
        self.stager = (DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=True,
                                                    use_non_blocking_copy=False))
                       if ckpt_cfg.async_save else None)
        self.pending = None  # [future, step, reason, started, blocked_s]
        self.newest: store.Checkpoint | None = None

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.every
        return bool((every and step % every == 0) or (last and self.cfg.save_last))

    def save(self, state: dict, step: int, reason: str, started: float | None = None) -> bool:
        """Write `state` as the checkpoint of `step`. `started`: when the save was asked for (a
        preemption signal), so that the report says how long it took from there to the commit.
        A state holding a NaN or an infinity on any rank is not written (False): the newest
        checkpoint stays the newest good one."""
        self.wait()
        if self._refuse_nonfinite(state, step):
            return False
        started = started or time.time()
        t0 = time.perf_counter()
        path = store.tmp_dir(self.root, step)
        _test_pause(self.rank, step, "before")
        if self.group is not None:
            future = dcp.async_save(state, storage_writer=storage_writer(path),
                                    process_group=self.group, async_stager=self.stager)
            self.pending = [future, step, reason, started, time.perf_counter() - t0]
            return True
        with said(f"saving the checkpoint of step {step} into {path}"):
            dcp.save(state, storage_writer=storage_writer(path))
        self._commit(step, reason, started, blocked_s=time.perf_counter() - t0)
        return True

    def _refuse_nonfinite(self, state: dict, step: int) -> bool:
        """Every rank checks its part of the state; True (and said) when any holds a non-finite
        value."""
        mine = _first_nonfinite(state)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        bad = [(rank, key) for rank, key in enumerate(found) if key is not None]
        if not bad:
            return False
        if self.rank == 0:
            kept = self.newest or store.newest(self.root)
            rank, key = bad[0]
            log.warning("checkpoint of step %d not saved: %s holds a non-finite value on rank %d",
                        step, key, rank)
            self.report({"step": step, "checkpoint_refused": f"{key} on rank {rank} is not finite",
                         "newest": str(kept.path) if kept else None})
        return True

    def staged(self) -> None:
        """Before the optimizer changes the parameters: the background copy of a save must be
        done (the time waiting here counts as blocked)."""
        if self.pending is not None:
            staging = getattr(self.pending[0], "staging_completion", None)
            if staging is not None and not staging.done():
                t0 = time.perf_counter()
                staging.result()
                self.pending[4] += time.perf_counter() - t0

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()

    def poll(self) -> None:
        """At a step boundary: commit a finished background save (rank 0 only needs to)."""
        if self.pending is not None and self.rank == 0 and _done(self.pending[0]):
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written, then commit it."""
        if self.pending is None:
            return
        future, step, reason, started, blocked = self.pending
        self.pending = None
        staging = getattr(future, "staging_completion", None)
        if staging is not None and not staging.done():
            t0 = time.perf_counter()
            staging.result()
            blocked += time.perf_counter() - t0
        with said(f"saving the checkpoint of step {step} (in the background)"):
            _result(future)
        self._commit(step, reason, started, blocked)

    def _commit(self, step: int, reason: str, started: float, blocked_s: float) -> None:
        # DCP's save returns on every rank only after the coordinator (rank 0) has gathered all
        # ranks' write results and written .metadata: on rank 0 everything is on disk here.
        if self.rank != 0:
            return
        _test_pause(self.rank, step, "after")
        written = store.tmp_dir(self.root, step)
        found = problems(written)
        if found:
            # What rank 0 sees is not every rank's save: commit nothing, keep the newest.
            kept = store.newest(self.root)
            raise RuntimeError(
                f"the checkpoint of step {step} is not committed: in "
                f"{written}, {'; '.join(found)}. Every rank must write into "
                "the same run dir: run every node on one shared file system mounted at the same "
                "path (--run-dir). The newest committed checkpoint is still "
                f"{kept.path if kept else 'none'}")
        seconds = time.time() - started
        meta = {"reason": reason, "saved_at": time.time(), "seconds": round(seconds, 4),
                "blocked_s": round(blocked_s, 4), "world_size": dist.get_world_size()}
        self.newest = store.commit(self.root, step, meta, self.config_yaml)
        pruned = store.prune(self.root, self.cfg.keep)
        record = {"step": step, "checkpoint": str(self.newest.path.relative_to(self.root.parent)),
                  "bytes": self.newest.meta["bytes"], "seconds": round(seconds, 4),
                  "blocked_s": round(blocked_s, 4), "reason": reason}
        log.info("saved checkpoint %s: step %d, %s bytes in %.3f s (loop blocked %.3f s)%s",
                 self.newest.path, step, f"{record['bytes']:,}", seconds, blocked_s,
                 f"; removed {', '.join(p.name for p in pruned)}" if pruned else "")
        self.report(record)


def _first_nonfinite(state: dict) -> str | None:
    """The first key of `state` whose (local) tensor holds a NaN or an infinity."""
    for key, value in state.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if (isinstance(value, torch.Tensor) and value.is_floating_point()
                and not torch.isfinite(value).all()):
            return key
    return None


def _done(future) -> bool:
    upload = getattr(future, "upload_completion", future)
    return upload.done()


def _result(future):
    upload = getattr(future, "upload_completion", future)
    return upload.result()

"""Saving during training: when, synchronously or in the background, and the commit.

`Checkpointer.save` writes the state of one step with DCP under a temporary name and commits it
(store.commit, on global rank 0) once every rank has written its part. With
`checkpoint.async_save` the copy of the state to memory runs in a background thread too, overlapped
with the next step's forward and backward: the loop waits for it only before the optimizer changes
the parameters again (`staged`). The write runs in another background thread on its own gloo
group (so its collectives never interleave with the training's), and rank 0 commits when it
completes: at a later step boundary, at the next save, or at the end, whichever comes first.
"""

import errno
import itertools
import logging
import os
import queue
import shutil
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from partrain.checkpoint import store
from partrain.checkpoint.state import failures, out_of_space
from partrain.checkpoint.verify import (
    SHARD,
    NotWhole,
    crc32_of,
    files_of,
    read_whole,
    take_sums,
    write_sums,
)
from partrain.models.family import count_params
from partrain.parallel.dist import attempt, local

log = logging.getLogger("partrain")

# Test-only hook: PARTRAIN_TEST_SAVE_PAUSE="RANK:STEP:before|during|after|prune[:SECONDS]" makes
# that rank sleep (600 s, or SECONDS) at that step's save: before it writes its part, once it has
# written its first file (in the writer, a background thread with checkpoint.async_save), after
# every part is written and before the commit, so that a test can stop the job mid-save, or
# before the background deletion of the checkpoints the commit pruned (a slow file system). It
# fires in the first attempt only (launcher.max_restarts: the restarted run goes on).
PAUSE_ENV = "PARTRAIN_TEST_SAVE_PAUSE"
# Test-only hook: PARTRAIN_TEST_NONFINITE_STATE="RANK" adds a NaN to what that rank saves, in the
# first attempt, so that a test can meet a save refused for a non-finite state.
NONFINITE_STATE_ENV = "PARTRAIN_TEST_NONFINITE_STATE"

# Writer threads per rank, as Megatron's torch_dist checkpoints have them: a rank's files are
# written and fsync'ed two at a time. DCP's default of one left a tp2 save of a 75M model at
# 0.74 of every rank's plain torch.save (scripts/bench_checkpoint.py); two bring it to 0.85.
WRITE_THREADS = 2

# What a checkpoint holds per parameter: the fp32 weight and AdamW's two fp32 moments.
BYTES_PER_PARAM = 12


# Bytes free under which torch's error for a failed write is put down to a full disk: its zip
# writer may lose the OSError of a short write and say only "[enforce fail at
# inline_container.cc] unexpected pos" (an OSError says what it is).
FULL_BELOW = 1 << 20


class _NotingFileSystem(FileSystem):
    """DCP's file system, noting the first error a file's write meets, in whichever thread, and
    saying ENOSPC for a write that failed on a full disk however torch reported it; and the crc32
    of each tensor file, of the bytes as they are written."""

    def __init__(self, after_first_file=None):
        super().__init__()
        self.error: BaseException | None = None
        self.sums: dict[str, str] = {}
        self.after_first_file, self.files = after_first_file, itertools.count(1)

    @contextmanager
    def create_stream(self, path, mode):
        counted = None
        try:
            with super().create_stream(path, mode) as stream:
                counted = _Crc32Stream(stream) if SHARD.fullmatch(Path(path).name) else None
                yield counted or stream
        except Exception as err:
            full = out_of_space(err) or (not isinstance(err, OSError)
                                         and _free(Path(path).parent) < FULL_BELOW)
            noted = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else err
            self.error = self.error or noted
            if noted is err:
                raise
            raise noted from err
        if counted is not None:
            # Read back only if something wrote other than in order (not DCP's way in torch 2.13).
            whole = counted.written == os.path.getsize(path) and not counted.moved
            self.sums[Path(path).name] = counted.hex() if whole else crc32_of(Path(path))
        if next(self.files) == 1 and self.after_first_file is not None:
            self.after_first_file()


class _Crc32Stream:
    """A file DCP writes a rank's tensors into, keeping the crc32 of the bytes as they pass: its
    items are written one after another through write() (torch.save's zip writer included)."""

    def __init__(self, raw):
        self.raw, self.crc, self.written, self.moved = raw, 0, 0, False

    def write(self, data) -> int:
        count = self.raw.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view[:count] if count is not None else view, self.crc)
        self.written += count if count is not None else view.nbytes
        return count

    def seek(self, *args):
        self.moved = True
        return self.raw.seek(*args)

    def hex(self) -> str:
        return f"{self.crc:08x}"

    def __getattr__(self, name):  # tell, fileno, flush: the file's own
        return getattr(self.raw, name)


class _Writer(FileSystemWriter):
    """DCP's FileSystemWriter that fails the save when any of this rank's items was not written.
    DCP's extra write threads end on an error without passing it on: their items are only
    missing from the results, and the coordinator would write a .metadata without them, a
    checkpoint that looks whole and cannot be read. Raised here, the error fails the save on
    every rank, as an error in the first thread does."""

    def __init__(self, path: Path, after_first_file=None):
        super().__init__(path, thread_count=WRITE_THREADS)
        self.fs = _NotingFileSystem(after_first_file)

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        results = {result.index for result in written.wait()}
        lost = sum(item.index not in results for item in plan.items)
        if lost:
            raise self.fs.error or RuntimeError(
                f"{lost} of this rank's {len(plan.items)} items were not written")
        write_sums(Path(self.path), self.fs.sums)
        return written


def _free(path: Path) -> float:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return float("inf")


def storage_writer(path: Path, after_first_file=None) -> FileSystemWriter:
    """How partrain writes a checkpoint directory (also what the benchmark measures)."""
    return _Writer(path, after_first_file)


def _test_pause(rank: int, step: int, where: str) -> None:
    asked = os.environ.get(PAUSE_ENV, "").split(":")
    if not attempt() and asked[:3] == [str(rank), str(step), where]:
        log.info("%s: rank %d pauses %s writing step %d", PAUSE_ENV, rank, where, step)
        time.sleep(float(asked[3]) if len(asked) > 3 else 600)


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
        self.pending = None  # [future, step, reason, started, blocked_s, meta]
        # A cadence save a skipped step (divergence guard) put off: the next good step's.
        self.owed = False
        # Rank 0's deletion of pruned checkpoints: a thread and its queue, started at the first.
        self.deleting: threading.Thread | None = None
        self.deletions: queue.SimpleQueue | None = None
        self.newest: store.Checkpoint | None = None
        self.refused: str | None = None  # why the last save refused was (_refuse_nonfinite)
        self._data: list[str] | None | bool = False  # rank 0's: taken now, before training
        if self.rank == 0:
            self.data()

    def data(self) -> list[str] | None:
        """The fingerprints of the token dirs the run trains on (sampler.data_fingerprints), for
        meta.json: a resume compares them with its data. Taken once; None for the standard
        library's source or where a dir cannot be read now (the resume then has no record)."""
        if self._data is False:
            from partrain.data.sampler import data_fingerprints

            data = OmegaConf.create(self.config_yaml).get("data")
            try:
                self._data = data_fingerprints(data) if data is not None else None
            except OSError as e:
                log.warning("the data's fingerprint is not recorded in the checkpoints: %s", e)
                self._data = None
        return self._data

    def due(self, step: int, last: bool) -> bool:
        return store.saves_at(self.cfg, step, last)

    def save(self, state: dict, step: int, reason: str, started: float | None = None,
             meta: dict | None = None) -> bool:
        """Write `state` as the checkpoint of `step`. `started`: when the save was asked for (a
        preemption signal), so that the report says how long it took from there to the commit;
        `meta`: more for its meta.json (the divergence guard's count of skips in a row).
        A state holding a NaN or an infinity on any rank is not written (False): the newest
        checkpoint stays the newest good one."""
        self.wait()
        if not attempt() and os.environ.get(NONFINITE_STATE_ENV) == str(self.rank):
            state = {**state, "test.nonfinite": torch.tensor(float("nan"))}
        if self._refuse_nonfinite(state, step):
            return False
        started = started or time.time()
        t0 = time.perf_counter()
        path = store.tmp_dir(self.root, step)
        _test_pause(self.rank, step, "before")
        writer = storage_writer(path, lambda: _test_pause(self.rank, step, "during"))
        if self.group is not None:
            with self._undone_on_failure(step, f"saving the checkpoint of step {step}"):
                future = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                        async_stager=self.stager)
            self.pending = [future, step, reason, started, time.perf_counter() - t0, meta]
            return True
        with self._undone_on_failure(step, f"saving the checkpoint of step {step}"):
            dcp.save(state, storage_writer=writer)
        self._commit(step, reason, started, blocked_s=time.perf_counter() - t0, extra=meta)
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
        rank, key = bad[0]
        self.refused = f"{key} on rank {rank} is not finite"  # every rank: the same words
        if self.rank == 0:
            kept = self.newest or store.newest(self.root)
            log.warning("checkpoint of step %d not saved: %s holds a non-finite value on rank %d",
                        step, key, rank)
            self.report({"step": step, "checkpoint_refused": self.refused,
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

    def close(self, preempted: bool = False) -> None:
        """The background save committed, and the deletion of pruned checkpoints waited for at a
        normal end; after a preemption signal not, since the job has only its grace period left
        (what a deletion cut short leaves, the next start removes)."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if not preempted:
            self._deleted()

    def delete_in_background(self, paths: list[Path], step: int = 0) -> None:
        """Delete pruned checkpoints (already renamed out of the committed set, store.prune), or
        what interrupted saves left (renamed aside at the start, store.clean_leftovers), in a
        thread of their own, in order, as torchtitan's purge thread does: removing a large
        checkpoint on a network file system can take minutes, while the other ranks would wait
        for rank 0, in the next step timed by the hang watch (launcher.hang_timeout_s), at the
        start in a collective (launcher.collective_timeout_s)."""
        if self.deleting is None:
            self.deletions = queue.SimpleQueue()
            self.deleting = threading.Thread(target=self._delete, name="partrain-prune",
                                             daemon=True)
            self.deleting.start()
        self.deletions.put((paths, step))

    def _delete(self) -> None:
        while (job := self.deletions.get()) is not None:
            paths, step = job
            _test_pause(self.rank, step, "prune")
            store.remove_trees(paths)

    def _deleted(self) -> None:
        """Wait for every deletion asked for so far."""
        if self.deleting is not None:
            self.deletions.put(None)
            self.deleting.join()
            self.deleting = None

    def poll(self) -> None:
        """At a step boundary: commit a finished background save (rank 0 only needs to)."""
        if self.pending is not None and self.rank == 0 and _done(self.pending[0]):
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written, then commit it."""
        if self.pending is None:
            return
        future, step, reason, started, blocked, extra = self.pending
        self.pending = None
        staging = getattr(future, "staging_completion", None)
        if staging is not None and not staging.done():
            t0 = time.perf_counter()
            staging.result()
            blocked += time.perf_counter() - t0
        with self._undone_on_failure(step, f"saving the checkpoint of step {step} (in the "
                                           "background)"):
            _result(future)
        self._commit(step, reason, started, blocked, extra)

    @contextmanager
    def _undone_on_failure(self, step: int, what: str):
        """A save that fails (DCP's CheckpointException: any rank's write; or rank 0's commit)
        takes what it wrote along: nothing half-written stays, and on a full disk its space is
        back for the ranks' error files (an empty one was all the launcher could read). The
        error says what failed, on which ranks, why, and on a full disk how much room a
        checkpoint needs and how much there is."""
        try:
            yield
        except (CheckpointException, OSError, NotWhole) as err:
            store.discard(self.root, step)
            raise RuntimeError(self._failed(err, what)) from None

    def _failed(self, err: BaseException, what: str) -> str:
        kept = store.newest(self.root)
        newest = (f"the newest checkpoint is still {kept.path} (step {kept.step})" if kept
                  else f"no checkpoint was committed yet in {self.root}")
        if not out_of_space(err):
            return f"{what} failed: {failures(err)}. Nothing of it was kept; {newest}"
        run_dir, need = self.root.parent, self._checkpoint_bytes(kept)
        room = f"a checkpoint of this run needs about {need:,} bytes, " if need else ""
        return (f"{what} failed: the run dir's file system is full: {room}{_free(run_dir):,} "
                f"free at {run_dir} ({failures(err)}). Nothing of it was kept; {newest}. Free "
                f"space there, then relaunch to resume{' from it' if kept else ''}")

    def _checkpoint_bytes(self, kept: store.Checkpoint | None) -> int:
        """About the room a checkpoint of this run takes: the newest committed one's size (every
        save of a run holds the same tensors), or before the first, the model's parameters
        times BYTES_PER_PARAM (DCP adds a little for each tensor)."""
        if kept is not None and kept.meta.get("bytes"):
            return int(kept.meta["bytes"])
        model = OmegaConf.create(self.config_yaml).get("model")
        # The family's count from the config, else (a user's model) what it builds on meta.
        return BYTES_PER_PARAM * count_params(model) if model else 0

    def _commit(self, step: int, reason: str, started: float, blocked_s: float,
                extra: dict | None = None) -> None:
        # DCP's save returns on every rank only after the coordinator (rank 0) has gathered all
        # ranks' write results and written .metadata: on rank 0 everything is on disk here.
        if self.rank != 0:
            return
        _test_pause(self.rank, step, "after")
        written = store.tmp_dir(self.root, step)
        found, metadata = read_whole(written)  # .metadata read once, for both checks
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
                "blocked_s": round(blocked_s, 4), "world_size": dist.get_world_size(),
                **(extra or {})}
        if self.data() is not None:
            meta["data"] = self.data()
        with self._undone_on_failure(step, f"committing the checkpoint of step {step}"):
            meta["files"] = take_sums(written, files_of(metadata))
            self.newest = store.commit(self.root, step, meta, self.config_yaml)
        pruned = store.prune(self.root, self.cfg.keep,
                             lambda paths: self.delete_in_background(paths, step))
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
        value = local(value)
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

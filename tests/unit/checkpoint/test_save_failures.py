"""A save that fails, without a process group: the writer fails a save whose write any of its
threads lost (checkpointer._Writer), the errors are told apart (state.out_of_space, failures), and
the commit leaves no half-written pointer (store). What a full disk does to a whole run is
tests/integration/test_failure.py's business."""

import errno
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from partrain.checkpoint import store
from partrain.checkpoint.checkpointer import WRITE_THREADS, storage_writer
from partrain.checkpoint.state import failures, out_of_space
from partrain.checkpoint.verify import problems


def _state() -> dict[str, torch.Tensor]:
    return {f"model.t{k}": torch.full((1000,), float(k)) for k in range(8)}


@pytest.mark.parametrize("blocked", range(WRITE_THREADS))
def test_a_write_that_any_thread_loses_fails_the_save(tmp_path, blocked):
    """One of the rank's files cannot be written (a directory holds its name). DCP's own writer
    lost the error when its second thread met it and wrote a .metadata without those items: a
    checkpoint that verify calls whole and that cannot be read (about half of these saves). Ours
    fails every time, whichever thread writes the file."""
    for attempt in range(6):
        path = tmp_path / f"save{attempt}"
        path.mkdir()
        (path / f"__0_{blocked}.distcp").mkdir()
        with warnings.catch_warnings(), pytest.raises(CheckpointException) as failed:
            warnings.simplefilter("ignore")
            dcp.save(_state(), storage_writer=storage_writer(path))
        (exc, _), = failed.value.failures.values()
        assert isinstance(exc, IsADirectoryError), exc
        assert not (path / ".metadata").exists()


def test_a_save_that_nothing_stops_is_whole_and_reads_back(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=storage_writer(tmp_path))
        back = {key: torch.zeros(1000) for key in _state()}
        dcp.load(back, checkpoint_id=tmp_path)
    assert problems(tmp_path) == []
    assert all(torch.equal(back[key], value) for key, value in _state().items())


def _raised(make) -> BaseException:
    with pytest.raises((OSError, RuntimeError)) as raised:
        make()
    return raised.value


def _full():
    raise OSError(errno.ENOSPC, "No space left on device")


def _full_then_torch():
    """torch.save's zip writer meets the full disk first, then fails to close the file."""
    try:
        _full()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _quota():
    raise OSError(errno.EDQUOT, "Disk quota exceeded")


def _directory():
    raise IsADirectoryError(errno.EISDIR, "Is a directory")


@pytest.mark.parametrize("make, full", [(_full, True), (_full_then_torch, True), (_quota, True),
                                        (_directory, False)])
def test_a_full_disk_is_told_apart(make, full):
    err = _raised(make)
    assert out_of_space(err) is full
    wrapped = CheckpointException("save", {0: (_raised(_directory), None), 1: (err, None)})
    assert out_of_space(wrapped) is full


def test_failures_group_the_ranks_and_name_the_full_disk_not_torchs_wrapper():
    err = CheckpointException("save", {0: (_raised(_full), None),
                                       1: (_raised(_full_then_torch), None),
                                       2: (_raised(_directory), None)})
    assert failures(err) == ("ranks 0, 1: OSError: [Errno 28] No space left on device; "
                             "rank 2: IsADirectoryError: [Errno 21] Is a directory")


def test_a_commit_whose_latest_cannot_be_written_stands(tmp_path):
    """The rename is the commit: `latest` that cannot be replaced (here a directory holds its
    name) leaves it stale, which readers handle, and no temporary pointer file behind."""
    root = tmp_path / store.CHECKPOINTS
    tmp = store.tmp_dir(root, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=storage_writer(tmp))
    (root / store.LATEST).mkdir()
    (root / store.LATEST / "in-the-way").write_text("")
    committed = store.commit(root, 3, {"reason": "every"}, "name: test\n")
    assert committed.path == root / "step-00000003"
    assert [c.step for c in store.committed(root)] == [3]
    assert store.leftovers(root) == []


def test_discard_removes_a_failed_saves_directory_and_nothing_else(tmp_path):
    root = tmp_path / store.CHECKPOINTS
    for step in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(_state(), storage_writer=storage_writer(store.tmp_dir(root, step)))
    store.commit(root, 2, {"reason": "every"}, "name: test\n")
    store.discard(root, 4)
    store.discard(root, 4)  # every rank of the failed save may call it
    assert sorted(p.name for p in root.iterdir()) == [store.LATEST, "step-00000002"]
    assert problems(root / "step-00000002") == []


@pytest.mark.parametrize("full_fs", [0, 8192, 20480], indirect=True)
def test_a_write_on_a_full_disk_is_said_to_be_one(full_fs):
    """Whether the disk fills before a file, at its start or in its middle, and whether torch's
    zip writer passes the OSError on or only says "unexpected pos", the save's error is ENOSPC."""
    state = {f"model.t{k}": torch.full((4096,), float(k)) for k in range(4)}  # 16 KiB each
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as failed:
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=storage_writer(full_fs / "save"))
    assert out_of_space(failed.value), failed.value.failures
    assert failures(failed.value) == "rank 0: OSError: [Errno 28] No space left on device"


def test_each_file_a_rank_writes_has_its_crc32_and_a_flipped_bit_is_named(tmp_path, monkeypatch):
    """DCP keeps no checksums: a bit flipped inside a tensor loaded silently. The writer keeps
    each file's crc32 beside it (of the bytes as they pass: no file is read back, which cost a
    tp2 save of 75M parameters a fifth of its time), the commit folds them into meta.json, and
    `damaged` names the file that no longer reads back as written; every file is read by exactly
    one of the ranks that share the check."""
    from partrain.checkpoint import checkpointer
    from partrain.checkpoint.verify import crc32_of, damaged, take_sums

    def read_back(path):
        raise AssertionError(f"{path} was read back: DCP wrote it other than in order")

    monkeypatch.setattr(checkpointer, "crc32_of", read_back)
    root = tmp_path / store.CHECKPOINTS
    written = store.tmp_dir(root, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=storage_writer(written))
    shards = sorted(p.name for p in written.glob("*.distcp"))
    assert len(shards) == WRITE_THREADS and (written / "__0.crc32.json").is_file()
    sums = take_sums(written, _listed(written))
    assert sums == {name: crc32_of(written / name) for name in [".metadata", *shards]}
    assert not list(written.glob("*.crc32.json"))  # folded, not committed beside the shards
    checkpoint = store.commit(root, 3, {"reason": "test", "files": sums}, "{}\n")
    assert store.committed(root)[0].meta["files"] == sums
    assert damaged(checkpoint) == []
    victim = checkpoint.path / shards[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, the size unchanged: problems() sees nothing
    victim.write_bytes(bytes(data))
    assert problems(checkpoint.path) == []
    (found,) = damaged(checkpoint)
    assert found.startswith(f"{shards[-1]} does not hold the bytes written into it (crc32 ")
    assert f"{sums[shards[-1]]} when saved), written by rank 0" in found
    # Shared by four readers (more than the files): each file once, the flipped one named once.
    assert sum((damaged(checkpoint, rank, 4) for rank in range(4)), []) == [found]
    victim.unlink()
    assert damaged(checkpoint) == [f"{shards[-1]} cannot be read (No such file or directory), "
                                   "written by rank 0"]
    # An edited meta.json: its entry named, not a traceback; a file left out of it named too.
    edited = store.Checkpoint(checkpoint.path, 3, {"files": {"../etc/passwd": None}})
    assert damaged(edited) == ['its meta.json lists "../etc/passwd": null, not a file\'s crc32']
    edited = store.Checkpoint(checkpoint.path, 3, {"files": {".metadata": sums[".metadata"]}})
    assert damaged(edited) == [f"{name} has no crc32 in its meta.json, written by rank 0"
                               for name in shards]


def _listed(path):
    from partrain.checkpoint.verify import files_of, read_whole

    return files_of(read_whole(path)[1])


def test_a_save_whose_crc32s_are_not_all_there_is_not_committed(tmp_path, monkeypatch):
    """A rank's crc32 file lost (or not shown by a network file system for a while: looked for
    by name, again), or one that cannot be read: the commit would have kept a `files` without
    that rank's, never checked. Refused, naming it (the checkpointer discards the save:
    tests/integration/test_checkpoint.py)."""
    import json

    from partrain.checkpoint import verify
    from partrain.checkpoint.verify import NotWhole, take_sums

    monkeypatch.setattr(verify, "SUMS_LOOKS", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=storage_writer(tmp_path))
    (tmp_path / "__0.crc32.json").rename(tmp_path / "kept")
    with pytest.raises(NotWhole, match=r"no crc32 was kept of __0_0.distcp, __0_1.distcp: "
                                       r"the rank that wrote it left no __R.crc32.json"):
        take_sums(tmp_path, _listed(tmp_path))
    (tmp_path / "__0.crc32.json").write_text('{"__0_0.dist')
    with pytest.raises(NotWhole, match=r"__0.crc32.json cannot be read \(JSONDecodeError"):
        take_sums(tmp_path, _listed(tmp_path))
    (tmp_path / "__0.crc32.json").write_text(json.dumps({"__0_0.distcp": 7}))
    with pytest.raises(NotWhole, match="does not hold a crc32 per file of the rank"):
        take_sums(tmp_path, _listed(tmp_path))
    (tmp_path / "kept").rename(tmp_path / "__0.crc32.json")
    assert set(take_sums(tmp_path, _listed(tmp_path))) == {".metadata", "__0_0.distcp",
                                                            "__0_1.distcp"}

"""The run directory: config.yaml (frozen, exactly what the workers run), metrics.jsonl, logs/.

The nodes of one job share a run directory on a shared file system, and `partrain slurm` prepares
one before the job starts; so an existing run dir is joined, not refused, when its config.yaml is
the very config this node resolved and nothing has trained in it yet, or it trained without
committing a checkpoint (stopped early; a requeued job), and the run starts again from its first
step; one with a committed checkpoint of this config continues from it. Anything else must be new
or empty, so that the results of two runs never mix.
"""

import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from partrain.config.frozen import CONFIG
from partrain.config.paths import with_anchored_paths
from partrain.data.sampler import tokenizer_source
from partrain.data.tokenizer import RUN_TOKENIZER, copy_files, data_tokenizer_dir
from partrain.errors import ConfigError
from partrain.launch.runs import finished, running_here

MIN_FREE_BYTES = 1 << 20  # a run dir with less room fails at its first write of metrics


def default_run_dir(name: str, job_id: str | None = None) -> Path:
    """runs/<name>-<time>; inside a scheduler job runs/<name>-job<id>, the same on every node."""
    return Path("runs") / (f"{name}-job{job_id}" if job_id else
                           f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def trained_in(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or any((run_dir / "logs").glob("rank-*.log"))


def _config_differences(path: Path, cfg: DictConfig) -> list[str] | None:
    """How the frozen config at `path` differs from `cfg` ("train.max_steps: 20 there, 10
    here"), [] for the very same config, None where `path` is no config partrain can read."""
    from partrain.checkpoint.resume import flat_keys
    from partrain.config.compose import read_yaml
    from partrain.config.keys import SECTIONS, shown
    from partrain.config.schema import Config

    try:  # read_yaml refuses what is not a small regular file (a FIFO would block here)
        frozen = read_yaml(path)
    except ConfigError:
        return None
    if not isinstance(frozen, dict) or not SECTIONS <= frozen.keys():  # not a run's config
        return None
    # Typed against today's schema, as the launch reads it (config/frozen.py): a key added to
    # partrain since the run froze its config takes its default (a requeued job after an
    # upgrade was refused at every node: "data.sampling: null there, random here"). A run dir
    # frozen before its paths were made absolute holds them as typed.
    try:
        typed = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(frozen))
        there = flat_keys(OmegaConf.to_container(with_anchored_paths(typed)))
    except OmegaConfBaseException:  # an edited file (a ${...} that does not resolve, a key
        return None                 # partrain no longer has)
    here = flat_keys(OmegaConf.to_container(with_anchored_paths(cfg)))
    return [f"{key}: {shown(there.get(key))} there, {shown(here.get(key))} here"
            for key in sorted(there.keys() | here.keys()) if there.get(key) != here.get(key)]


def _same_config(path: Path, cfg: DictConfig) -> bool:
    return _config_differences(path, cfg) == []


def _listed(differences: list[str]) -> str:
    """The first three differences, and how many more."""
    more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
    return f"{'; '.join(differences[:3])}{more}"


def _another_config(run_dir: Path, differences: list[str], resuming: bool) -> ConfigError:
    return ConfigError(
        f"{'--resume' if resuming else '--run-dir'} {run_dir} holds another config "
        f"({_listed(differences)}): every node of a run runs the same config (the "
        "same command and overrides); give a new --run-dir for another run")


def _prepared_by_partrain(run_dir: Path) -> bool:
    """Holds only what `partrain slurm` or another node's launcher writes before training: the
    frozen config (or its temporary file, mid-rename), logs/, the sbatch script."""
    from partrain.launch.slurm import SCRIPT

    return all(entry.name in (CONFIG, "logs", SCRIPT, RUN_TOKENIZER) or
               (entry.name.startswith(f".{CONFIG}.") and entry.name.endswith(".tmp"))
               for entry in run_dir.iterdir())


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_run_dir(run_dir: Path, cfg: DictConfig | None = None, resuming: bool = False):
    """A run dir is new, empty, prepared for this very run, or holds a committed checkpoint of
    this very config (or `resuming`: of any config; resume.py checks what may change), and can
    be made: checked before anything is written, and by --dry-run. Returns the checkpoint to
    resume from, or None."""
    from partrain.checkpoint import store

    def refuse(rule: str) -> ConfigError:
        return ConfigError(f"{'--resume' if resuming else '--run-dir'} {run_dir} {rule}")

    checkpoint = None

    try:
        if run_dir.is_symlink() and not run_dir.exists():
            raise refuse("is a broken or looping symbolic link")
        if run_dir.exists() and not run_dir.is_dir():
            raise refuse("is an existing file; give a new directory")
        if resuming and (not run_dir.is_dir() or store.newest(run_dir / store.CHECKPOINTS) is None):
            broken = "".join(f" ({path.name}: {why})" for path, why in
                             store.not_committed(run_dir / store.CHECKPOINTS)[-1:])
            raise refuse(f"holds no committed checkpoint in {store.CHECKPOINTS}/{broken}; give the "
                         "run dir of a run that saved one (every checkpoint.every steps, at the "
                         "end, and on SIGUSR2)")
        if run_dir.is_dir() and any(run_dir.iterdir()):
            for name in ("metrics.jsonl", "logs"):  # what a start reads and appends to
                entry, kind = run_dir / name, ("a directory" if name == "logs" else "a file")
                if (entry.exists() or entry.is_symlink()) and not (
                        entry.is_dir() if name == "logs" else entry.is_file()):
                    raise refuse(f"holds {name}, which is not {kind}: a start appends to it "
                                 f"(the run's {'records' if name != 'logs' else 'logs'}); put "
                                 f"{kind} there or move it away")
            frozen = run_dir / CONFIG
            checkpoint = store.newest(run_dir / store.CHECKPOINTS) if cfg is not None else None
            differences = (_config_differences(frozen, cfg) if cfg is not None and frozen.is_file()
                           else None)
            # Only the world differs (--nnodes, --nproc-per-node): a job script that continues
            # the run on its own allocation after a `launch --resume` on another layout (the
            # script was refused at every node). The start resumes, as --resume would.
            new_world = bool(differences) and all(
                d.startswith(("launcher.nnodes:", "launcher.nproc_per_node:"))
                for d in differences)
            if checkpoint is not None and not resuming and not new_world and not (
                    frozen.exists() and _same_config(frozen, cfg)):
                differences = differences or []
                which = f" ({_listed(differences)})" if differences else ""
                raise refuse(
                    f"holds a checkpoint at step {checkpoint.step} of another config{which}; "
                    f"continue it with `partrain launch --resume {run_dir} [OVERRIDE...]` (the "
                    "layout may change), or give a new --run-dir")
            # Prepared by partrain for this config (`partrain slurm`, another node), or trained
            # in by it without a committed checkpoint (stopped early; a requeued job): the same
            # command starts the run again from its first step.
            joinable = checkpoint is not None or (cfg is not None and (
                (not trained_in(run_dir) and _prepared_by_partrain(run_dir)
                 and (not frozen.exists() or _same_config(frozen, cfg)))
                or (trained_in(run_dir) and _same_config(frozen, cfg))))
            differences = (_config_differences(frozen, cfg)
                           if cfg is not None and not joinable and frozen.is_file() else None)
            if differences:
                raise _another_config(run_dir, differences, resuming)
            if checkpoint is None and joinable and trained_in(run_dir) and \
                    running_here(run_dir) is None:  # to start again (check_not_in_use)
                # Refused where the config keeps no checkpoint at the end: its metrics are its
                # result. One that does (save_last) and has none lost that save (a Ctrl-C or a
                # kill during it): nothing was kept, and the run starts again, as said then.
                steps = cfg.train.max_steps
                if not store.saves_at(cfg.checkpoint, steps, last=True) and \
                        finished(run_dir, steps):
                    raise refuse("holds a finished run of this very config that kept no "
                                 "checkpoint (its config saves none at the end: "
                                 "checkpoint.save_last=false): its metrics.jsonl is its result; "
                                 "give a new --run-dir to run it again")
            kept = store.newest(run_dir / store.CHECKPOINTS) if cfg is None else None
            if kept is not None and not resuming:  # `partrain slurm` prepares a new run dir
                from partrain.launch.slurm import SCRIPT

                script = run_dir / SCRIPT
                again = ((f"resubmit its script to continue it: sbatch {script}; on other nodes: "
                          if script.is_file() else "continue it with ")
                         + f"`partrain slurm --resume {run_dir} --nodes N`")
                raise refuse(f"holds a run with a checkpoint at step {kept.step}; {again}; or "
                             "give a new --run-dir for a new run")
            if not joinable:
                raise refuse("already exists and is not empty; give a new one (a run dir holds "
                             "one run: partrain writes only into a new or empty directory)")
        parent = nearest_existing(run_dir)
        if not parent.is_dir():
            raise refuse(f"cannot be made: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            problem = "read-only file system" if _read_only_fs(parent) else "permission denied"
            raise refuse(f"cannot be written: {parent} is not writable ({problem})")
        free = shutil.disk_usage(parent).free
        if free < MIN_FREE_BYTES:
            raise refuse(f"cannot be written: {parent} has {free:,} bytes free (at least "
                         f"{MIN_FREE_BYTES:,} needed for the config, metrics and logs)")
    except OSError as e:  # a path too long, a name the file system refuses, an I/O error
        raise refuse(f"cannot be used: {e.strerror}") from None
    return checkpoint


def check_not_in_use(run_dir: Path, nnodes: int, resuming: bool) -> None:
    """A run dir in which a launch on this host is training takes no other launch: two would
    write each other's checkpoints, prune each other's, and interleave metrics.jsonl. Only the
    launchers of one job's nodes run in one run dir together: a launch of several nodes passes
    when the running one is of several too (on one host when the nodes are network namespaces
    or containers). A launch on another host cannot be seen from here."""
    live = running_here(run_dir)
    if live is None or (nnodes > 1 and live[1] > 1):
        return
    raise _in_use(run_dir, live[0], resuming, "logs/state.json")


def _in_use(run_dir: Path, pid: int | str | None, resuming: bool, seen_in: str) -> ConfigError:
    """pid None: the holder of the lock has not written its pid (yet): named by its lock alone."""
    who = f"pid {pid}, {seen_in}" if pid is not None else f"{seen_in}, its pid not written there"
    stop = (f"(`kill -USR2 {pid}` saves a checkpoint first, then it exits 3)" if pid is not None
            else "(SIGUSR2 to it saves a checkpoint first, then it exits 3)")
    # The same command again, whichever it was (`launch`, or `slurm --resume`, which submits)
    return ConfigError(f"{'--resume' if resuming else '--run-dir'} {run_dir} is in use: a launch "
                       f"runs in it ({who}); wait for it to end, or stop it {stop}, then run "
                       "this command again" + ("" if resuming else ", or give a new --run-dir"))


def lock_path(run_dir: Path, node_rank: int) -> Path:
    """This host's lock file for a node's launch in run_dir: in the temporary directory, named
    by a hash of the run dir's real path (a lock file inside the run dir would outlive a launch
    that fails before it writes anything there)."""
    import hashlib
    import tempfile

    key = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:32]
    return (Path(tempfile.gettempdir()) / f"partrain-run-dirs-{os.getuid()}"
            / f"{key}-node{node_rank}.lock")


@contextmanager
def hold_run_dir(run_dir: Path, node_rank: int, resuming: bool):
    """Hold this host's lock on run_dir for this node's launch until the block ends: a second
    launch there (the same node of another job, or any single-node one) is refused with exit 2,
    also one started in the same second, before the first has said it runs in logs/state.json
    (check_not_in_use reads that, and names launches on this host only). flock: the kernel lets
    go when the launcher ends, however it ends, and no process it starts inherits the lock. Where
    no lock file can be made, the launch goes on with check_not_in_use alone."""
    path = lock_path(run_dir, node_rank)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = _locked(path)
    except _Held as held:
        raise _in_use(run_dir, held.pid, resuming, f"its lock {path}") from None
    except OSError:
        yield
        return
    try:
        yield
    finally:
        # Removed while held: a launch that opened the file meanwhile finds it gone once it holds
        # it, and starts over on a new one (_locked)
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)


class _Held(Exception):
    def __init__(self, pid: str | None):
        super().__init__(pid)
        self.pid = pid


# How long a launch refused by the lock waits for its holder's pid to appear in it: the holder
# writes it right after it takes the flock, but two launches started together meet in between
PID_WRITTEN_WITHIN_S = 2.0


def _holder_pid(fd: int) -> str | None:
    """The pid the lock's holder wrote in it, waited for up to PID_WRITTEN_WITHIN_S; None where
    none came (a holder stopped between its flock and its write)."""
    import time

    deadline = time.monotonic() + PID_WRITTEN_WITHIN_S
    while True:
        written = os.pread(fd, 32, 0).decode(errors="replace")
        if written.endswith("\n") and written.strip():
            return written.strip()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _locked(path: Path) -> int:
    """An fd of path holding its flock, with this pid written in it; _Held (the holder's pid, as
    it wrote it; None where it wrote none) where another process holds it."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = _holder_pid(fd)
            os.close(fd)
            raise _Held(held_by) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # its holder removed it as it let go: the next one is this path's


# File systems that live on this machine: a run dir there is not the other nodes' (tmpfs in
# memory; local disks). A shared one (nfs, lustre, gpfs, beegfs, ceph, ...) is none of these.
LOCAL_FILE_SYSTEMS = ("tmpfs", "ramfs", "overlay", "ext2", "ext3", "ext4", "xfs", "btrfs",
                      "f2fs", "vfat")


def file_system_of(path: Path, mounts: str = "/proc/self/mounts") -> tuple[str, str] | None:
    """(type, mount point) of the file system `path` (or its nearest existing parent) is on,
    from the mount table (the longest mount point above it); None where it cannot be read."""
    existing = nearest_existing(path)
    target = existing.resolve() / path.absolute().relative_to(existing)
    try:
        with open(mounts) as table:
            entries = [line.split()[1:3] for line in table if len(line.split()) > 2]
    except OSError:
        return None
    found = None
    for point, kind in entries:
        point = point.replace("\\040", " ")  # the table's escape of a space
        if (target == Path(point) or Path(point) in target.parents) and (
                found is None or len(point) >= len(found[1])):
            found = (kind, point)
    return found


def node_local_warning(run_dir: Path, nnodes: int) -> str | None:
    """Said when a job of several nodes gets a run dir on a file system local to this machine:
    each node would write its own (the start finds out and stops; said here, before the job
    waits in the queue)."""
    found = file_system_of(run_dir) if nnodes > 1 else None
    if found is None or found[0] not in LOCAL_FILE_SYSTEMS:
        return None
    return (f"--run-dir {run_dir} is on {found[0]} (mounted at {found[1]}), a file system local "
            f"to this machine as far as it shows: the {nnodes} nodes of the job must all see the "
            "same run dir (a shared file system mounted at the same path on every node), or "
            "the run stops at its start")


def _read_only_fs(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def write_run_dir(cfg: DictConfig, run_dir: Path, resuming: bool = False,
                  replace: bool | None = None) -> Path:
    """Create the run dir with its frozen config.yaml (written whole, then renamed into place, so
    that nodes writing the same file at once never see half of it). If the disk refuses any of
    it, what this call made is removed and the error names --run-dir. `replace`: config.yaml is
    replaced (a start that goes on from a checkpoint, on its own nodes x ranks); by default
    only on a resume."""
    check_run_dir(run_dir, cfg, resuming)
    made = nearest_existing(run_dir)
    # pid and host: nodes in pid namespaces of their own (containers) may share a pid.
    tmp = run_dir / f".{CONFIG}.{socket.gethostname()}-{os.getpid()}.tmp"
    copied = not (run_dir / RUN_TOKENIZER).exists()  # and so removed again on a failure
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        tmp.write_text(OmegaConf.to_yaml(with_anchored_paths(cfg)))
        _put_config(tmp, run_dir, cfg, resuming if replace is None else replace)
        tokenizer = data_tokenizer_dir(tokenizer_source(cfg.data))
        if tokenizer is not None:  # export and sample use the run's own copy
            copy_files(tokenizer, run_dir / RUN_TOKENIZER)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
            if copied:
                shutil.rmtree(run_dir / RUN_TOKENIZER, ignore_errors=True)
            remove_made(run_dir, made)
        except OSError:
            pass  # the message below names the run dir; what could not be removed is in it
        raise ConfigError(f"--run-dir {run_dir} cannot be written: {e.strerror}") from None
    return run_dir


def _put_config(tmp: Path, run_dir: Path, cfg: DictConfig, resuming: bool) -> None:
    """config.yaml into place. A resume replaces it (its layout may change). A start writes it
    only where none is yet (a hard link, which fails where another node's launcher wrote one
    first) and otherwise checks that the one there is this very config, so that two nodes
    started at once with different configs do not both go on, each believing its own."""
    final = run_dir / CONFIG
    if resuming:
        tmp.rename(final)
        return
    try:
        os.link(tmp, final)
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: the rename, then the check below
        tmp.rename(final)
    tmp.unlink(missing_ok=True)
    differences = _config_differences(final, cfg)
    if differences is None:
        raise ConfigError(f"--run-dir {run_dir}: its {CONFIG} (written by another launch) is "
                          "no config partrain can read; give a new --run-dir")
    if differences:
        raise _another_config(run_dir, differences, resuming)


def remove_made(run_dir: Path, existed: Path) -> None:
    """Remove the directories from run_dir up to (not including) `existed`, the nearest one that
    was there before; only empty ones, so nothing of anyone else's goes (one already gone is
    passed)."""
    for path in (run_dir.absolute() / "logs", *[run_dir.absolute(), *run_dir.absolute().parents]):
        if path == existed or existed not in path.parents:
            break
        try:
            path.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            break

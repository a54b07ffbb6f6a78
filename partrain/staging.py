"""New output directories, written whole or not at all: `data prepare --out` and `export --out`.

`check_out` refuses an --out that is not a new or empty directory before any work; `staged_dir`
gives a temporary directory beside it that is renamed into place only when everything in it is
written, and removed (with any parent directories it made) on any failure or Ctrl-C, and on
SIGTERM and SIGHUP (a job runner's stop, a closed terminal) as on Ctrl-C: their default action
ended the process at once, leaving the temporary directory and data prepare's tokenizer
processes blocked forever on a pipe no one read. What it
holds gets the modes the umask gives, whatever the writers chose (a team shares the output).
"""

import os
import secrets
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from partrain.errors import ConfigError


def check_out(out: Path) -> None:
    """--out must be a new or empty directory, reachable through directories."""
    if out.name in ("", ".", ".."):
        raise ConfigError(f"--out {out} must name a new directory, not the current or a parent one")
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link (to {os.readlink(out)}); give a new "
                          "directory, not a link")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is an existing file; give a new directory")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; give a new directory")
    for parent in Path(os.path.abspath(out)).parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out {out}: {parent} is a file, not a directory")
            break


def follow_umask(root: Path) -> None:
    """Give what is under `root` the modes a new file or directory gets from the umask: writers
    such as safetensors create private (0600) files, which the rest of a team on a shared
    cluster could not read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


class Stage:
    """The directory being written and what is being done in it, for the message of a failure."""

    def __init__(self, path: Path):
        self.path, self.step = path, "creating its parent directories"


@contextmanager
def staged_dir(out: Path, errors: tuple = (OSError,)):
    """A Stage whose `path` is a temporary directory beside `out`, renamed to `out` when the block
    ends well. On any failure (Ctrl-C included) it and the parents made here are removed; an
    error of `errors` becomes one message naming --out and the step that failed."""
    target = Path(os.path.abspath(out))  # messages name `out` as given
    with _stops_as_interrupts():
        yield from _staged(out, target, errors)


@contextmanager
def _stops_as_interrupts():
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread while inside (unless
    ignored): the cleanup and the exit 130 of a Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # An ignored one stays ignored: `nohup` ignores SIGHUP so that a closed terminal does not
    # stop the job (a reviewer's find: a nohup'ed prepare exited 130 on it).
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _staged(out: Path, target: Path, errors: tuple):
    missing = [p for p in reversed(target.parents) if not p.exists()]  # outermost first
    made = []  # those created here, removed again on a failure
    stage = Stage(target.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"))
    tmp_made = False
    try:
        for parent in missing:
            parent.mkdir()
            made.append(parent)
        stage.step = f"creating {stage.path}"
        stage.path.mkdir()
        tmp_made = True
        yield stage
        stage.step = "setting the files' modes from the umask"
        follow_umask(stage.path)
        stage.step = "renaming the temporary directory into place"
        stage.path.rename(target)  # atomic, and replaces an empty `out` directory
    except BaseException as e:
        left = []
        if tmp_made:
            shutil.rmtree(stage.path, ignore_errors=True)
            if stage.path.exists():
                left.append(str(stage.path))
        for parent in reversed(made):
            try:
                parent.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(str(parent))
        if not isinstance(e, errors):
            raise
        raise ConfigError(
            f"--out {out} cannot be written: {getattr(e, 'strerror', None) or e} ({stage.step}); "
            + (f"could not remove {', '.join(left)}" if left else "nothing was left behind")) from None

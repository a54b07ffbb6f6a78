"""Which files the inputs of `partrain data prepare` stand for (inputs.py reads them): a file as
it is, a directory its regular files recursively, in sorted order, hidden names skipped, and a
directory that `datasets.Dataset.save_to_disk` wrote its Arrow files in state.json's order.

Refused rather than read (`input_files`): a partrain token dir, given or found under a directory
(its meta.json, shards and indexes are not text; a token dir written beside the text, as
`data prepare data/ --out data/tokens` does, is the case), a partrain run dir the same way (its
checkpoints, logs and metrics: `data prepare . --out tokens` in a project whose runs/ holds
runs), a compressed file (gzip, zstd, bzip2, xz: by its name or its first bytes; its bytes
would be tokenized as text), and a file read twice, whether given twice, found under two
inputs, or both an input and a --val input (a val split of training text), under one name or
two (a symbolic or a hard link: the same device and inode is the same file).
"""

import json
import os
from pathlib import Path

from partrain.config.frozen import CONFIG
from partrain.config.paths import what_is
from partrain.errors import ConfigError, reason

# What `datasets` writes into a directory with save_to_disk: a Dataset's state.json names its Arrow
# files in order; a DatasetDict's dataset_dict.json names its splits, each a Dataset's directory.
HF_STATE, HF_INFO, HF_SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"


def _check_file(file: Path) -> None:
    found = what_is(file)
    if found == "is a regular file":
        return
    # A pipe or device could be endless or read only once; a file can be read again.
    hint = "; save its contents to a file first" if found.startswith("is not a regular") else ""
    raise ConfigError(f"input file {file} {found}{hint}")


# Compressed files: by name, and by their first bytes (a .jsonl that is gzip inside). Read as
# they are, their compressed bytes would be tokenized as text. bzip2's "BZh" is text too: its
# block size digit and the magic of its first block (or of its end, empty) make it bzip2.
COMPRESSED = {"gzip": (".gz", ".tgz", ".gzip"), "zstd": (".zst", ".zstd", ".tzst"),
              "bzip2": (".bz2", ".tbz2"), "xz": (".xz", ".txz", ".lzma")}
DECOMPRESS = {"gzip": "gunzip", "zstd": "zstd -d", "bzip2": "bunzip2", "xz": "unxz"}


def _compression(file: Path) -> tuple[str, str] | None:
    """(format, how it shows: its name or its first bytes) of a compressed file, else None."""
    name = file.name.lower()
    for kind, suffixes in COMPRESSED.items():
        for suffix in suffixes:
            if name.endswith(suffix):
                return kind, f"its name ends in {suffix}"
    try:
        with open(file, "rb") as f:
            head = f.read(10)
    except OSError as e:
        raise ConfigError(f"input file {file} cannot be read: {reason(e)}") from None
    bzip2 = (head[:3] == b"BZh" and b"1" <= head[3:4] <= b"9"
             and head[4:10] in (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90"))
    for kind, found in (("gzip", head[:2] == b"\x1f\x8b"),
                        ("zstd", head[:4] == b"\x28\xb5\x2f\xfd"),
                        ("bzip2", bzip2), ("xz", head[:6] == b"\xfd7zXZ\x00")):
        if found:
            return kind, f"it starts with {kind}'s magic bytes"
    return None


# Files that are never text, by their suffix (compiled code, images, archives, arrays, weights):
# read as text they were tokenized byte for byte without a word (a newcomer's `data prepare
# $STDLIB/email` was 78% __pycache__ bytecode). By name only: a NUL byte is a valid byte to a
# byte-level vocabulary, and a text file may hold one.
NOT_TEXT = (".pyc", ".pyo", ".so", ".o", ".a", ".dll", ".dylib", ".exe", ".class", ".jar",
            ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".pdf", ".zip", ".tar",
            ".whl", ".egg", ".npy", ".npz", ".pt", ".pth", ".safetensors", ".onnx")


def _refuse_binary(file: Path, given: Path, flag: str) -> None:
    """A file of a kind that is never text (NOT_TEXT); a walk skips __pycache__ folders."""
    suffix = file.suffix.lower()
    if suffix in NOT_TEXT:
        what = f"{flag} file {file}" + ("" if file == given else f" (under {flag} {given})")
        raise ConfigError(
            f"{what} is not text ({suffix}): data prepare reads text, JSON Lines, Parquet and "
            "Arrow files; give the text files (a directory's __pycache__ folders are skipped; "
            "move other binary files out of it)")


def _refuse_not_text(file: Path, given: Path, flag: str) -> None:
    """A file data prepare would read as text and is not: compressed, or never text."""
    _refuse_compressed(file, given, flag)
    _refuse_binary(file, given, flag)


def _refuse_compressed(file: Path, given: Path, flag: str) -> None:
    found = _compression(file)
    if found is None:
        return
    kind, why = found
    what = f"{flag} file {file}" + ("" if file == given else f" (under {flag} {given})")
    raise ConfigError(
        f"{what} is {kind}-compressed ({why}): data prepare reads text, JSON Lines, Parquet and "
        f"Arrow files as they are, and would tokenize the compressed bytes; decompress it "
        f"first ({DECOMPRESS[kind]} {file}) and give the decompressed file")


def collect_inputs(paths: list[Path], flag: str = "input") -> list[Path]:
    """The files the inputs stand for, in order: a directory's regular files recursively, in
    sorted order, hidden files and directories skipped, symbolic links to directories followed
    (each directory read once: a link back up is no loop), a broken link refused. A partrain token dir, given or under a
    directory, is refused. `flag` names the inputs in messages ("input", "--val")."""
    files = []
    for path in paths:
        if not path.is_dir():
            _check_file(path)
            _refuse_token_dir_file(path, flag)
            _refuse_run_dir(path.parent, path, flag)
            _refuse_not_text(path, path, flag)
            files.append(path)
            continue
        found, walked = [], set()
        for root, dirs, names in os.walk(path, onerror=_walk_error, followlinks=True):
            key = _dir_key(root)
            if key in walked:  # reached again through a link: its files are in already
                dirs[:] = []
                continue
            walked.add(key)
            _refuse_token_dir(Path(root), path, flag)
            _refuse_run_dir(Path(root), path, flag)
            dataset = _hf_dataset_files(Path(root))
            if dataset is not None:  # its Arrow files, not its JSON files as text
                found += dataset
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            here = [Path(root) / n for n in sorted(names) if not n.startswith(".")
                    and _walked_file(Path(root) / n, path, flag)]
            for file in here:
                _refuse_not_text(file, path, flag)
            found += here
        if not found:
            raise ConfigError(f"input directory {path} holds no files (hidden ones and "
                              "__pycache__ folders are skipped)")
        files += found
    return files


def input_files(inputs: list[Path], val_inputs: list[Path]) -> tuple[list[Path], list[Path]]:
    """The files of the inputs and of the --val inputs (collect_inputs), each file once: one
    read twice (the same input given twice, a file also under a directory given, a --val input
    that is also an input) is refused, naming both inputs."""
    # Keyed by the file itself, (device, inode), not by its real path: a hard link
    # (`ln train.txt val.txt`) has a real path of its own and is the same text.
    seen: dict[tuple[int, int], tuple[str, Path, Path]] = {}  # -> (flag, input given, file)
    out = []
    for flag, given in (("input", inputs), ("--val", val_inputs)):
        files = []
        for path in given:
            for file in collect_inputs([path], flag):
                try:
                    st = os.stat(file)
                except OSError as e:
                    raise ConfigError(f"{flag} file {file} cannot be read: {reason(e)}") from None
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    raise ConfigError(_read_twice(seen[key], (flag, path, file)))
                seen[key] = (flag, path, file)
                files.append(file)
        out.append(files)
    return out[0], out[1]


def _read_twice(first: tuple[str, Path, Path], second: tuple[str, Path, Path]) -> str:
    """The message for a file that two inputs (or one, given twice) would read: each is
    (flag, input given, file)."""
    (flag1, given1, file1), (flag2, given2, file2) = first, second

    def named(flag, given, file):
        return f"{flag} {given}" + ("" if file == given else f" (its file {file})")

    def read_as(flag, given, file, other):
        if file == given:
            return f"{flag} {given}"
        return f"part of {flag} {given}" + ("" if file == other else f" (as {file})")

    if flag1 != flag2:
        move = f" (move {file2} out of {given1})" if file1 != given1 else ""
        return (f"{named(flag2, given2, file2)} is also read for training, as "
                f"{read_as(flag1, given1, file1, file2)}: a val split of the training text "
                f"measures nothing; give --val inputs that are not among the inputs{move}")
    if given1 == given2 and file1 == file2:
        return f"{flag1} {given1} is given twice: its text would be read twice; give it once"
    if given1 == given2:
        both = f"{flag1} {given1} holds {file1} and {file2}, which are the same file"
    elif file1 == given1 and file2 == given2:
        both = f"{flag2} {given2} is the same file as {flag1} {given1}"
    elif file2 == given2:
        both = f"{flag2} {given2} is also read as {read_as(flag1, given1, file1, file2)}"
    elif file1 == given1:
        both = f"{flag1} {given1} is also read as {read_as(flag2, given2, file2, file1)}"
    else:
        both = f"{named(flag1, given1, file1)} and {named(flag2, given2, file2)} are the same file"
    return f"{both}: its text would be read twice; give each file once"


def _token_dir_format(directory: Path) -> str | None:
    """The format of the partrain token dir `directory` is (its meta.json's "format"), or None."""
    meta = directory / "meta.json"
    try:
        # A token dir's meta.json is a few hundred bytes; a big one is some other file.
        if not meta.is_file() or meta.stat().st_size > 1 << 20:
            return None
        value = json.loads(meta.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError):
        return None
    found = value.get("format") if isinstance(value, dict) else None
    # Any version of partrain's format, a later one too (format.FORMATS are the ones read).
    return found if isinstance(found, str) and found.startswith("partrain-tokens/") else None


def _refuse_token_dir(directory: Path, given: Path, flag: str) -> None:
    found = _token_dir_format(directory)
    if found is None:
        return
    what = (f"{flag} directory {given} is a partrain token dir" if directory == given else
            f"{flag} directory {given} holds a partrain token dir, {directory}")
    raise ConfigError(
        f"{what} (its meta.json says format {found!r}); data prepare reads text, and would read "
        "the token dir's meta.json, shards and indexes as text; give the text files instead"
        + (f" (train on the token dir as it is: data=tokens data.path={directory})"
           if directory == given else f", or move the token dir out of {given}"))


def _refuse_token_dir_file(file: Path, flag: str) -> None:
    found = _token_dir_format(file.parent)
    if found is not None:
        raise ConfigError(
            f"{flag} file {file} is a file of the partrain token dir {file.parent} (its "
            f"meta.json says format {found!r}): data prepare reads text; give the text files "
            f"instead (train on the token dir as it is: data=tokens data.path={file.parent})")


# Beside its frozen config, what a launch writes into a run dir (launch/rundir.py,
# checkpoint/store.py).
RUN_DIR_ENTRIES = ("checkpoints", "metrics.jsonl", "logs")


def _is_run_dir(directory: Path) -> bool:
    """Whether `directory` is a partrain run dir: its frozen config and what a launch wrote."""
    try:
        return ((directory / CONFIG).is_file()
                and any((directory / entry).exists() for entry in RUN_DIR_ENTRIES))
    except OSError:
        return False


def _refuse_run_dir(directory: Path, given: Path, flag: str) -> None:
    if not _is_run_dir(directory):
        return
    if given == directory:
        what = f"{flag} directory {given} is a partrain run dir"
    elif given.is_dir():
        what = f"{flag} directory {given} holds a partrain run dir, {directory}"
    else:
        what = f"{flag} file {given} is a file of the partrain run dir {directory}"
    where = "" if given.is_file() or given == directory else f", or move the run dir out of {given}"
    written = ", ".join(e for e in RUN_DIR_ENTRIES if (directory / e).exists())
    raise ConfigError(
        f"{what} ({CONFIG} and {written}); "
        "data prepare reads text, and would read its checkpoints, logs and metrics as text; give "
        f"the text files instead{where}")


def _dir_key(directory: str) -> tuple[int, int]:
    try:
        st = os.stat(directory)
    except OSError as e:
        raise ConfigError(f"input directory {directory} cannot be read: {reason(e)}") from None
    return st.st_dev, st.st_ino


def _walked_file(file: Path, given: Path, flag: str) -> bool:
    """A regular file to read (through a link too); a broken link is refused, as when given by
    itself (skipped, its text was left out without a word); other kinds (a pipe) are skipped."""
    if file.is_symlink() and not file.exists():
        raise ConfigError(f"{flag} file {file} (under {flag} {given}) is a symbolic link to "
                          f"{os.readlink(file)}, which does not exist; fix or remove the link")
    return file.is_file()


def _walk_error(e: OSError) -> None:
    raise ConfigError(f"input directory {e.filename} cannot be read: {reason(e)}")


def _json_file(file: Path, directory: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"input directory {directory}: its {file.name} cannot be read as JSON "
                          f"({str(e)[:200]})") from None


def _hf_dataset_files(directory: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face dataset that `save_to_disk` wrote into `directory`, in
    its order; None when it is not one. A DatasetDict is refused: which split trains and which
    validates is the user's to say."""
    if (directory / HF_SPLITS).is_file():
        splits = _json_file(directory / HF_SPLITS, directory)
        splits = splits.get("splits") if isinstance(splits, dict) else None
        splits = [s for s in splits if isinstance(s, str)] if isinstance(splits, list) else []
        train = "train" if "train" in splits else (splits or ["train"])[0]
        val = next((s for s in ("validation", "valid", "val", "test") if s in splits),
                   next((s for s in splits if s != train), None))
        example = f"{directory / train}" + (f" --val {directory / val}" if val else "")
        raise ConfigError(
            f"input directory {directory} is a Hugging Face DatasetDict (splits: "
            f"{', '.join(splits) or 'none named'}); give the directory of a split, e.g. {example}")
    if not ((directory / HF_STATE).is_file() and (directory / HF_INFO).is_file()):
        return None
    state = _json_file(directory / HF_STATE, directory)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries):
        raise ConfigError(
            f"input directory {directory} looks like a Hugging Face dataset ({HF_STATE}, "
            f"{HF_INFO}), but its {HF_STATE} names no Arrow files in \"_data_files\"")
    files = [directory / entry["filename"] for entry in entries]
    for file in files:
        _check_file(file)
    return files

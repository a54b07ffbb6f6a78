"""Parsers for the commands' number flags: each echoes what was given in its message (a usage
error, exit 2), as `--workers='x' is not a whole number`."""

import typer


def whole_flag(flag: str, minimum: int = 1):
    """A parser for an integer flag whose message echoes what was given."""
    def parse(value: str) -> int:
        if isinstance(value, str) and len(value) > 40 and value.strip().lstrip("+-").isdigit():
            # Python refuses to read an integer of over 4,300 digits; none of ours needs 40.
            raise typer.BadParameter(f"{flag}={value[:20]}... ({len(value):,} digits) is too "
                                     "large a number")
        try:
            number = int(value)
        except ValueError:
            raise typer.BadParameter(f"{flag}={value!r} is not a whole number") from None
        if number < minimum:
            raise typer.BadParameter(f"{flag}={number} must be at least {minimum}")
        return number
    return parse


def nproc_flag(flag: str, words: bool = True):
    """--nproc-per-node: a whole number, or (launch) torchrun's gpu, cpu, auto, counted on the
    node that starts the ranks."""
    whole = whole_flag(flag)

    def parse(value: str):
        from partrain.launch.torchrun import NPROC_WORDS, read_nproc

        if isinstance(value, str) and value.strip().lower() in NPROC_WORDS:
            if not words:
                raise typer.BadParameter(
                    f"{flag} {value} counts the devices of the machine it runs on, and `partrain "
                    "slurm` runs on the login node: give --gpus-per-node G (the ranks per node "
                    "follow it) or a number")
            return read_nproc(value)
        if words and isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
            raise typer.BadParameter(f"{flag}={value!r} is not a whole number or one of "
                                     f"{', '.join(NPROC_WORDS)}")
        return whole(value)
    return parse


def nnodes_flag(value: str) -> int:
    """--nnodes N, or torchrun's MIN:MAX when MIN = MAX."""
    from partrain.launch.torchrun import read_nnodes

    if isinstance(value, int) or ":" not in value:
        return whole_flag("--nnodes")(value)
    try:
        return read_nnodes(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def number_flag(flag: str):
    """A parser for a flag that takes a number, echoing what was given."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise typer.BadParameter(f"{flag}={value!r} is not a number") from None
        return number  # the range (and NaN) is checked where the value is used
    return parse

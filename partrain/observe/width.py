"""How wide rich may draw. Output that is not a terminal (a pipe, a file, a SLURM job's log) is
read later, in an editor or with grep; rich would fit it to 80 columns, wrapping lines and table
cells and cutting numbers short ("1,404,7…"). It gets READ_LATER_COLUMNS instead."""

import os

READ_LATER_COLUMNS = 200


def width_for(stream) -> int | None:
    """The width to give a rich Console writing to `stream`: None (rich's own: the terminal's, or
    COLUMNS where set) for a terminal or with COLUMNS set, else READ_LATER_COLUMNS."""
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        terminal = False
    return None if terminal or os.environ.get("COLUMNS") else READ_LATER_COLUMNS

"""Where the commands print: `out` (stdout: what was asked for) and `err` (stderr: errors,
warnings, progress)."""

from rich.console import Console

# markup=False: what partrain prints holds the user's own text (paths, names, values), and a
# `[run1]` or `[/x]` in it must come out as typed, not be read as rich markup.
out = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)

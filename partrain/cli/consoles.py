"""Where the commands print: `out` (stdout: what was asked for) and `err` (stderr: errors,
warnings, progress)."""

import sys

from partrain.observe.console import PipeSafeConsole as Console
from partrain.observe.width import width_for

# markup=False: what partrain prints holds the user's own text (paths, names, values), and a
# `[run1]` or `[/x]` in it must come out as typed, not be read as rich markup. The width: 80
# columns would wrap tables read later from a file or a pipe (observe/width.py).
out = Console(highlight=False, markup=False, emoji=False, soft_wrap=True,
              width=width_for(sys.stdout))
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False,
              width=width_for(sys.stderr))

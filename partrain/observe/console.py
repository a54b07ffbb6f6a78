"""rich's Console for a run's output, which a closed pipe does not end (`partrain launch | head`).

rich ends the process when the reader of its output goes away (Console.on_broken_pipe: stdout to
/dev/null, then SystemExit(1)). In a launch that killed rank 0 mid-run (its progress lines go to
the launcher's stdout), read as `sys.exit(1) was called on rank 0`, and the launcher itself died
without recording how its run ended. Here the console goes quiet and the run goes on; what it
would have printed is in the run dir (metrics.jsonl, logs/).
"""

import os
import sys

from rich.console import Console


class PipeSafeConsole(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        stream = sys.stderr if self.stderr else sys.stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # not a real file (a test's capture): quiet is enough
            pass
        finally:
            os.close(devnull)

"""train.profile_start / train.profile_steps: torch.profiler over a window of optimizer steps.

Each rank writes RUN_DIR/profile/rank-N.json (a Chrome trace: chrome://tracing or Perfetto) and
rank-N.txt, torch's table of the operators and kernels that took the most time over the window
(device time first on CUDA, CPU time elsewhere), with the window's wall time and, on CUDA, the
share of it the GPU spent in kernels. torchtitan's `profiling` section and Megatron-LM's
`--profile` do the same; the window should start after compilation and warm-up (step 1 pays
both). A resume that starts inside the window profiles the rest of it; a start that resumed
writes rank-N.from-step-S.* (S: the first step it recorded), beside what an earlier start wrote; a preemption or an error inside it
writes what was recorded through the last step that ended, its table saying so. A rank the
launcher stops (SIGTERM: another rank failed) may be stopped while it writes: the partial file it
leaves (kineto's `.tmp`) is removed at the next start."""

from pathlib import Path

import torch

TABLE_ROWS = 30


class StepProfiler:
    def __init__(self, run_dir: Path, rank: int, device: torch.device, start: int, steps: int,
                 first_step: int = 1):
        self.directory, self.rank, self.resumed = run_dir / "profile", rank, first_step > 1
        self.device, self.start, self.last = device, start, start + steps - 1
        self.prof = None
        # The first step recorded (a resume inside the window: its step); set once, so a
        # window closed early is not opened again.
        self.first = None
        self.ended = None  # the last step of the window that ended
        self.window_s = 0.0
        for partial in self.directory.glob(f"rank-{rank}.*.tmp"):  # a stopped rank's
            partial.unlink(missing_ok=True)

    @property
    def path(self) -> Path:
        """Where the window's files go, without the suffix: rank-N, or rank-N.from-step-S for a
        start that resumed (S: the first step it recorded)."""
        return self.directory / (f"rank-{self.rank}" + (f".from-step-{self.first}" if self.resumed
                                                        else ""))

    def begin(self, step: int) -> None:
        if self.start and self.first is None and self.start <= step <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.start()
            self.first = step

    def end(self, step: int, step_time_s: float) -> Path | None:
        """After step `step`: the window's last step stops the profiler and writes its files
        (returns the table's path then)."""
        if self.prof is None:
            return None
        self.window_s += step_time_s
        self.ended = step
        return self.close() if step == self.last else None

    def close(self) -> Path | None:
        """Stop the profiler if it runs and write what it recorded, through the last step that
        ended (the window's end, or the step a preemption or an error stopped the run after)."""
        if self.prof is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path
        self.prof.export_chrome_trace(f"{path}.json")
        table = Path(f"{path}.txt")
        table.write_text(self.summary())
        self.prof = None
        return table

    def summary(self) -> str:
        events = self.prof.key_averages()
        on_cuda = self.device.type == "cuda"
        sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        step = self.ended
        head = [(f"steps {self.first}-{step}: {self.window_s:.3f} s of wall time"
                 if step is not None else f"step {self.first}, the window's first, did not end:"
                 " what it recorded of it")
                + ("" if step == self.last else f" (the run stopped before step {self.last})")]
        if on_cuda:
            # The kernels' own events (a CPU op also carries the time of the kernels it
            # launched: summing both would count it twice).
            kernels_us = sum(e.self_device_time_total for e in events
                             if e.device_type == torch.autograd.DeviceType.CUDA)
            head.append(f"GPU busy in kernels: {kernels_us / 1e6:.3f} s "
                        f"({kernels_us / 1e6 / max(self.window_s, 1e-9):.1%} of the window)")
        return "\n".join(head) + "\n\n" + events.table(sort_by=sort, row_limit=TABLE_ROWS) + "\n"

"""`train.trace=true`: compute and communication spans of every rank, written as trace.json in the
run directory in the Chrome trace event format (open it in https://ui.perfetto.dev or
chrome://tracing): one track per rank, so a pipeline's bubble is the gaps between F/B blocks.
A start that resumed writes trace.from-step-S.json instead (S: its first step), so that the
earlier start's trace stays; one with no step among the first TRACE_STEPS writes none.

Times come from time.perf_counter (CLOCK_MONOTONIC, shared by the processes of one node), so
ranks on one node line up exactly; across nodes the tracks are aligned only roughly.
"""

import json
import time
from contextlib import contextmanager
from pathlib import Path

TRACE_STEPS = 50  # steps recorded: enough to see the pattern, small enough to open in a browser


class Tracer:
    """Collects (name, category, start_s, end_s) spans while `recording`."""

    def __init__(self, enabled: bool):
        self.enabled, self.recording = enabled, enabled
        self.spans: list[tuple[str, str, float, float]] = []

    @contextmanager
    def span(self, name: str, category: str):
        if not self.recording:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((name, category, start, time.perf_counter()))

    def at_step(self, step: int) -> None:
        self.recording = self.enabled and step <= TRACE_STEPS


def chrome_trace(per_rank: list[list[tuple]], labels: list[str]) -> dict:
    """The trace-event JSON for every rank's spans; time 0 is the earliest span."""
    starts = [s[2] for spans in per_rank for s in spans]
    t0 = min(starts) if starts else 0.0
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "partrain"}}]
    for rank, (spans, label) in enumerate(zip(per_rank, labels)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
        for name, category, start, end in spans:
            events.append({"name": name, "cat": category, "ph": "X", "pid": 0, "tid": rank,
                           "ts": round((start - t0) * 1e6, 3), "dur": round((end - start) * 1e6, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: Path, per_rank: list[list[tuple]], labels: list[str]) -> None:
    path.write_text(json.dumps(chrome_trace(per_rank, labels)))

"""StepProfiler (train.profile_start): which steps it records and what it writes, on CPU."""

import json

import torch

from partrain.observe.profile import StepProfiler


def work() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum()


def run(profiler: StepProfiler, steps: range) -> list:
    written = []
    for step in steps:
        profiler.begin(step)
        work()
        written.append(profiler.end(step, 0.01))
    return written


def test_the_window_is_recorded_and_written_once(tmp_path):
    profiler = StepProfiler(tmp_path, 3, torch.device("cpu"), start=2, steps=2)
    written = run(profiler, range(1, 6))
    table = tmp_path / "profile" / "rank-3.txt"
    assert written == [None, None, table, None, None]
    text = table.read_text()
    assert text.startswith("steps 2-3: 0.020 s of wall time\n") and "aten::mm" in text
    trace = json.loads((tmp_path / "profile" / "rank-3.json").read_text())
    assert sum(e["name"] == "aten::mm" for e in trace["traceEvents"]) == 2  # steps 2 and 3


def test_a_resume_inside_the_window_records_the_rest(tmp_path):
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=3)
    run(profiler, range(3, 6))
    assert (tmp_path / "profile" / "rank-0.txt").read_text().startswith("steps 3-4: ")


def test_a_run_stopped_inside_the_window_writes_what_it_recorded(tmp_path):
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=5)
    run(profiler, range(1, 4))  # preempted after step 3
    table = profiler.close(3)
    assert table.read_text().startswith(
        "steps 2-3: 0.020 s of wall time (the run stopped before step 6)")
    assert profiler.close(3) is None  # once


def test_off_records_nothing(tmp_path):
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), start=0, steps=3)
    assert run(profiler, range(1, 4)) == [None] * 3 and profiler.close(3) is None
    assert not (tmp_path / "profile").exists()

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


def test_a_resume_inside_the_window_records_the_rest_beside_the_first_part(tmp_path):
    """The first start is preempted after step 3 of the window 2-5; the resume records 4-5
    into files of its own (it wrote over the first part's). A restart from step 1 writes over
    its own files: the same steps again."""
    first = StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=4)
    run(first, range(1, 4))
    first.close()
    resumed = StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=4, first_step=4)
    run(resumed, range(4, 7))
    profile = tmp_path / "profile"
    assert (profile / "rank-0.txt").read_text().startswith("steps 2-3: ")
    assert (profile / "rank-0.from-step-4.txt").read_text().startswith("steps 4-5: ")
    assert sorted(p.name for p in profile.iterdir()) == [
        "rank-0.from-step-4.json", "rank-0.from-step-4.txt", "rank-0.json", "rank-0.txt"]


def test_a_step_that_failed_is_not_counted_and_a_stopped_ranks_partial_file_goes(tmp_path):
    """An error in step 4 of the window 2-5: the table says steps 2-3 (it said 2-4, a step that
    never ended). A rank stopped while writing left kineto's .tmp: the next start removes it."""
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=4)
    run(profiler, range(1, 4))
    profiler.begin(4)  # and step 4 raises
    assert profiler.close().read_text().startswith(
        "steps 2-3: 0.020 s of wall time (the run stopped before step 5)")
    partial = tmp_path / "profile" / "rank-0.json.tmp"
    partial.write_text('{"traceEvents": [')
    other = tmp_path / "profile" / "rank-1.json.tmp"  # another rank's: its own start's to remove
    other.write_text("{")
    StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=4)
    assert not partial.exists() and other.exists()
    lone = StepProfiler(tmp_path / "b", 0, torch.device("cpu"), start=2, steps=2)
    run(lone, range(1, 2))
    lone.begin(2)
    assert lone.close().read_text().startswith(
        "step 2, the window's first, did not end: what it recorded of it (the run stopped "
        "before step 3)")


def test_a_run_stopped_inside_the_window_writes_what_it_recorded(tmp_path):
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), start=2, steps=5)
    run(profiler, range(1, 4))  # preempted after step 3
    table = profiler.close()
    assert table.read_text().startswith(
        "steps 2-3: 0.020 s of wall time (the run stopped before step 6)")
    assert profiler.close() is None  # once


def test_off_records_nothing(tmp_path):
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), start=0, steps=3)
    assert run(profiler, range(1, 4)) == [None] * 3 and profiler.close() is None
    assert not (tmp_path / "profile").exists()

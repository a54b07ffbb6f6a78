"""The progress lines rank 0 prints when stdout is not a terminal: each with the ETA at the pace
since the launch's first step, a skipped step always said."""

from partrain.observe import metrics
from partrain.observe.metrics import ProgressDisplay


def _rec(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0,
            "step_time_s": 0.5, **extra}


def test_plain_lines_carry_the_eta(capsys, monkeypatch):
    # Reported at the end of each step: step 1's own time (compiling, building ops) is before
    # the first mark and does not count; then 2 s a step.
    clock = iter([100.0, 102.0, 104.0, 106.0, 108.0])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv("COLUMNS", "300")  # one line per step
    display = ProgressDisplay(max_steps=1000, log_every=2, enabled=True)
    for step in range(1, 6):
        display.update(_rec(step))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "2", "4"]
    assert "eta" not in lines[0]  # one step: no pace yet
    assert lines[1].endswith("eta 0:33:16"), lines[1]  # 998 steps left x 2 s
    assert lines[2].endswith("eta 0:33:12"), lines[2]  # 996 x 2 s


def test_the_last_step_has_no_eta_and_a_skipped_step_is_always_said(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    display = ProgressDisplay(max_steps=3, log_every=100, enabled=True)
    display.update(_rec(1))
    display.update(_rec(2, skipped=True, skipped_in_a_row=1, nonfinite_param="output.weight"))
    display.update(_rec(3))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "skipped (non-finite; 1 in a row, first in output.weight)" in lines[1]
    assert "eta" not in lines[2]


def test_a_step_is_one_line_in_a_file_or_a_pipe(capsys, monkeypatch):
    """Not a terminal and no COLUMNS (a SLURM job's log, `| tee`): a step's line with its MFU,
    epoch and ETA is one line, not wrapped at rich's 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    display = ProgressDisplay(max_steps=100000, log_every=1, enabled=True)
    for step in range(1, 4):
        display.update(_rec(step, mfu=0.45, epoch=1.25))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert len(lines[2]) > 80 and "epoch 1.25" in lines[2] and " eta " in lines[2], lines


def test_only_a_terminal_or_columns_sets_the_width(monkeypatch):
    import os

    from partrain.observe.width import READ_LATER_COLUMNS, width_for

    monkeypatch.delenv("COLUMNS", raising=False)
    read, write = os.pipe()
    primary, secondary = os.openpty()
    try:
        with os.fdopen(write, "w") as pipe, os.fdopen(secondary, "w") as terminal:
            assert width_for(pipe) == READ_LATER_COLUMNS
            assert width_for(terminal) is None  # rich asks the terminal
            monkeypatch.setenv("COLUMNS", "120")
            assert width_for(pipe) is None  # rich reads COLUMNS
    finally:
        os.close(read)
        os.close(primary)


def test_a_moe_steps_line_says_its_routing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    display = ProgressDisplay(max_steps=3, log_every=1, enabled=True)
    display.update(_rec(1, moe_load_balance=2.06, moe_aux_loss=0.0432, moe_dropped=0.366))
    [line] = capsys.readouterr().out.splitlines()
    assert line.endswith("load max/mean 2.06  aux 0.0432  dropped 36.6%"), line


def test_the_summary_rate_is_the_steady_steps_tokens_over_their_time(tmp_path):
    """tokens/s and MFU in the run summary: the steady steps' tokens over their seconds (100
    tokens a step; steps 2 and 3 took 1 s and 3 s: 200 / 4 = 50 tokens/s). A mean of the per-step
    rates (100 and 33.3) said 67, more than the run delivered."""
    from rich.console import Console

    history = [{"step": s, "loss": 2.0, "tokens": 100 * s, "tokens_per_s": 100 / t,
                "step_time_s": t, "mfu": 0.4 / t} for s, t in [(1, 9.0), (2, 1.0), (3, 3.0)]]
    console = Console(width=200, record=True)
    console.print(metrics.summary_table(history, [], 13.0, tmp_path))
    text = console.export_text()
    assert "50 (over steps 2-3)" in text, text
    assert "20.0% (over steps 2-3)" in text, text  # 0.4 x 2 steps / 4 s

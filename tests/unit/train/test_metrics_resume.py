"""metrics.jsonl on a resume (train/assemble.py `_keep_metrics_until`): the steps after the
checkpoint go, and so does what an interrupted write left behind, instead of stopping the resume."""

import json
import logging

from partrain.train.assemble import _keep_metrics_until


def _records(step_range, eval_at=()):
    lines = []
    for step in step_range:
        lines.append(json.dumps({"step": step, "loss": 5.0 - step / 10}))
        if step in eval_at:
            lines.append(json.dumps({"step": step, "val_loss": 4.0}))
    return lines


def test_the_steps_after_the_checkpoint_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(_records(range(1, 9), eval_at=(4, 8))) + "\n")
    _keep_metrics_until(path, 4)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], "val_loss" in r) for r in kept] == [
        (1, False), (2, False), (3, False), (4, False), (4, True)]


def test_a_line_cut_short_is_dropped_with_a_warning(tmp_path, caplog):
    """A full disk or a power cut: the last line ends half way, padded with NUL bytes, or holds
    bytes that are not UTF-8. Every line that is a record stays, and the file ends in a newline
    so that the next record starts a line of its own."""
    path = tmp_path / "metrics.jsonl"
    good = _records(range(1, 5))
    path.write_bytes(("\n".join(good) + "\n").encode() + b'{"step": 5, "loss": 4.\xff'
                     + b"\0" * 32 + b"\n" + b"\0" * 100 + b"\n[1, 2]\n" + b'{"step": "x"}')
    with caplog.at_level(logging.WARNING, logger="partrain"):
        _keep_metrics_until(path, 3)
    assert path.read_text() == "\n".join(good[:3]) + "\n"
    assert f"{path}: dropped 3 line(s) that are not a metrics record" in caplog.text


def test_nothing_to_drop_says_nothing(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(_records(range(1, 4))) + "\n")
    with caplog.at_level(logging.WARNING, logger="partrain"):
        _keep_metrics_until(path, 5)
    assert len(path.read_text().splitlines()) == 3 and not caplog.text

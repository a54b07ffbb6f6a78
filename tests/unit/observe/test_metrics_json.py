"""metrics.jsonl is strict JSON: Python's json writes NaN and Infinity as bare tokens that jq
and strict parsers refuse (a skipped step's loss and grad_norm)."""

import json
import math

from partrain.observe.metrics import MetricsLog, recorded_losses


def test_a_skipped_steps_non_finite_values_are_null_and_its_good_steps_read_back(tmp_path):
    heard = []

    class Curves:
        def write(self, record):
            heard.append(record)

        def close(self):
            pass

    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True, curves=Curves())
    log.write({"step": 1, "loss": 5.5, "grad_norm": 7.6})
    log.write({"step": 2, "loss": math.nan, "grad_norm": math.inf, "skipped": True})
    log.close()

    def refuse(token):
        raise ValueError(token)

    lines = [json.loads(line, parse_constant=refuse)
             for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1] == {"step": 2, "loss": None, "grad_norm": None, "skipped": True}
    (one, first), (two, second) = recorded_losses(tmp_path)  # null reads back as not finite
    assert (one, first, two) == (1, 5.5, 2) and math.isnan(second)
    assert math.isnan(heard[1]["loss"])  # the curves get the value as it was

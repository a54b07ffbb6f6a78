"""Bad values of `partrain plan`'s flags of issue 29: exit 2, one `error:` line naming the
flag, the value and the rule, no traceback."""

import pytest

from tests.unit.helpers import one_line


@pytest.mark.parametrize("args,fragment", [
    (["--tokens-per-step", "4X"], "--tokens-per-step '4X' is not a number of tokens"),
    (["--tokens-per-step", "-1"], "--tokens-per-step '-1' is not a number of tokens"),
    (["--tokens-per-step", "1000"],
     "--tokens-per-step 1000 = 1,000 tokens is not a multiple of train.seq_len=256"),
    (["--tokens-per-step", "0.5"], "--tokens-per-step 0.5 is 0.5 tokens"),
    (["--tokens-per-step", "8K", "train.global_batch_size=8"],
     "--tokens-per-step 8K and train.global_batch_size both set the global batch"),
    (["--explain", "tp=2"], "--explain is a --search option; add --search"),
    (["--search", "--gpus", "8", "--explain", "tp"], "--explain 'tp': each item is key=value"),
    (["--search", "--gpus", "8", "--explain", "tp=two"], "--explain tp=two: tp must be a whole"),
    (["--search", "--gpus", "8", "--explain", "ckpt=some"],
     "--explain ckpt=some: ckpt must be one of none, selective, full"),
    (["--search", "--gpus", "8", "--explain", " "], "names no degree"),
    (["--hardware", "H999"], "--hardware H999: neither a preset"),
    (["launcher.allow_predicted_oom=maybe"], "launcher.allow_predicted_oom"),
])
def test_bad_plan_flags(run_main, args, fragment):
    result = run_main("plan", *args)
    assert result.code == 2, result.stdout
    assert "Traceback" not in result.stderr
    text = one_line(result.stderr)
    assert text.startswith("error:") and len(result.stderr.strip().splitlines()) == 1, text
    assert fragment in text


def test_tokens_per_step_sets_the_batch(run_main):
    import json

    plan = json.loads(run_main("plan", "--tokens-per-step", "8K", "--json").stdout)
    assert plan["batch"]["global_batch_size"] == 8 * 1024 // plan["batch"]["seq_len"]
    assert plan["batch"]["tokens_per_step"] == 8 * 1024

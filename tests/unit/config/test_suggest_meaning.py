"""Did-you-mean for config keys follows meaning before spelling (config/keys.py SYNONYMS): other
tools' names for partrain's keys get the key they mean, not the one spelt nearest
(`parallel.zero` is next to `parallel.ep`)."""

import pytest

from partrain.config.keys import SCHEMA_KEYS, SYNONYMS, groups, suggest


def _suggested(key: str) -> str:
    return suggest(key, SCHEMA_KEYS if "." in key else [*SCHEMA_KEYS, *groups()])


@pytest.mark.parametrize("typed, meant", [
    ("parallel.zero", "parallel.zero_stage"),
    ("zero", "parallel.zero_stage"),
    ("parallel.tensor_parallel", "parallel.tp"),
    ("parallel.tp_size", "parallel.tp"),
    ("parallel.tensor_model_parallel_size", "parallel.tp"),
    ("parallel.pipeline_parallel", "parallel.pp"),
    ("parallel.data_parallel", "parallel.dp"),
    ("train.grad_accum", "train.micro_batches"),
    ("train.gradient_accumulation_steps", "train.micro_batches"),
    ("lr", "optim.lr"),
    ("train.lr", "optim.lr"),
    ("learning_rate", "optim.lr"),
    ("optim.max_grad_norm", "optim.grad_clip"),
    ("train.train_iters", "train.max_steps"),
    ("model.hidden_size", "model.dim"),
    ("model.num_attention_heads", "model.n_heads"),
    ("train.gradient_checkpointing", "train.activation_checkpointing"),
])
def test_a_name_from_another_tool_gets_the_key_it_means(typed, meant):
    assert _suggested(typed) == f" (did you mean {meant}?)"


def test_spelling_still_finds_a_typo():
    assert _suggested("parallel.zero_stag") == " (did you mean parallel.zero_stage?)"
    assert _suggested("paralel.tp") == " (did you mean parallel.tp?)"


def test_a_synonym_is_never_a_key_the_schema_lacks():
    assert not [key for key in SYNONYMS.values() if key not in SCHEMA_KEYS]
    assert "zero_stage" not in suggest("parallel.zero", ["parallel.ep", "parallel.tp"])


def test_the_cli_says_it(run_main):
    result = run_main("show", "parallel.zero=2")
    assert result.code == 2
    assert "unknown config key parallel.zero" in result.stderr
    assert "(did you mean parallel.zero_stage?)" in result.stderr
    assert "parallel.ep" not in result.stderr

"""`partrain plan --search` says what it priced (issue 29): the batch in sequences and tokens,
the sequence length, the dtype and the hardware with where each came from, tokens/s per GPU and
per job, a batch too small to feed the GPUs named as the limit, `--tokens-per-step`, and
`--explain` for a layout the user has in mind."""

import json

import pytest

from tests.unit.helpers import one_line


@pytest.fixture(autouse=True)
def no_recompose(monkeypatch):
    """Skip partrain's validation of the best layouts (a Hydra compose each, about 2 s per
    search; test_search.py holds it): what these tests check comes before it."""
    import partrain.plan.search_checks as search_module

    monkeypatch.setattr(search_module, "validated",
                        lambda result, *args, **kwargs: {**result, "refused": []})


def search(run_main, *args):
    result = run_main("plan", "--search", *args, "--json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_the_assumptions_and_their_sources(run_main):
    found = search(run_main, "--gpus", "8")
    a = found["assumptions"]
    assert (a["global_batch_size"], a["seq_len"]) == (16, 256)  # the quickstart's
    assert a["tokens_per_step"] == a["global_batch_size"] * a["seq_len"]
    assert a["sources"]["train.global_batch_size"].startswith("config quickstart")
    assert a["sources"]["hardware"] == "the default --hardware" and a["hardware"] == "H100-SXM"
    assert a["dtype"] == "bf16" and a["sources"]["train.dtype"].startswith("default")
    for row in found["best"]:
        world = row["layout"]["dp"] * row["layout"]["tp"] * row["layout"]["pp"] * row["layout"]["cp"]
        assert row["tokens_per_s_per_gpu"] * world == pytest.approx(row["tokens_per_s_per_job"])
    found = search(run_main, "train.global_batch_size=32", "--gpus", "8", "--hardware", "a100")
    assert found["assumptions"]["sources"]["train.global_batch_size"] == "override"
    assert found["assumptions"]["sources"]["hardware"] == "--hardware"


def test_the_table_says_it_first(run_main):
    result = run_main("plan", "--search", "--gpus", "8")
    first = one_line(result.stdout.splitlines()[0])
    assert first.startswith("priced: global batch 16 sequences x 256 tokens = 4,096 tokens")
    assert "H100-SXM" in first and "bf16" in first
    header = one_line(result.stdout.split("┡")[0])
    assert "per GPU" in header and "per job" in header


def test_a_batch_too_small_is_the_limit(run_main):
    found = search(run_main, "--gpus", "64")  # 16 sequences for 64 GPUs
    best = found["best"][0]["layout"]
    assert best["dp"] <= 16
    assert found["batch_limit"] and "16 sequences" in found["batch_limit"]
    assert "cannot feed dp > 16" in found["batch_limit"]
    assert "train.global_batch_size" in found["batch_limit"]
    # With a batch that feeds every GPU the batch is not named.
    roomy = search(run_main, "--gpus", "8", "--tokens-per-step", "64K")
    assert roomy["assumptions"]["global_batch_size"] == 64 * 1024 // 256
    assert roomy["assumptions"]["sources"]["train.global_batch_size"] == "--tokens-per-step 64K"
    assert roomy["batch_limit"] is None


def test_explain_a_layout_that_ranks(run_main):
    found = search(run_main, "--gpus", "8", "--explain", "tp=2 pp=1")
    ex = found["explain"]
    assert ex["verdict"] == "ranked" and 1 <= ex["rank"] <= ex["of"] == found["fit"]
    layout = ex["best_variant"]["layout"]
    assert (layout["tp"], layout["pp"]) == (2, 1)
    if ex["rank"] > 1:
        assert ex["best_variant"]["tokens_per_s"] <= found["best"][0]["tokens_per_s"] * 1.01


def test_explain_a_layout_the_rules_refuse(run_main):
    ex = search(run_main, "--gpus", "8", "--explain", "tp=3")["explain"]
    assert ex["verdict"] == "not enumerated" and "model.n_heads=4" in ex["reason"]
    ex = search(run_main, "--gpus", "8", "--explain", "pp=3")["explain"]
    assert ex["verdict"] == "not enumerated" and "model.n_layers" in ex["reason"]


def test_explain_a_layout_that_does_not_fit(run_main):
    # A 7B model whole on each of 8 GPUs, 16 sequences per micro-batch: no variant fits.
    ex = search(run_main, "model=llama-7b", "train.seq_len=4096", "train.global_batch_size=128",
                "--gpus", "8", "--explain", "dp=8 mb=16 zero=0")["explain"]
    assert ex["verdict"] == "does not fit"
    assert ex["memory_bytes"] > 0.9 * 80 * 2**30

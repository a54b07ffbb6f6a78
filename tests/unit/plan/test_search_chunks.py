"""`partrain plan --search` tries interleaved 1F1B with every chunk count per rank the layers
allow (time_model.virtual_stage_counts, up to search.MAX_CHUNKS_PER_RANK), not only two, and
`--write-recipe` carries the count it chose into a recipe partrain's validation accepts."""

import dataclasses
import json

from omegaconf import OmegaConf

import partrain.plan.search as search_module
from partrain.plan.hardware import PRESETS
from partrain.plan.time_model import step_time, virtual_stage_counts
from tests.unit.helpers import compose

H100 = PRESETS["H100-SXM"]
# Llama-7B's 32 layers on 32 GPUs with 8 sequences of 4,096 tokens a step: too few sequences for
# dp, so the GPUs go to pp, and with as few micro-batches as stages the bubble is most of what
# more chunks per rank can win back.
CASE = ("model=llama-7b", "train.seq_len=4096", "train.global_batch_size=8")
GPUS = 32


def _priced_by_chunks(cfg, layout) -> dict[int, float]:
    """The models' own verdict on `layout` with each chunk count the search may try (1: plain
    1F1B): tokens/s by the time model, for those the memory model fits in the search's budget."""
    model = OmegaConf.to_object(cfg.model)
    seq, gbs = cfg.train.seq_len, cfg.train.global_batch_size
    counts = virtual_stage_counts(model.n_layers, layout.pp,
                                  layout.pp * search_module.MAX_CHUNKS_PER_RANK)
    priced = {}
    for v in (1, *counts):
        variant = dataclasses.replace(layout, pp_virtual_stages=v,
                                      pp_schedule="interleaved_1f1b" if v > 1 else "1f1b")
        memory = search_module._memory(model, variant, gbs, seq, {})["total"]
        if memory <= H100.memory_bytes * search_module.MEMORY_MARGIN:
            priced[v] = step_time(model, variant, gbs, seq, H100)["tokens_per_s"]
    return priced


def test_the_search_picks_more_than_two_chunks_where_that_wins(monkeypatch):
    cfg = compose(*CASE)
    best = search_module.search(cfg, GPUS, H100, top=1)["best"][0]
    priced = _priced_by_chunks(cfg, best.layout)
    winner = max(priced, key=priced.get)
    # The case must be one where more than two chunks win by more than a tie, or the test
    # would pass on a search that tries only v = 2.
    assert winner > 2 and priced[winner] > priced.get(2, 0) * search_module.TIE, priced
    assert best.layout.pp_schedule == "interleaved_1f1b"
    assert best.layout.pp_virtual_stages == winner
    assert best.time["tokens_per_s"] == priced[winner]
    # ... and the best of a search held to two chunks per rank is slower.
    monkeypatch.setattr(search_module, "MAX_CHUNKS_PER_RANK", 2)
    two = search_module.search(cfg, GPUS, H100, top=1)["best"][0]
    assert two.layout.pp_virtual_stages <= 2
    assert two.time["tokens_per_s"] < best.time["tokens_per_s"]


def test_the_chunk_count_is_capped():
    """The cap holds even where the layers allow more (32 layers on pp=2: v up to 16)."""
    cfg = compose(*CASE)
    model = OmegaConf.to_object(cfg.model)
    assert max(virtual_stage_counts(model.n_layers, 2)) > search_module.MAX_CHUNKS_PER_RANK
    tried = {layout.pp_virtual_stages
             for layout in search_module.layouts(model, GPUS, H100, 64, 4096)
             if layout.pp == 2 and layout.pp_schedule == "interleaved_1f1b"}
    assert tried == {v for v in virtual_stage_counts(model.n_layers, 2)
                     if v <= search_module.MAX_CHUNKS_PER_RANK}


def test_write_recipe_carries_the_chunk_count(run_main, tmp_path):
    path = tmp_path / "best.yaml"
    res = run_main("plan", "--search", *CASE, "--gpus", str(GPUS), "--json",
                   "--write-recipe", str(path))
    assert res.code == 0, res.stderr
    best = json.loads(res.stdout)["best"][0]["layout"]
    assert best["pp_virtual_stages"] > 2  # what the test above holds the search to
    written = OmegaConf.load(path).parallel
    assert (written.pp_schedule, written.pp_virtual_stages) == \
        ("interleaved_1f1b", best["pp_virtual_stages"])
    planned = run_main("plan", str(path), "--json")  # partrain's validation, as launch runs it
    assert planned.code == 0, planned.stderr
    pipeline = json.loads(planned.stdout)["pipeline"]
    assert (pipeline["schedule"], pipeline["virtual_stages"]) == \
        ("interleaved_1f1b", best["pp_virtual_stages"])


def test_explain_names_the_chunk_counts_the_layers_allow(run_main):
    res = run_main("plan", "--search", *CASE, "--gpus", str(GPUS), "--json",
                   "--explain", "pp=8 v=3")
    assert res.code == 0, res.stderr
    ex = json.loads(res.stdout)["explain"]
    assert ex["verdict"] == "not enumerated"
    allowed = virtual_stage_counts(32, 8, 8 * search_module.MAX_CHUNKS_PER_RANK)
    assert f"pp=8: v in {allowed}" in ex["reason"]

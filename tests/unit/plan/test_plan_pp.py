"""`partrain plan` for pipeline parallelism: the stages, the bubble and the timeline."""

import json

import pytest


def _plan(run_main, *args):
    result = run_main("plan", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_stages_split_blocks_and_parameters(run_main):
    plan = _plan(run_main, "parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[1,3]")
    stages = plan["pipeline"]["stages"]
    assert [(s["pp_rank"], s["blocks"], s["embedding"], s["head"]) for s in stages] == [
        (0, [0, 0], True, False), (1, [1, 3], False, True)]
    # Every parameter lives on exactly one stage.
    assert sum(s["params_per_rank"] for s in stages) == plan["model"]["params"]
    assert plan["model"]["params_per_rank"] == max(s["params_per_rank"] for s in stages)


def test_interleaved_stages_are_non_adjacent(run_main):
    plan = _plan(run_main, "parallel.pp=2", "parallel.dp=1", "parallel.pp_virtual_stages=2",
                 "parallel.pp_schedule=interleaved_1f1b")
    stages = plan["pipeline"]["stages"]
    assert [(s["stage"], s["pp_rank"], s["chunk"], s["blocks"]) for s in stages] == [
        (0, 0, 0, [0, 0]), (1, 1, 0, [1, 1]), (2, 0, 1, [2, 2]), (3, 1, 1, [3, 3])]
    assert plan["pipeline"]["bubble_theory"] == pytest.approx(1 / (2 * 4 + 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_and_timeline(run_main, schedule):
    plan = _plan(run_main, "parallel.pp=2", "parallel.dp=1", f"parallel.pp_schedule={schedule}")
    pipe = plan["pipeline"]
    m = plan["batch"]["micro_batches"]
    assert pipe["bubble_theory"] == pytest.approx((2 - 1) / (m + 2 - 1))
    assert pipe["timeline_micro_batches"] == m
    for spans in pipe["timeline"]:
        assert sorted((s["op"], s["mb"]) for s in spans) == sorted(
            (op, i) for op in "FB" for i in range(m))
    assert pipe["peak_in_flight"] == ([m, m] if schedule == "gpipe" else [2, 1])


def test_long_pipelines_are_drawn_short(run_main):
    plan = _plan(run_main, "llama-7b-tp4-pp2")
    pipe = plan["pipeline"]
    assert pipe["micro_batches"] == 256 and pipe["timeline_micro_batches"] == 16
    assert pipe["bubble_theory"] == pytest.approx(1 / 257)


def test_human_plan_draws_the_timeline(run_main):
    result = run_main("plan", "parallel.pp=2", "parallel.dp=1")
    assert result.code == 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("pp ")]
    assert len(lines) == 2 and "F0" in lines[0] and "B3" in lines[1]
    assert "bubble (p-1)/(m+p-1) = 0.200" in result.stdout


def test_no_pipeline_section_without_pp(run_main):
    assert _plan(run_main)["pipeline"] is None


def test_tied_embedding_counts_once_in_the_model_and_on_each_end_stage(run_main):
    """A tied head is a copy of the embedding on the last stage: real memory there, one
    parameter of the model."""
    untied = _plan(run_main, "parallel.pp=2", "parallel.dp=1")
    plan = _plan(run_main, "parallel.pp=2", "parallel.dp=1", "model.tie_embeddings=true")
    matrix = 256 * 128
    assert plan["model"]["params"] == untied["model"]["params"] - matrix
    assert [s["params_per_rank"] for s in plan["pipeline"]["stages"]] == \
        [s["params_per_rank"] for s in untied["pipeline"]["stages"]]
    one = _plan(run_main, "model.tie_embeddings=true")
    assert one["model"]["params_per_rank"] == one["model"]["params"]
    assert (plan["model"]["tie_embeddings"], untied["model"]["tie_embeddings"]) == (True, False)
    shown = run_main("plan", "parallel.pp=2", "parallel.dp=1", "model.tie_embeddings=true")
    assert "norm + tied head + loss" in shown.stdout

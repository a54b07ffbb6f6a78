"""`partrain plan` for tensor parallelism: what each rank holds and the tp collectives of a step,
checked against arithmetic done here by hand from the tiny model's shape; and the context
parallelism section."""

import json

import pytest

from tests.unit.helpers import validated

# tiny: n_layers=4, dim=128, vocab 256, ffn 352 (8/3 * 128 rounded up to 32); quickstart batch:
# 16 sequences of 256 tokens, micro_batch_size 4.
L, D, V, FFN, SEQ = 4, 128, 256, 352, 256


def _plan(run_main, *args):
    result = run_main("plan", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_params_per_rank_split_all_but_norms(run_main):
    plan = _plan(run_main, "parallel.tp=2", "parallel.dp=1")
    norms = (2 * L + 1) * D
    total = plan["model"]["params"]
    assert total == L * (D * 32 * (2 * 4 + 2 * 2) + 3 * D * FFN + 2 * D) + 2 * V * D + D
    assert plan["model"]["params_per_rank"] == (total - norms) // 2 + norms


def test_tp_collectives_per_step(run_main):
    plan = _plan(run_main, "parallel.tp=2", "parallel.dp=1")
    tpc = plan["tp_collectives"]
    micro_batches, tokens = 4, 4 * SEQ  # global 16 = 4 * 4 * dp 1
    ops = {r["where"]: r for r in tpc["per_step"]}
    fwd = ops["attention/MLP outputs (fwd)"]
    # Megatron: one all-reduce per attention and one per MLP forward, per micro-batch.
    assert (fwd["op"], fwd["calls"], fwd["elements"]) == ("all_reduce", 2 * L * micro_batches, tokens * D)
    assert ops["attention/MLP inputs (bwd)"]["calls"] == 2 * L * micro_batches
    expected = micro_batches * ((4 * L + 2) * tokens * D + 3 * tokens) * 4 + 4
    assert tpc["bytes_per_step"] == expected == sum(r["bytes"] for r in tpc["per_step"])


def test_sequence_parallel_moves_the_same_bytes_in_twice_the_collectives(run_main):
    plain = _plan(run_main, "parallel.tp=2", "parallel.dp=1")["tp_collectives"]
    sp = _plan(run_main, "parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true")
    sp = sp["tp_collectives"]
    assert sp["sequence_parallel"]
    assert {r["op"] for r in sp["per_step"]} == {"all_gather", "reduce_scatter", "all_reduce"}
    calls = lambda rows, op: sum(r["calls"] for r in rows if r["op"] == op)  # noqa: E731
    assert calls(sp["per_step"], "all_gather") == calls(sp["per_step"], "reduce_scatter")
    assert calls(sp["per_step"], "all_gather") == calls(plain["per_step"], "all_reduce") - 3 * 4 - 1
    # Each all-reduce became an all-gather plus a reduce-scatter of the same tensor: twice the
    # payload, the same bytes on the wire (a ring all-reduce sends 2(n-1)/n, the others (n-1)/n).
    # The only extra traffic is the norm gradients summed over tp once per step.
    norm_grads = (2 * L + 1) * D * 4
    assert sp["wire_bytes_per_step"] - plain["wire_bytes_per_step"] == norm_grads
    loss_and_norm = 4 * 3 * (4 * SEQ) * 4 + 4  # micro-batches * 3 loss all-reduces of T, grad norm
    assert sp["bytes_per_step"] - norm_grads == 2 * plain["bytes_per_step"] - loss_and_norm


def test_no_tp_no_collectives(run_main):
    plan = _plan(run_main)
    assert plan["tp_collectives"]["per_step"] == []
    assert plan["model"]["params_per_rank"] == plan["model"]["params"]


def test_human_plan_shows_the_tp_table(run_main):
    result = run_main("plan", "parallel.tp=2", "parallel.dp=1")
    assert result.code == 0
    assert "tensor-parallel collectives per step" in result.stdout
    assert "per rank" in result.stdout


def test_sequence_parallel_without_tp_is_a_warning():
    _, _, warnings = validated("parallel.sequence_parallel=true")
    assert warnings == ["parallel.sequence_parallel=true has no effect with parallel.tp=1"]


# Context parallelism in the plan: the bytes a cp rank sends per step and the activations it keeps.

@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_plan_shows_context_parallel_traffic_and_activations(run_main, method):
    from omegaconf import OmegaConf

    from partrain.config.schema import Config
    from partrain.plan.costs import cp_traffic

    result = run_main("plan", "parallel.cp=2", "parallel.dp=2", f"parallel.cp_method={method}",
                      "--json")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    ctx, batch = plan["context"], plan["batch"]
    assert (ctx["cp"], ctx["method"], ctx["tokens_per_rank"]) == (2, method, batch["seq_len"] // 2)
    model = OmegaConf.structured(Config).model  # the quickstart's tiny model
    rows = cp_traffic(model, batch["micro_batch_size"], batch["seq_len"], 2, 1, method,
                      model.n_layers)
    assert ctx["bytes_per_step"] == batch["micro_batches"] * sum(r["bytes"] for r in rows) > 0
    # The memory model's figure, the peak line's activations (one micro-batch in flight without
    # pp): a second formula said another; about half of cp=1's (the ring keeps a little more).
    [stage] = plan["memory_per_stage"]
    assert ctx["activation_bytes_per_micro_batch"] == stage["activation_bytes"]
    ratio = ctx["activation_bytes_per_micro_batch_cp1"] / ctx["activation_bytes_per_micro_batch"]
    assert 1.8 < ratio <= 2.0, ratio
    assert [g for g in plan["groups"]["cp"]] == [[0, 1], [2, 3]]
    human = run_main("plan", "parallel.cp=2", "parallel.dp=2", f"parallel.cp_method={method}")
    assert f"context-parallel traffic per step, per rank of a cp group of 2 ({method})" in \
        " ".join(human.stdout.split())


def test_plan_without_cp_has_no_context_traffic(run_main):
    plan = json.loads(run_main("plan", "--json").stdout)
    assert plan["context"]["per_step"] == [] and plan["context"]["method"] is None

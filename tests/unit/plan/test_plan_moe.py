"""`partrain plan` for a mixture of experts: parameters (all and active), experts and parameters
per rank under ep, and the all-to-all bytes per step, against the built model and arithmetic
done here by hand; the Mixtral-shaped recipe against Mixtral-8x7B's published size."""

import json

from tests.unit.helpers import compose


def _plan(run_main, *args):
    result = run_main("plan", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_tiny_moe_plan_matches_the_built_model(run_main):
    from partrain.models.llama import build_model

    plan = _plan(run_main, "moe-tiny", "parallel.dp=4", "parallel.ep=2", "--world-size", "4")
    model = build_model(compose("model=tiny-moe").model, 0)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert plan["model"]["params"] == total
    assert plan["model"]["params_per_rank"] == total - experts // 2  # half the experts each
    ex = plan["experts"]
    assert (ex["n_experts"], ex["experts_per_rank"], ex["ep"], ex["moe_blocks"]) == (8, 4, 2, 4)
    assert ex["ep_groups"] == [[0, 1], [2, 3]]  # consecutive dp ranks
    assert ex["expert_params_per_rank"] == experts // 2
    # Active per token: 2 of 8 routed experts (3 * 128 * 128 each) in each of the 4 blocks.
    assert plan["model"]["active_params"] == total - 4 * 6 * 3 * 128 * 128
    # Uniform routing: each of 2 * 4096/4 rows per block leaves with probability 1/2, out and
    # back, forward and backward; fp32 rows of 128.
    tokens = 16 * 256 // 4
    a2a = ex["all_to_all"]
    assert ex["tokens_routed_per_rank"] == tokens
    assert a2a["rows_sent"] == tokens * 2 * 4 // 2 * 4
    assert a2a["bytes_sent"] == a2a["rows_sent"] * 128 * 4
    assert a2a["count_bytes"] == 4 * 8 * 4 * 1  # 4 of 8 counts to the other rank, 1 micro-batch x 4 blocks


def test_dense_plan_has_no_experts(run_main):
    plan = _plan(run_main)
    assert plan["experts"] is None and plan["degrees"]["ep"] == 1
    assert plan["model"]["active_params"] == plan["model"]["params"]


def test_mixtral_recipe_plans_mixtral_8x7b(run_main):
    plan = _plan(run_main, "mixtral-8x7b-ep8")
    m, ex = plan["model"], plan["experts"]
    assert round(m["params"] / 1e9, 1) == 46.7 and round(m["active_params"] / 1e9, 1) == 12.9
    assert (plan["degrees"]["ep"], ex["experts_per_rank"], ex["moe_blocks"]) == (8, 1, 32)
    # pp=4: 8 blocks per stage, one expert of 3 * 4096 * 14336 each
    assert ex["expert_params_per_rank"] == 8 * 3 * 4096 * 14336


def test_plan_shows_the_experts(run_main):
    result = run_main("plan", "moe-tiny", "parallel.ep=2")
    assert result.code == 0, result.stderr
    assert "experts: 8 per MoE block (top-2, 1 shared), 4 MoE blocks, 4 per rank" in result.stdout
    assert "active per token" in result.stdout

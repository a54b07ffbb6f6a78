"""`partrain plan` and the models behind it for FSDP2 (parallel.zero_backend=fsdp) and HSDP
(parallel.dp_replicate): the groups it shows, the bytes per rank by its formulas, and the terms the
time model charges, each against arithmetic done here by hand."""

import json

import pytest

from partrain.plan.costs import zero_memory
from partrain.plan.hardware import PRESETS
from partrain.plan.time_model import Layout, step_time
from tests.unit.helpers import compose

FSDP = ("parallel.zero_stage=3", "parallel.zero_backend=fsdp")


def _plan(run_main, *args):
    result = run_main("plan", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_hsdp_plan_shows_the_shard_and_replicate_groups(run_main):
    plan = _plan(run_main, *FSDP, "parallel.dp=8", "parallel.dp_replicate=2", "parallel.tp=2",
                 "train.micro_batch_size=2",
                 "launcher.nproc_per_node=16")
    h = plan["hsdp"]
    assert (h["dp_replicate"], h["dp_shard"]) == (2, 4)
    # dp ranks are tp = 2 apart: shards inside runs of 4 consecutive dp ranks.
    assert h["shard_groups"] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert h["replicate_groups"] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    # Memory: the shards are split over a replica's 4 ranks, not all 8.
    assert plan["memory"]["dp"] == 4
    psi = plan["memory"]["params_per_rank"]
    assert plan["memory"]["total"] == pytest.approx(16 * psi / 4)
    assert _plan(run_main, *FSDP, "parallel.dp=8", "train.micro_batch_size=2",
                 "launcher.nproc_per_node=8")["hsdp"] is None


def test_hsdp_plan_prints_its_groups(run_main):
    result = run_main("plan", *FSDP, "parallel.dp=4", "parallel.dp_replicate=2",
                      "launcher.nproc_per_node=4")
    assert result.code == 0, result.stderr
    assert ("HSDP: dp 4 = dp_replicate 2 x dp_shard 2; FSDP shards inside [0,1] [2,3] and "
            "all-reduces gradients across [0,2] [1,3]") in result.stdout


@pytest.mark.parametrize("dtype,w", [("bf16", 2), ("fp32", 4)])
def test_fsdp_memory_formulas(dtype, w):
    psi, nd = 1_000_000, 8
    three = zero_memory(3, psi, nd, dtype, "fsdp")
    assert (three["param_bytes"], three["grad_bytes"], three["optim_bytes"]) == (
        4 * psi / nd, 4 * psi / nd, 8 * psi / nd)
    assert three["formula"] == "16Ψ/Nd"
    two = zero_memory(2, psi, nd, dtype, "fsdp")
    assert two["total"] == three["total"] + w * psi and two["formula"] == f"{w}Ψ + 16Ψ/Nd"
    pipe = zero_memory(3, psi, nd, dtype, "fsdp", pipeline=True)
    assert pipe["total"] == (w + 4) * psi + 12 * psi / nd
    # DeepSpeed's ZeRO-3 in fp32 keeps a master copy besides: 20Ψ/Nd.
    assert zero_memory(3, psi, nd, "fp32")["total"] == 20 * psi / nd


def _time(**layout):
    cfg = compose("model=llama-1b", "train.seq_len=2048", "model.max_seq_len=4096").model
    return step_time(cfg, Layout(micro_batch_size=1, **layout), 64, 2048, PRESETS["H100-SXM"])


def test_fsdp_is_priced_without_deepspeeds_hooks_and_stage_2_gathers_once():
    deepspeed = _time(dp=8, zero_stage=3)
    fsdp3 = _time(dp=8, zero_stage=3, zero_backend="fsdp")
    fsdp2 = _time(dp=8, zero_stage=2, zero_backend="fsdp")
    # DeepSpeed's measured per-module hooks are what makes its ZeRO-3 slow; FSDP2 has none.
    assert fsdp3["zero3_gather_s"] < deepspeed["zero3_gather_s"] / 2
    assert fsdp2["zero3_gather_s"] < fsdp3["zero3_gather_s"]


def test_hsdp_adds_the_replicas_all_reduce_and_shards_over_fewer_ranks():
    full = _time(dp=16, zero_stage=3, zero_backend="fsdp")
    hsdp = _time(dp=16, zero_stage=3, zero_backend="fsdp", dp_replicate=2)
    # The optimizer steps a shard of 1/8 instead of 1/16: twice the time.
    assert hsdp["optimizer_s"] == pytest.approx(2 * full["optimizer_s"])
    assert hsdp["zero3_gather_s"] != full["zero3_gather_s"]


def test_search_prices_fsdp_with_ep(run_main):
    # FSDP2 shards each ep rank's experts over the ranks holding the same ones: the search
    # enumerates it (stage 3 also under pp, where DeepSpeed's ZeRO-3 refuses ep).
    result = run_main("plan", "--search", "--json", "model=tiny-moe", "--gpus", "8",
                      "--explain", "ep=2 zero=3 backend=fsdp pp=2")
    assert result.code == 0, result.stderr
    ex = json.loads(result.stdout)["explain"]
    assert ex["verdict"] == "ranked", ex
    layout = ex["best_variant"]["layout"]
    assert (layout["ep"], layout["zero_stage"], layout["zero_backend"], layout["pp"]) == \
        (2, 3, "fsdp", 2)
    deepspeed = run_main("plan", "--search", "--json", "model=tiny-moe", "--gpus", "8",
                         "--explain", "ep=2 zero=3 backend=deepspeed")
    assert json.loads(deepspeed.stdout)["explain"]["verdict"] == "not enumerated"

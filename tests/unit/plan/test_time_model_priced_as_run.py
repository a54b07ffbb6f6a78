"""The time model prices a layout as partrain runs it (partrain/plan/time_model.py): the
compute dtype's peak, where each group's ranks land on the nodes, which ranks reduce which
gradients (experts under ep), and how the blocks are split over the pipeline."""

import dataclasses
from collections import defaultdict

import pytest

from partrain.models.arith import count_params_per_rank, expert_params, moe_blocks_among, \
    stage_layers
from partrain.parallel.mesh import ParallelDims
from partrain.plan.dp_time import rank_params
from partrain.plan.fit import layout_of, price
from partrain.plan.hardware import PRESETS, load_hardware
from partrain.plan.links import crosses_nodes, group_bandwidth, ring
from partrain.plan.time_model import Layout, pipeline_stages, step_time
from tests.unit.helpers import compose, resolved

H100 = PRESETS["H100-SXM"]


def _time(model="llama-7b", gbs=64, seq=4096, hw=H100, low_precision=True, **layout):
    cfg = compose(f"model={model}", "launcher.device=cuda")
    return step_time(cfg.model, Layout(**layout), gbs, seq, hw, low_precision=low_precision)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fp32_gemms_run_at_the_fp32_peak_not_the_tensor_cores(name):
    # partrain never enables TF32: an fp32 GEMM runs on the CUDA cores, at the datasheet's fp32
    # peak; the GEMM efficiency (and its thin-GEMM factor) is the same fraction of it.
    hw = PRESETS[name]
    kw = {"gbs": 64, "dp": 8, "micro_batch_size": 1, "hw": hw}
    bf16, fp32 = _time(**kw), _time(low_precision=False, **kw)
    ratio = hw.peak_flops / hw.fp32_peak_flops
    assert ratio > 5  # the tensor cores' bf16 peak is many times the CUDA cores' fp32 one
    for part in ("gemm_s", "attention_s"):
        assert fp32["compute_parts"][part] == pytest.approx(ratio * bf16["compute_parts"][part])
    # fp32 elements are twice bf16's bytes through memory
    assert fp32["compute_parts"]["elementwise_s"] > bf16["compute_parts"]["elementwise_s"]
    # MFU stays against the bf16 peak, as a run reports it: it falls with the step
    assert fp32["mfu"] == pytest.approx(bf16["mfu"] * bf16["step_s"] / fp32["step_s"])
    assert fp32["step_s"] > 0.8 * ratio * bf16["compute_s"]


def test_a_hardware_file_gives_its_fp32_peak_or_gets_the_h100s_ratio(tmp_path):
    base = "gpus_per_node: 4\nmemory_gib: 48\npeak_tflops: 362\nintra_node_gbps: 32\n" \
           "inter_node_gbps: 12.5\n"
    given, absent = tmp_path / "given.yaml", tmp_path / "absent.yaml"
    given.write_text(base + "fp32_tflops: 91.6\n")
    absent.write_text(base)
    assert load_hardware(str(given)).fp32_peak_flops == 91.6e12
    h100 = PRESETS["H100-SXM"]
    assert load_hardware(str(absent)).fp32_peak_flops == pytest.approx(
        362e12 * h100.fp32_peak_flops / h100.peak_flops)
    assert dataclasses.replace(h100, fp32_tflops=0).fp32_peak_flops == \
        pytest.approx(h100.fp32_peak_flops)


def _mesh_groups(dims: ParallelDims, dim: str) -> list[list[int]]:
    """The groups of one of mesh.py's dimensions, or of ranks sharing the other coordinates:
    dp_cp (dp and cp flattened), ep (the ep innermost of the dp ranks: build_expert_mesh) and
    edp_cp (the ranks holding the same experts)."""
    if dim in ("pp", "dp", "cp", "tp"):
        return dims.groups(dim)
    keep = {"dp_cp": lambda c: (c["pp"], c["tp"]),
            "ep": lambda c: (c["pp"], c["dp"] // dims.ep, c["cp"], c["tp"]),
            "edp_cp": lambda c: (c["pp"], c["dp"] % dims.ep, c["tp"])}[dim]
    groups = defaultdict(list)
    for rank in range(dims.world_size):
        groups[keep(dims.coords(rank))].append(rank)
    return list(groups.values())


@pytest.mark.parametrize("gpus_per_node", [4, 6, 8, 9, 12])
def test_a_group_crosses_nodes_where_its_ranks_land_not_by_its_span(gpus_per_node):
    # Every group the time model prices, against the groups mesh.py builds (rank order pp, dp,
    # cp, tp): a group crosses a node if any of its ranks sit on different nodes.
    for pp, dp, cp, tp, ep in [(1, 3, 1, 4, 1), (2, 2, 1, 3, 2), (1, 2, 3, 2, 2),
                               (3, 2, 2, 1, 1), (2, 3, 1, 2, 3), (2, 1, 2, 4, 1), (1, 6, 1, 2, 3),
                               (4, 1, 1, 3, 1), (1, 4, 2, 1, 2), (1, 8, 1, 1, 4)]:
        dims = ParallelDims(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
        priced = {"tp": [(tp, 1)], "cp": [(cp, tp)], "dp": [(dp, cp * tp)],
                  "dp_cp": [(dp * cp, tp)], "pp": [(pp, dp * cp * tp)], "ep": [(ep, cp * tp)],
                  "edp_cp": [(dp // ep, ep * cp * tp), (cp, tp)]}
        for dim, group in priced.items():
            by_mesh = any(len({r // gpus_per_node for r in g}) > 1
                          for g in _mesh_groups(dims, dim))
            assert crosses_nodes(dims.world_size, gpus_per_node, *group) == by_mesh, \
                (pp, dp, cp, tp, ep, dim)


def test_a_tp_group_that_straddles_two_nodes_is_priced_on_the_network():
    # dp3 x tp4 on 12 GPUs: nodes of 6 put ranks 4-7 on nodes 0 and 1 (4 < 6 all the same);
    # nodes of 4 or 12 hold every tp group whole.
    kw = {"model": "llama-70b", "gbs": 48, "dp": 3, "tp": 4, "sequence_parallel": True,
          "zero_stage": 1}
    aligned = [_time(hw=dataclasses.replace(H100, gpus_per_node=g), **kw) for g in (4, 12)]
    straddling = _time(hw=dataclasses.replace(H100, gpus_per_node=6), **kw)
    assert aligned[0]["tp_s"] == pytest.approx(aligned[1]["tp_s"])
    # two of the group's ranks on each node: two NICs' shares, not NVLink
    share = min(2 * H100.bandwidth(True), H100.bandwidth(False)) / H100.bandwidth(False)
    assert straddling["tp_s"] == pytest.approx(aligned[0]["tp_s"] / share)
    assert "tp collectives cross nodes" in straddling["limits"]
    assert straddling["step_s"] > aligned[0]["step_s"]


MIXTRAL = {"model": "mixtral-8x7b", "gbs": 512, "dp": 8, "tp": 2, "pp": 4, "micro_batch_size": 1}


def test_expert_gradients_are_reduced_over_the_ranks_that_hold_the_same_experts():
    # ep splits the experts over ep consecutive dp ranks; their gradients meet over the dp/ep
    # ranks holding the same ones (expert.py, data.py), the dense ones over dp. Under pp
    # partrain reduces after the schedule: nothing hides either.
    cfg = compose("model=mixtral-8x7b", "launcher.device=cuda").model
    priced = {ep: _time(ep=ep, **MIXTRAL) for ep in (1, 2, 4, 8)}
    assert priced[8]["dp_s"] < priced[4]["dp_s"] < priced[2]["dp_s"] < priced[1]["dp_s"]
    # ep = dp: each expert has one replica, so only the dense gradients are reduced (the
    # stage with the most of them: the last, with the head)
    layout = Layout(dp=8, tp=2, pp=4, ep=8)
    held = [rank_params(cfg, layout, stage) for stage in pipeline_stages(cfg, layout)]
    dense = max(d for d, _ in held)
    assert min(e for _, e in held) > 5 * dense
    bw = group_bandwidth(H100, 64, (8, 2))
    assert priced[8]["dp_s"] == pytest.approx(ring("all_reduce", dense * 4, 8, bw))


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_a_ranks_parameters_split_dense_ones_by_tp_and_experts_by_ep_only(tp, ep):
    # what count_params_per_rank (the model's own arithmetic) says a rank of each stage holds:
    # tp splits all but the norm gains and a MoE's MLP, which tp ranks hold whole
    cfg = compose("model=mixtral-8x7b", "launcher.device=cuda").model
    layout = Layout(dp=8, tp=tp, pp=4, ep=ep)
    ids = stage_layers(cfg.n_layers, 4)
    for rank, stage in enumerate(pipeline_stages(cfg, layout)):
        dense, experts = rank_params(cfg, layout, stage)
        held = count_params_per_rank(cfg, tp, ids[rank], first=rank == 0, last=rank == 3, ep=ep)
        assert dense + experts == pytest.approx(held, rel=1e-6)
        routed = (moe_blocks_among(cfg, ids[rank]) * cfg.moe.n_experts // ep
                  * expert_params(cfg))
        assert experts == (routed if ep > 1 else 0)


def test_each_tp_rank_runs_a_moe_on_all_its_tokens_without_sequence_parallelism():
    # A MoE's MLP is replicated within tp (tensor.py's "replicated" style): without sequence
    # parallelism every tp rank runs it on the micro-batch's every token, with it on 1/tp.
    def gemm(model, sp):
        kw = {**MIXTRAL, "model": model, "ep": 1, "sequence_parallel": sp}
        return _time(**kw)["compute_parts"]["gemm_s"]

    assert gemm("llama-7b", False) == pytest.approx(gemm("llama-7b", True))
    assert gemm("mixtral-8x7b", False) > 1.5 * gemm("mixtral-8x7b", True)
    # and its tokens' all-to-alls: all of them without, 1/tp with
    routed = {sp: _time(**{**MIXTRAL, "ep": 8, "sequence_parallel": sp})["ep_s"]
              for sp in (False, True)}
    assert routed[True] == pytest.approx(routed[False] / 2, rel=0.01)


def test_the_stage_with_the_most_blocks_sets_the_pipelines_pace():
    # parallel.pp_layers: the slowest stage paces the pipeline, by its blocks and the head on
    # the last. Each split's compute is its slowest stage's, linear in its blocks.
    pp2 = {"gbs": 64, "dp": 4, "tp": 4, "pp": 2, "sequence_parallel": True, "micro_batch_size": 1}
    c = {split: _time(pp_layers=split, **pp2)["compute_s"]
         for split in ((16, 16), (28, 4), (4, 28))}
    per_block = (c[4, 28] - c[16, 16]) / 12  # the last stage's, 28 blocks against 16
    head = c[4, 28] - c[28, 4]  # 28 blocks with the head against 28 without
    assert per_block > 0 and head > 0
    assert c[28, 4] == pytest.approx(28 * per_block)
    assert c[16, 16] == pytest.approx(16 * per_block + head)
    assert _time(**pp2)["compute_s"] == pytest.approx(c[16, 16])  # None: the even split
    assert _time(pp_layers=(28, 4), **pp2)["step_s"] > 1.5 * _time(**pp2)["step_s"]
    # interleaved: chunk s on pp rank s % pp
    cfg = compose("model=llama-7b").model
    chunks = Layout(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                    pp_layers=(12, 4, 12, 4))
    assert [s.blocks for s in pipeline_stages(cfg, chunks)] == [24, 8]


def test_plan_prices_the_configs_own_stage_split():
    hw = dataclasses.replace(H100, gpus_per_node=8)
    even, _, _ = resolved(config="llama-7b-tp4-pp2")
    uneven, _, _ = resolved("parallel.pp_layers=[28,4]", config="llama-7b-tp4-pp2")
    assert layout_of(uneven).pp_layers == (28, 4) and layout_of(even).pp_layers is None
    assert price(uneven, hw)["step_s"] > price(even, hw)["step_s"]

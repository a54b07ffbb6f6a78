"""What validation fills in and allows: parallel.dp=auto, the batch triple (any two fix the
third), every pp schedule and ZeRO stage, the tp-larger-than-a-node warning (also as `show` prints
it), and validating twice. The rules that refuse are test_validate.py's."""

import pytest

from tests.unit.helpers import validated


@pytest.mark.parametrize("nnodes, nproc, tp, pp, dp", [
    (1, 2, 1, 1, 2), (1, 8, 2, 1, 4), (1, 8, 2, 2, 2), (2, 4, 2, 1, 4), (4, 8, 4, 2, 4),
    (1, 4, 4, 1, 1),
])
def test_dp_auto_is_world_over_tp_pp(nnodes, nproc, tp, pp, dp):
    cfg, world, _ = validated("parallel.dp=auto", f"parallel.tp={tp}", f"parallel.pp={pp}",
                             "model.n_kv_heads=4", "model.n_layers=8",
                             "train.global_batch_size=64", "train.micro_batch_size=1",
                             nnodes=nnodes, nproc=nproc)
    assert cfg.parallel.dp == dp
    assert cfg.train.micro_batches == 64 // dp
    assert (cfg.launcher.nnodes, cfg.launcher.nproc_per_node) == (nnodes, nproc)


@pytest.mark.parametrize("g, b, m, expected", [
    (16, 4, None, (16, 4, 2)),
    (16, None, 2, (16, 4, 2)),
    (None, 4, 2, (16, 4, 2)),
    (16, 4, 2, (16, 4, 2)),
    (32, 1, None, (32, 1, 16)),
    (None, 3, 5, (30, 3, 5)),
])
def test_batch_triple_any_two_fix_the_third(g, b, m, expected):
    def v(x):
        return "null" if x is None else str(x)

    cfg, _, _ = validated(f"train.global_batch_size={v(g)}", f"train.micro_batch_size={v(b)}",
                         f"train.micro_batches={v(m)}")  # dp=2
    t = cfg.train
    assert (t.global_batch_size, t.micro_batch_size, t.micro_batches) == expected


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_pp_schedule_is_accepted(schedule):
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    cfg, _, _ = validated("parallel.pp=2", "parallel.dp=1", f"parallel.pp_schedule={schedule}",
                          f"parallel.pp_virtual_stages={virtual}")
    assert cfg.parallel.pp_schedule == schedule


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_validates(stage):
    cfg, _, _ = validated(f"parallel.zero_stage={stage}")
    assert cfg.parallel.zero_stage == stage


TP_OVER_NODE = ["parallel.tp=4", "parallel.dp=1", "model.n_kv_heads=4"]


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_tp_larger_than_gpus_per_node_is_a_warning(device):
    cfg, world, warnings = validated(*TP_OVER_NODE, f"launcher.device={device}", nnodes=2, nproc=2)
    assert world.size == 4
    assert len(warnings) == 1
    assert "parallel.tp=4" in warnings[0]
    assert "2 GPUs per node" in warnings[0]


def test_tp_larger_than_node_on_cpu_is_no_warning():
    _, _, warnings = validated(*TP_OVER_NODE, "launcher.device=cpu", nnodes=2, nproc=2)
    assert warnings == []


def test_tp_within_node_is_no_warning():
    _, _, warnings = validated(*TP_OVER_NODE, "launcher.device=cuda", nnodes=1, nproc=4)
    assert warnings == []


def test_validate_fills_in_place_and_is_idempotent():
    from partrain.config.validate import resolve_and_validate

    cfg, world, _ = validated("parallel.dp=auto", "train.micro_batch_size=null",
                             "train.micro_batches=4", nproc=4)
    assert (cfg.parallel.dp, cfg.train.micro_batch_size) == (4, 1)
    before = dict(cfg.train)
    assert resolve_and_validate(cfg, world) == []
    assert dict(cfg.train) == before


def test_cli_show_prints_the_tp_warning_on_stderr(run_main):
    result = run_main("show", *TP_OVER_NODE, "launcher.device=cuda", "launcher.nnodes=2")
    assert result.code == 0, result.stderr
    assert "warning:" in result.stderr and "parallel.tp=4" in result.stderr
    assert "tp: 4" in result.stdout

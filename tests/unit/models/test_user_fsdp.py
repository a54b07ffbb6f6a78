"""A user's model under FSDP2 with tp (config/validate_layout.check_fsdp_shards, by the model's own
plan): FSDP2 shards the weights tp splits by rows on their second dimension, evenly only, and
cannot shard a tp-split bias at all. Both were refused for the built-in model only: a user's
model failed in every rank after the run dir was written (a reviewer's runs, the repo's own
GPT-2 example among them)."""

import pytest

FSDP = ("parallel.zero_stage=3", "parallel.zero_backend=fsdp")
GPT2 = ("model.target=examples.gpt2.model:build", "model.args.dim=128", "model.args.n_layers=2",
        "model.args.n_heads=4")
UNBIASED = ("model.target=tests.unit.models.user_models:stack_unbiased", "model.args.dim=16")


def _show(run_main, *args):
    res = run_main("show", "launcher.device=cpu", *args)
    assert "Traceback" not in res.stderr
    return res, " ".join(res.stderr.split())


def test_a_tp_split_bias_is_refused_under_fsdp_not_under_deepspeed(run_main):
    layout = ("parallel.dp=2", "parallel.tp=2", "launcher.nproc_per_node=4",
              "train.global_batch_size=16")
    res, said = _show(run_main, *GPT2, *FSDP, *layout)
    assert res.code == 2, said
    assert ("FSDP2 shards model.target=examples.gpt2.model:build's tp-split weights again, and "
            "cannot split the 1-D biases tp splits (layers.0.attn.wq.bias") in said, said
    res, said = _show(run_main, *GPT2, "parallel.zero_stage=3", *layout)
    assert res.code == 0, said


@pytest.mark.parametrize("dp, ok", [(2, True), (3, False)])
def test_weights_split_by_rows_need_fsdps_shards_to_divide_their_columns(run_main, dp, ok):
    res, said = _show(run_main, *UNBIASED, *FSDP, f"parallel.dp={dp}", "parallel.tp=2",
                      f"launcher.nproc_per_node={2 * dp}", f"train.global_batch_size={4 * dp}")
    assert (res.code == 0) is ok, said
    if not ok:
        assert ("over dp = 3 ranks, and it cannot split it unevenly: 3 must divide 16") in said, \
            said

"""DeepSpeed files as users have them, found by a reviewer: sections DeepSpeed has removed and its
old `cpu_offload`, values of the wrong shape, a batch that does not add up, keys that fight
partrain's own control, comments and keys given twice, and a user's model's bucket sizes. Each
is exit 2 with one message (no traceback), or read as DeepSpeed reads it."""

import json

import pytest

from partrain.config.deepspeed import USER_MODEL_BUCKETS, deepspeed_config
from tests.unit.helpers import resolved


def _show(run_main, tmp_path, content, *overrides):
    path = tmp_path / "ds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    res = run_main("show", f"parallel.deepspeed_config={path}", *overrides)
    assert "Traceback" not in res.stderr, res.stderr
    return res, " ".join(res.stderr.split())


ZERO1 = {"zero_optimization": {"stage": 1}}


@pytest.mark.parametrize("content, fragment", [
    # Tracebacks of DeepSpeed's own config error, an assertion, a ValueError, a TypeError and an
    # AttributeError, with exit 1, before.
    ({**ZERO1, "amp": {"enabled": True, "opt_level": "O1"}},
     "DeepSpeed's config refuses it: NVIDIA Apex AMP integration has been removed"),
    ({**ZERO1, "elasticity": {"enabled": True}},
     "DeepSpeed's config refuses it: Elastic training has been removed"),
    ({**ZERO1, "optimizer": {"type": "AdamW", "params": {"betas": ["0.9", "beta2"]}}},
     "optimizer.params.betas=['0.9', 'beta2'] is not two numbers"),
    ({**ZERO1, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, None]}}},
     "optimizer.params.betas=[0.9, None] is not two numbers"),
    ({**ZERO1, "scheduler": "WarmupLR"}, "scheduler='WarmupLR' is not an object"),
    ({**ZERO1, "scheduler": {"type": "WarmupLR", "params": [1, 2]}},
     "scheduler.params=[1, 2] is not an object"),
    # Keys that fight partrain's control: failed in the ranks, or trained in bf16 unsaid.
    ({"zero_optimization": {"stage": 2}, "prescale_gradients": True},
     "prescale_gradients=True: not allowed, partrain averages the gradients"),
    ({"zero_optimization": {"stage": 2}, "gradient_predivide_factor": 4},
     "gradient_predivide_factor=4: not allowed"),
    ({**ZERO1, "tensor_parallel": {"autotp_size": 2}},
     "tensor_parallel={'autotp_size': 2}: not allowed, partrain's tensor parallelism is "
     "parallel.tp"),
    ({**ZERO1, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
     "torch_autocast={'enabled': True, 'dtype': 'bfloat16'}: not allowed, the compute dtype is "
     "train.dtype"),
    # Truncated silently before: 2.5 accumulation steps trained 2, `true` was stage 1.
    ({**ZERO1, "gradient_accumulation_steps": 2.5},
     "gradient_accumulation_steps=2.5 is not a whole number (for train.micro_batches)"),
    ({"zero_optimization": {"stage": True}},
     "zero_optimization.stage=True is not a whole number (for parallel.zero_stage)"),
    # The last of two was taken silently; DeepSpeed refuses a key given twice.
    ('{"zero_optimization": {"stage": 1}, "zero_optimization": {"stage": 3}}',
     "gives the key 'zero_optimization' twice in one object"),
    ('{"zero_optimization": {"stage": }}', "is not valid JSON at line 1"),
    # Tracebacks still after the first fix (today's review): a type that is no name, a number
    # too large for hjson's parser (it was "optim.grad_clip=inf must be a finite number"), and
    # an empty file, taken for an empty config.
    ({**ZERO1, "scheduler": {"type": ["WarmupLR"]}}, "scheduler.type=['WarmupLR'] is not a name"),
    ('{"zero_optimization": {"stage": 2}, "gradient_clipping": 1e400}',
     "cannot be read as JSON: a number too large for any value"),
    (" \n", "is empty; a DeepSpeed config is a JSON object"),
])
def test_a_file_deepspeed_refuses_or_partrain_cannot_take_is_one_message(
        tmp_path, run_main, content, fragment):
    res, said = _show(run_main, tmp_path, content)
    assert res.code == 2 and fragment in said, said


def test_comments_trailing_commas_and_the_old_cpu_offload_read_as_deepspeed_reads_them(
        tmp_path, run_main):
    """DeepSpeed reads a config path as Hjson; its old `cpu_offload: true` is the optimizer's
    offload (partrain always writes offload_optimizer, so DeepSpeed asserted on the pair)."""
    res, said = _show(run_main, tmp_path, '{\n  // ZeRO-2, offloaded\n  "zero_optimization": '
                      '{"stage": 2, "cpu_offload": true,},\n}\n')
    assert res.code == 0, said
    assert "offload_optimizer: cpu" in res.stdout
    res, said = _show(run_main, tmp_path, {"zero_optimization": {
        "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}})
    assert res.code == 2 and "both set parallel.offload_optimizer" in said, said


def test_a_files_batch_that_does_not_add_up_is_said_in_the_files_keys(tmp_path, run_main):
    """It was said in partrain's keys, with advice to set one to null, which the file's value
    then contradicted."""
    res, said = _show(run_main, tmp_path, {**ZERO1, "train_batch_size": 32,
                                           "train_micro_batch_size_per_gpu": 2,
                                           "gradient_accumulation_steps": 4}, "parallel.dp=2")
    assert res.code == 2, said
    assert ("its batch does not add up at dp=2 (train_batch_size=32, "
            "train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4): DeepSpeed's rule "
            "is train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps "
            "x dp; fix the file") in said, said
    assert "set one of the three to null" not in said


def test_a_user_models_buckets_are_deepspeeds_defaults_not_the_built_in_dim():
    """model.dim is the built-in family's key (128 by default): a user's 4096-wide model got
    16,384-element buckets, about a thousand times more collectives than DeepSpeed's."""
    for target, expect in ((None, None), ("tests.unit.models.user_models:plain",
                                          USER_MODEL_BUCKETS)):
        extra = (f"model.target={target}",) if target else ()
        cfg, _, _ = resolved("launcher.device=cpu", "parallel.zero_stage=3", *extra)
        zero = deepspeed_config(cfg)["zero_optimization"]
        if expect is None:
            assert zero["reduce_bucket_size"] == cfg.model.dim ** 2
        else:
            assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == expect["bucket"]
            assert zero["stage3_prefetch_bucket_size"] == expect["prefetch"]
            assert zero["stage3_param_persistence_threshold"] == expect["persistence"]


def test_those_keys_at_the_values_that_change_nothing_pass(tmp_path, run_main):
    """Public configs give them at DeepSpeed's defaults (DeepSpeed-Chat: "prescale_gradients":
    false): refused by name after the fix above, though nothing changes; accepted again."""
    res, said = _show(run_main, tmp_path, {
        "zero_optimization": {"stage": 2}, "prescale_gradients": False,
        "gradient_predivide_factor": 1.0, "torch_autocast": {"enabled": False},
        "tensor_parallel": {"autotp_size": 1}})
    assert res.code == 0, said
    res = run_main("show", "parallel.zero_stage=2", "+parallel.deepspeed.prescale_gradients=true")
    assert res.code == 2 and "parallel.deepspeed.prescale_gradients is not allowed" in \
        res.stderr, res.stderr


def test_null_parameters_are_none_given(tmp_path, run_main):
    """`"params": null` in an optimizer or scheduler section was an AttributeError (exit 1)."""
    for section in ({"optimizer": {"type": "Adam", "params": None}},
                    {"scheduler": {"type": "WarmupLR", "params": None}}):
        res, said = _show(run_main, tmp_path, {**ZERO1, **section})
        assert res.code == 0, said


def test_the_files_batch_message_is_for_the_files_own_three_keys_and_counts_cp(tmp_path, run_main):
    """Under cp DeepSpeed counts a sequence on each cp rank: the rule said "x dp", which 16 =
    4 x 2 x dp 2 met and was refused all the same (a review); a batch the command line breaks,
    two of the file's keys "auto", was blamed on the file ("(None from train.micro_batches)")."""
    batch = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
             "gradient_accumulation_steps": 2}
    res, said = _show(run_main, tmp_path, {**ZERO1, **batch}, "parallel.dp=2", "parallel.cp=2",
                      "launcher.nproc_per_node=4")
    assert res.code == 2 and "does not add up at dp=2 x cp=2" in said and \
        "gradient_accumulation_steps x dp x cp; fix the file" in said, said
    res, said = _show(run_main, tmp_path, {**ZERO1, **batch, "train_batch_size": 32},
                      "parallel.dp=2", "parallel.cp=2", "launcher.nproc_per_node=4")
    assert res.code == 0, said
    res, said = _show(run_main, tmp_path, {**ZERO1, "train_batch_size": "auto",
                                           "train_micro_batch_size_per_gpu": 4,
                                           "gradient_accumulation_steps": "auto"},
                      "parallel.dp=2", "train.global_batch_size=20")
    assert res.code == 2 and "train.global_batch_size=20 is not divisible by" in said, said
    assert "fix the file" not in said

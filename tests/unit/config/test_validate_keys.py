"""Each key's own rules and the data, optim and launcher sections' (partrain/config/
validate_keys.py): a bad value is a ConfigError whose message names the key, the value and the
rule; the good neighbour passes. The rules between keys are test_validate.py's."""

import pytest

from partrain.errors import ConfigError
from tests.unit.helpers import assert_rule, validated

# (id, bad overrides, world for the bad case, fragments of the message, good overrides, its world)
# world = (nnodes, nproc_per_node); None keeps the config's.
RULES = [
    ("activation-checkpointing", ["train.activation_checkpointing=partial"], (None, None),
     ["train.activation_checkpointing=partial is not one of: none, selective, full"],
     ["train.activation_checkpointing=selective"], (None, None)),
    ("pp_schedule", ["parallel.pp_schedule=zigzag"], (None, None),
     ["parallel.pp_schedule=zigzag is not one of: gpipe, 1f1b, interleaved_1f1b"],
     ["parallel.pp_schedule=gpipe"], (None, None)),
    ("dtype", ["train.dtype=fp8"], (None, None),
     ["train.dtype=fp8 is not one of: auto, fp32, bf16, fp16"], ["train.dtype=bf16"], (None, None)),
    # ZeRO (partrain/config/deepspeed.py)
    ("device", ["launcher.device=tpu"], (None, None),
     ["launcher.device=tpu is not one of: auto, cpu, cuda"], ["launcher.device=cuda"], (None, None)),
    ("start-method", ["launcher.start_method=vfork"], (None, None),
     ["launcher.start_method=vfork is not one of: auto, spawn, forkserver"],
     ["launcher.start_method=spawn"], (None, None)),
    ("start-method-fork", ["launcher.start_method=fork"], (None, None),
     ["launcher.start_method=fork is not offered", "launcher.start_method=forkserver"],
     ["launcher.start_method=forkserver"], (None, None)),
    ("data-source", ["data.source=web"], (None, None),
     ["data.source=web is not one of: stdlib, tokens"], ["data.source=tokens"], (None, None)),
    ("kv-divides-heads", ["model.n_kv_heads=3"], (None, None),
     ["model.n_kv_heads=3 must divide model.n_heads=4"], ["model.n_kv_heads=4"], (None, None)),
    ("heads-divide-dim", ["model.dim=102"], (None, None),
     ["model.n_heads=4 must divide model.dim=102"], ["model.dim=96"], (None, None)),
    ("head_dim-even", ["model.dim=132"], (None, None),
     ["model.dim / model.n_heads = 33 must be even"], ["model.dim=136"], (None, None)),
    ("heads-divide-dim-or-head_dim", ["model.dim=102"], (None, None),
     ["(or set model.head_dim)"], ["model.dim=102", "model.head_dim=32"], (None, None)),
    ("head_dim-key-even", ["model.head_dim=33"], (None, None),
     ["model.head_dim=33 must be even (rotary embeddings)"], ["model.head_dim=34"], (None, None)),
    ("head_dim-positive", ["model.head_dim=0"], (None, None),
     ["model.head_dim=0 must be at least 1"], ["model.head_dim=null"], (None, None)),
    ("positive-tp", ["parallel.tp=0"], (None, None),
     ["parallel.tp=0 must be at least 1"], ["parallel.tp=1"], (None, None)),
    ("positive-layers", ["model.n_layers=0"], (None, None),
     ["model.n_layers=0 must be at least 1"], ["model.n_layers=2"], (None, None)),
    ("positive-batch", ["train.micro_batch_size=-4"], (None, None),
     ["train.micro_batch_size=-4 must be at least 1"], ["train.micro_batch_size=8"], (None, None)),
    ("positive-steps", ["train.max_steps=0"], (None, None),
     ["train.max_steps=0 must be at least 1"], ["train.max_steps=1"], (None, None)),
    ("val_fraction", ["data.val_fraction=1.0"], (None, None),
     ["data.val_fraction=1.0 must be between 0 and 1"], ["data.val_fraction=0.5"], (None, None)),
    ("data-sampling", ["data.sampling=shuffled"], (None, None),
     ["data.sampling=shuffled is not one of: random, epochs"], ["data.sampling=epochs"],
     (None, None)),
    ("blend-weight", ["data.blend=[{path: /a, weight: 0.7}, {path: /b, weight: -0.3}]"],
     (None, None), ["data.blend[1].weight=-0.3 must be a positive finite number", "/b"],
     ["data.blend=[{path: /a, weight: 0.7}, {path: /b, weight: 0.3}]"], (None, None)),
    ("blend-twice", ["data.blend=[{path: /a, weight: 0.7}, {path: /b/../a, weight: 0.3}]"],
     (None, None), ["data.blend[0].path=/a and data.blend[1].path=/b/../a are one token dir"],
     ["data.blend=[{path: /a, weight: 0.7}, {path: /b, weight: 0.3}]"], (None, None)),
    ("blend-empty", ["data.blend=[]"], (None, None), ["data.blend=[] names no source"],
     ["data.blend=[{path: /a}]"], (None, None)),
    ("blend-and-path", ["data.path=/a", "data.blend=[{path: /b}]"], (None, None),
     ["data.path=/a and data.blend both name the training data"], ["data.blend=[{path: /b}]"],
     (None, None)),
    ("lr", ["optim.lr=0"], (None, None),
     ["optim.lr=0", "must be positive"], ["optim.lr=1e-4"], (None, None)),
    ("grad_clip", ["optim.grad_clip=-1"], (None, None),
     ["optim.grad_clip=-1", "must be >= 0"], ["optim.grad_clip=0"], (None, None)),
    ("optim-name", ["optim.name=lion"], (None, None),
     ["optim.name=lion is not one of: adamw, adam, sgd"], ["optim.name=sgd"], (None, None)),
    ("optim-schedule", ["optim.schedule=step"], (None, None),
     ["optim.schedule=step is not one of: cosine, linear, constant, wsd"],
     ["optim.schedule=wsd"], (None, None)),
    ("momentum", ["optim.name=sgd", "optim.momentum=1"], (None, None),
     ["optim.momentum=1.0 must be in [0, 1)"], ["optim.name=sgd", "optim.momentum=0"],
     (None, None)),
    ("nesterov-without-momentum", ["optim.name=sgd", "optim.nesterov=true", "optim.momentum=0"],
     (None, None), ["optim.nesterov=true needs optim.name=sgd with optim.momentum > 0"],
     ["optim.name=sgd", "optim.nesterov=true"], (None, None)),
    ("nesterov-adamw", ["optim.nesterov=true"], (None, None),
     ["optim.nesterov=true needs optim.name=sgd", "got optim.name=adamw"],
     ["optim.nesterov=false"], (None, None)),
    ("decay_ratio", ["optim.decay_ratio=0"], (None, None),
     ["optim.decay_ratio=0.0 must be in (0, 1]", "optim.schedule=constant"],
     ["optim.decay_ratio=1"], (None, None)),
    ("wsd-decay-into-warmup", ["optim.schedule=wsd", "optim.warmup_steps=20",
                               "train.max_steps=100", "optim.decay_ratio=0.81"], (None, None),
     ["optim.decay_ratio(0.81) * train.max_steps(100) = 81 steps",
      "optim.warmup_steps=20: warmup + decay must be at most max_steps"],
     ["optim.schedule=wsd", "optim.warmup_steps=20", "train.max_steps=100",
      "optim.decay_ratio=0.8"], (None, None)),
    ("collective_timeout", ["launcher.collective_timeout_s=0"], (None, None),
     ["launcher.collective_timeout_s=0 must be at least 1"],
     ["launcher.collective_timeout_s=1"], (None, None)),
    ("collective_timeout-huge", ["launcher.collective_timeout_s=100000000"], (None, None),
     ["launcher.collective_timeout_s=100000000 must be at most 604800"],
     ["launcher.collective_timeout_s=604800"], (None, None)),
    ("hang_timeout-negative", ["launcher.hang_timeout_s=-1"], (None, None),
     ["launcher.hang_timeout_s=-1 must be >= 0", "0 turns the hang watch off"],
     ["launcher.hang_timeout_s=0"], (None, None)),
    ("hang_timeout-above-half", ["launcher.hang_timeout_s=60"], (None, None),
     ["launcher.hang_timeout_s=60 must be below half of launcher.collective_timeout_s=120",
      "raise launcher.collective_timeout_s"],
     ["launcher.hang_timeout_s=59"], (None, None)),
    ("setup-empty-line", ["launcher.setup=[' ']"], (None, None),
     ["launcher.setup has ' '", "each entry must be a shell line"],
     ["launcher.setup=[module load cuda]"], (None, None)),
]


@pytest.mark.parametrize("bad, bad_world, fragments, good, good_world",
                         [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule_rejects_bad_and_accepts_good_neighbour(bad, bad_world, fragments, good, good_world):
    assert_rule(bad, bad_world, fragments, good, good_world)


# Values that would otherwise fail later, in the workers or in `plan`: each is a ConfigError up
# front, naming the key. The second field says what happened before validation caught it.
GAPS = [
    ("train.log_every=0", "ZeroDivisionError in every worker at step 1 (step % log_every)"),
    ("train.seed=-1", "numpy's default_rng rejects a negative seed in every worker"),
    ("model.multiple_of=0", "ZeroDivisionError in ffn_dim(): `partrain plan` shows a traceback"),
    ("model.ffn_dim=-5", "plan prints a wrong parameter count; nn.Linear fails in the workers"),
    ("train.eval_batches=0", "evaluate() divides by zero: val_loss is nan"),
    ("optim.beta1=1.5", "torch.optim.AdamW raises ValueError in every worker"),
    ("optim.beta2=-0.1", "torch.optim.AdamW raises ValueError in every worker"),
    ("optim.min_lr_ratio=2", "the cosine schedule ends above the peak learning rate"),
    ("optim.warmup_steps=-1", "the warmup divides by a negative step count"),
    ("optim.momentum=-0.5", "torch.optim.SGD raises ValueError in every worker"),
    ("model.rope_theta=0", "rotary frequencies are inf/nan"),
    ("model.rope_type=yarn", "rope_tables would silently build plain frequencies"),
    ("model.rope_factor=0", "llama3 scaling divides the frequencies by zero"),
    ("model.rope_high_freq_factor=1", "llama3 scaling blends over high - low = 0: inf/nan"),
    ("model.rope_original_max_seq_len=0", "llama3 wavelength bounds of zero"),
    ("train.wandb=yes", "wandb.init rejects the mode in rank 0 after the others started"),
    ("train.profile_start=-2", "the profiler would never start: no profile, no word of it"),
    ("train.profile_steps=0", "the profiler would start and never stop: no files written"),
    ("train.profile_start=1000000", "the window starts past max_steps: the profile is never "
     "written"),
]


@pytest.mark.parametrize("override, consequence", GAPS, ids=[g[0] for g in GAPS])
def test_values_that_fail_later_are_rejected_up_front(override, consequence):
    with pytest.raises(ConfigError) as info:
        validated(override)
    assert override.split("=")[0] in str(info.value)

"""Every rule in partrain/config/validate.py: a bad value is a ConfigError whose message names the
key, the value and the rule; the good neighbour passes. A handful go through the real CLI too."""

import pytest

from partrain.errors import ConfigError
from tests.unit.helpers import compose, finish, quick, start_cli, validated

# The quickstart default: dp=2, nproc_per_node=2, global_batch_size=16, micro_batch_size=4,
# model tiny (n_layers=4, n_heads=4, n_kv_heads=2, dim=128, max_seq_len=512).

# (id, bad overrides, world for the bad case, fragments of the message, good overrides, its world)
# world = (nnodes, nproc_per_node); None keeps the config's.
RULES = [
    ("world-size", ["parallel.dp=3"], (None, 2),
     ["pp(1) * dp(3) * tp(1) = 3 != world size 2"], ["parallel.dp=2"], (None, None)),
    ("world-size-tp", ["parallel.dp=2", "parallel.tp=2"], (None, 2),
     ["pp(1) * dp(2) * tp(2) = 4 != world size 2", "nnodes 1 * nproc_per_node 2"],
     ["parallel.dp=2", "parallel.tp=2"], (None, 4)),
    ("world-size-pp", ["parallel.dp=1", "parallel.pp=2"], (None, 4),
     ["pp(2) * dp(1) * tp(1) = 2 != world size 4"], ["parallel.dp=2", "parallel.pp=2"], (None, 4)),
    ("world-size-nodes", ["parallel.dp=2"], (2, 2),
     ["pp(1) * dp(2) * tp(1) = 2 != world size 4", "nnodes 2 * nproc_per_node 2"],
     ["parallel.dp=4"], (2, 2)),
    ("dp-auto-divisible", ["parallel.dp=auto", "parallel.tp=2"], (None, 3),
     ["parallel.dp=auto", "world size 3", "pp(1) * tp(2) = 2"],
     ["parallel.dp=auto", "parallel.tp=2"], (None, 4)),
    ("dp-auto-divisible-pp", ["parallel.dp=auto", "parallel.tp=2", "parallel.pp=2"], (None, 6),
     ["parallel.dp=auto", "world size 6", "pp(2) * tp(2) = 4"],
     ["parallel.dp=auto", "parallel.tp=2", "parallel.pp=2"], (None, 8)),
    ("dp-not-int", ["parallel.dp=abc"], (None, 2),
     ["parallel.dp=abc", "positive integer or 'auto'"], ["parallel.dp=auto"], (None, 2)),
    ("dp-float", ["parallel.dp=2.5"], (None, 2),
     ["parallel.dp=2.5", "positive integer or 'auto'"], ["parallel.dp=2"], (None, 2)),
    ("dp-zero", ["parallel.dp=0"], (None, 2),
     ["parallel.dp=0", "at least 1"], ["parallel.dp=2"], (None, 2)),
    ("n_heads-tp", ["model.n_heads=8", "model.n_kv_heads=8", "parallel.tp=3", "parallel.dp=1"],
     (None, 3), ["parallel.tp=3 must divide model.n_heads=8 (try tp in {1, 2, 4, 8})"],
     ["model.n_heads=8", "model.n_kv_heads=8", "parallel.tp=4", "parallel.dp=1"], (None, 4)),
    ("n_kv_heads-tp", ["parallel.tp=4", "parallel.dp=1"], (None, 4),
     ["parallel.tp=4 must divide model.n_kv_heads=2 (try tp in {1, 2})"],
     ["parallel.tp=2", "parallel.dp=2"], (None, 4)),
    ("n_heads-tp-prime", ["model.n_heads=6", "model.n_kv_heads=6", "model.dim=96",
                          "parallel.tp=4", "parallel.dp=1"], (None, 4),
     ["parallel.tp=4 must divide model.n_heads=6 (try tp in {1, 2, 3, 6})"],
     ["model.n_heads=6", "model.n_kv_heads=6", "model.dim=96", "parallel.tp=2", "parallel.dp=1"],
     (None, 2)),
    ("ffn-tp", ["model.ffn_dim=350", "parallel.tp=4", "model.n_kv_heads=4", "parallel.dp=1"],
     (None, 4), ["parallel.tp=4 must divide the MLP size 350", "model.ffn_dim"],
     ["model.ffn_dim=352", "parallel.tp=4", "model.n_kv_heads=4", "parallel.dp=1"], (None, 4)),
    ("ffn-derived-tp", ["model.multiple_of=1", "model.dim=136", "model.n_heads=4",
                        "model.n_kv_heads=4", "parallel.tp=4", "parallel.dp=1"], (None, 4),
     ["parallel.tp=4 must divide the MLP size 362", "model.multiple_of=1"],
     ["model.multiple_of=4", "model.dim=136", "model.n_heads=4", "model.n_kv_heads=4",
      "parallel.tp=4", "parallel.dp=1"], (None, 4)),
    ("vocab-tp", ["model.vocab_size=257", "parallel.tp=2", "parallel.dp=1"], (None, 2),
     ["parallel.tp=2 must divide model.vocab_size=257", "vocabulary"],
     ["model.vocab_size=258", "parallel.tp=2", "parallel.dp=1"], (None, 2)),
    ("world-size-cp", ["parallel.dp=2", "parallel.cp=2"], (None, 2),
     ["pp(1) * dp(2) * cp(2) * tp(1) = 4 != world size 2"],
     ["parallel.dp=1", "parallel.cp=2"], (None, 2)),
    ("dp-auto-divisible-cp", ["parallel.dp=auto", "parallel.cp=4"], (None, 6),
     ["parallel.dp=auto", "world size 6", "pp(1) * cp(4) * tp(1) = 4"],
     ["parallel.dp=auto", "parallel.cp=4"], (None, 8)),
    ("cp-zero", ["parallel.cp=0", "parallel.dp=2"], (None, 2), ["parallel.cp=0", "at least 1"],
     ["parallel.cp=1", "parallel.dp=2"], (None, 2)),
    # Mixture of experts (model.moe) and expert parallelism (parallel.ep).
    ("ep-dense", ["parallel.ep=2"], (None, None),
     ["parallel.ep=2", "model.moe.n_experts=0 (a dense model)"],
     ["parallel.ep=2", "model.moe.n_experts=4"], (None, None)),
    ("ep-zero", ["parallel.ep=0"], (None, None), ["parallel.ep=0 must be at least 1"],
     ["parallel.ep=1"], (None, None)),
    ("ep-divides-dp", ["model.moe.n_experts=6", "parallel.ep=3"], (None, None),
     ["parallel.ep=3 must divide parallel.dp=2", "try ep in {1, 2}"],
     ["model.moe.n_experts=6", "parallel.ep=2"], (None, None)),
    ("ep-divides-experts", ["model.moe.n_experts=3", "parallel.ep=2"], (None, None),
     ["parallel.ep=2 must divide model.moe.n_experts=3"],
     ["model.moe.n_experts=4", "parallel.ep=2"], (None, None)),
    ("moe-top-k", ["model.moe.n_experts=4", "model.moe.top_k=5"], (None, None),
     ["model.moe.top_k=5 must be between 1 and model.moe.n_experts=4"],
     ["model.moe.n_experts=4", "model.moe.top_k=4"], (None, None)),
    ("moe-first-dense", ["model.moe.n_experts=4", "model.moe.first_dense=4"], (None, None),
     ["model.moe.first_dense=4 leaves no MoE block among model.n_layers=4"],
     ["model.moe.n_experts=4", "model.moe.first_dense=3"], (None, None)),
    ("moe-every", ["model.moe.n_experts=4", "model.moe.every=0"], (None, None),
     ["model.moe.every=0 must be at least 1"], ["model.moe.n_experts=4", "model.moe.every=2"],
     (None, None)),
    ("moe-balance", ["model.moe.n_experts=4", "model.moe.balance=switch"], (None, None),
     ["model.moe.balance=switch is not one of: aux_loss, bias, none"],
     ["model.moe.n_experts=4", "model.moe.balance=bias"], (None, None)),
    ("moe-capacity-negative", ["model.moe.n_experts=4", "model.moe.capacity_factor=-1"],
     (None, None), ["model.moe.capacity_factor=-1.0 must be >= 0 (0 = dropless)"],
     ["model.moe.n_experts=4", "model.moe.capacity_factor=1.25"], (None, None)),
    ("moe-capacity-cp", ["model.moe.n_experts=4", "model.moe.capacity_factor=1", "parallel.cp=2",
                         "parallel.dp=1"], (None, 2),
     ["model.moe.capacity_factor=1.0", "parallel.cp=2 splits each sequence",
      "model.moe.capacity_factor=0"],
     ["model.moe.n_experts=4", "parallel.cp=2", "parallel.dp=1"], (None, 2)),
    ("moe-capacity-sp", ["model.moe.n_experts=4", "model.moe.capacity_factor=1", "parallel.tp=2",
                         "parallel.sequence_parallel=true", "parallel.dp=1"], (None, 2),
     ["sequence parallelism (parallel.tp=2) splits each sequence"],
     ["model.moe.n_experts=4", "model.moe.capacity_factor=1", "parallel.tp=2",
      "parallel.dp=1"], (None, 2)),
    ("ep-zero3", ["model.moe.n_experts=4", "parallel.ep=2", "parallel.zero_stage=3"],
     (None, None), ["parallel.ep=2 with parallel.zero_stage=3 is not supported",
                    "use parallel.zero_stage=1 or 2 with ep"],
     ["model.moe.n_experts=4", "parallel.ep=2", "parallel.zero_stage=2"], (None, None)),
    ("ep-zero-not-contiguous", ["model.moe.n_experts=4", "parallel.ep=2", "parallel.zero_stage=1",
                                "+parallel.deepspeed.zero_optimization.contiguous_gradients=false"],
     (None, None), ["contiguous_gradients=false cannot be used with parallel.ep=2"],
     ["model.moe.n_experts=4", "parallel.ep=1", "parallel.zero_stage=1",
      "+parallel.deepspeed.zero_optimization.contiguous_gradients=false"], (None, None)),
    ("moe-hf-init", ["model.moe.n_experts=4", "model.init_from=hf:/nonexistent"], (None, None),
     ["model.init_from=hf:/nonexistent", "cannot start from one"],
     ["model.moe.n_experts=4"], (None, None)),
    ("activation-checkpointing", ["train.activation_checkpointing=partial"], (None, None),
     ["train.activation_checkpointing=partial is not one of: none, selective, full"],
     ["train.activation_checkpointing=selective"], (None, None)),
    ("cp-method", ["parallel.cp_method=ulysses"], (None, None),
     ["parallel.cp_method=ulysses is not one of: ring, all_to_all"],
     ["parallel.cp_method=all_to_all"], (None, None)),
    ("cp-zigzag-seq", ["parallel.cp=4", "parallel.dp=1", "train.seq_len=100"], (None, 4),
     ["parallel.cp=4 cuts each sequence into 2 * cp = 8 chunks",
      "train.seq_len=100 must be divisible by 8"],
     ["parallel.cp=4", "parallel.dp=1", "train.seq_len=104"], (None, 4)),
    ("cp-all-to-all-heads", ["parallel.cp=4", "parallel.dp=1", "parallel.cp_method=all_to_all"],
     (None, 4), ["parallel.cp_method=all_to_all", "parallel.cp=4 must divide model.n_kv_heads=2",
                 "parallel.cp_method=ring"],
     ["parallel.cp=2", "parallel.dp=2", "parallel.cp_method=all_to_all"], (None, 4)),
    ("cp-all-to-all-heads-tp", ["parallel.cp=2", "parallel.tp=2", "parallel.dp=1",
                                "parallel.cp_method=all_to_all"], (None, 4),
     ["parallel.cp=2 must divide model.n_kv_heads=2 / parallel.tp=2 = 1"],
     ["parallel.cp=2", "parallel.tp=2", "parallel.dp=1"], (None, 4)),
    ("cp-sequence-parallel-seq", ["parallel.sequence_parallel=true", "parallel.tp=4",
                                  "model.n_kv_heads=4", "parallel.cp=2", "parallel.dp=1",
                                  "train.seq_len=260"],
     (None, 8), ["train.seq_len=260 must be divisible by parallel.tp=4 * parallel.cp=2"],
     ["parallel.sequence_parallel=true", "parallel.tp=4", "model.n_kv_heads=4", "parallel.cp=2",
      "parallel.dp=1", "train.seq_len=264"], (None, 8)),
    ("sequence-parallel-seq", ["parallel.sequence_parallel=true", "parallel.tp=2",
                               "parallel.dp=1", "train.seq_len=255"], (None, 2),
     ["parallel.sequence_parallel=true", "train.seq_len=255 must be divisible by parallel.tp=2"],
     ["parallel.sequence_parallel=true", "parallel.tp=2", "parallel.dp=1", "train.seq_len=254"],
     (None, 2)),
    ("n_layers-pp", ["parallel.pp=3", "parallel.dp=1"], (None, 3),
     ["model.n_layers=4 must be divisible by pp(3) * pp_virtual_stages(1) = 3"],
     ["parallel.pp=2", "parallel.dp=1"], (None, 2)),
    ("pp_layers-sum", ["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[1,2]"], (None, 2),
     ["parallel.pp_layers=[1, 2] must be positive block counts summing to model.n_layers=4",
      "sum to 3"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[1,3]"], (None, 2)),
    ("pp_layers-length", ["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[1,1,2]"],
     (None, 2), ["parallel.pp_layers=[1, 1, 2] must list 2 stage sizes", "pp(2)"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[2,2]"], (None, 2)),
    ("pp_layers-zero", ["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[0,4]"], (None, 2),
     ["parallel.pp_layers=[0, 4] must be positive"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[3,1]"], (None, 2)),
    ("pp_layers-uneven-ok", ["parallel.pp=3", "parallel.dp=1"], (None, 3),
     ["model.n_layers=4 must be divisible by pp(3)", "parallel.pp_layers"],
     ["parallel.pp=3", "parallel.dp=1", "parallel.pp_layers=[1,2,1]",
      "train.micro_batch_size=2"], (None, 3)),
    ("interleaved-needs-v", ["parallel.pp=2", "parallel.dp=1",
                             "parallel.pp_schedule=interleaved_1f1b"], (None, 2),
     ["parallel.pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.pp_virtual_stages=2"], (None, 2)),
    ("interleaved-groups", ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b",
                            "parallel.pp_virtual_stages=2", "train.micro_batch_size=16",
                            "train.global_batch_size=48"], (None, 2),
     ["train.micro_batches=3 must be divisible by parallel.pp=2"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.pp_virtual_stages=2", "train.micro_batch_size=16", "train.global_batch_size=64"],
     (None, 2)),
    ("n_layers-virtual", ["parallel.pp=2", "parallel.dp=1", "parallel.pp_virtual_stages=4",
                          "parallel.pp_schedule=interleaved_1f1b"], (None, 2),
     ["model.n_layers=4 must be divisible by pp(2) * pp_virtual_stages(4) = 8"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_virtual_stages=2",
      "parallel.pp_schedule=interleaved_1f1b"], (None, 2)),
    ("virtual-needs-interleaved", ["parallel.pp=2", "parallel.dp=1",
                                   "parallel.pp_virtual_stages=2"], (None, 2),
     ["parallel.pp_virtual_stages=2", "interleaved_1f1b", "1f1b"],
     ["parallel.pp=2", "parallel.dp=1", "parallel.pp_virtual_stages=2",
      "parallel.pp_schedule=interleaved_1f1b"], (None, 2)),
    ("batch-remainder-mbs", ["train.global_batch_size=18"], (None, None),
     ["train.global_batch_size=18 is not divisible by micro_batch_size(4) * dp(2) = 8",
      "train.micro_batches"],
     ["train.global_batch_size=24"], (None, None)),
    ("batch-remainder-mb", ["train.global_batch_size=18", "train.micro_batch_size=null",
                            "train.micro_batches=4"], (None, None),
     ["train.global_batch_size=18 is not divisible by micro_batches(4) * dp(2) = 8",
      "train.micro_batch_size"],
     ["train.global_batch_size=16", "train.micro_batch_size=null", "train.micro_batches=4"],
     (None, None)),
    ("batch-inconsistent", ["train.micro_batches=3"], (None, None),
     ["train.global_batch_size=16 != micro_batch_size(4) * micro_batches(3) * dp(2) = 24"],
     ["train.micro_batches=2"], (None, None)),
    ("batch-too-few", ["train.micro_batch_size=null"], (None, None),
     ["set two of train.global_batch_size, train.micro_batch_size, train.micro_batches",
      "global_batch_size=16", "micro_batch_size=None", "micro_batches=None"],
     ["train.micro_batch_size=null", "train.micro_batches=8"], (None, None)),
    ("batch-none", ["train.global_batch_size=null", "train.micro_batch_size=null"], (None, None),
     ["set two of"], ["train.global_batch_size=null", "train.micro_batches=3"], (None, None)),
    ("micro_batches-pp", ["parallel.pp=2", "parallel.dp=1", "train.global_batch_size=4"],
     (None, 2), ["train.micro_batches=1 must be at least parallel.pp=2"],
     ["parallel.pp=2", "parallel.dp=1", "train.global_batch_size=8"], (None, 2)),
    ("seq_len", ["train.seq_len=513"], (None, None),
     ["train.seq_len=513 exceeds model.max_seq_len=512"], ["train.seq_len=512"], (None, None)),
    ("zero_stage-high", ["parallel.zero_stage=4"], (None, None),
     ["parallel.zero_stage=4 must be 0 (DDP), 1, 2 or 3"], ["parallel.zero_stage=3"], (None, None)),
    ("zero_stage-negative", ["parallel.zero_stage=-1"], (None, None),
     ["parallel.zero_stage=-1 must be 0 (DDP), 1, 2 or 3"], ["parallel.zero_stage=0"], (None, None)),
    ("pp_schedule", ["parallel.pp_schedule=zigzag"], (None, None),
     ["parallel.pp_schedule=zigzag is not one of: gpipe, 1f1b, interleaved_1f1b"],
     ["parallel.pp_schedule=gpipe"], (None, None)),
    ("dtype", ["train.dtype=fp8"], (None, None),
     ["train.dtype=fp8 is not one of: auto, fp32, bf16, fp16"], ["train.dtype=bf16"], (None, None)),
    # ZeRO (partrain/parallel/zero.py)
    ("zero-pp", ["parallel.zero_stage=2", "parallel.pp=2", "parallel.dp=1"], (None, 2),
     ["parallel.zero_stage=2 with parallel.pp=2", "use parallel.zero_stage=1 with pp"],
     ["parallel.zero_stage=1", "parallel.pp=2", "parallel.dp=1"], (None, 2)),
    ("zero3-pp", ["parallel.zero_stage=3", "parallel.pp=2", "parallel.dp=1"], (None, 2),
     ["parallel.zero_stage=3 with parallel.pp=2"], ["parallel.zero_stage=3"], (None, None)),
    ("zero-sp", ["parallel.zero_stage=2", "parallel.tp=2", "parallel.dp=1",
                 "parallel.sequence_parallel=true"], (None, 2),
     ["parallel.zero_stage=2 with parallel.sequence_parallel=true"],
     ["parallel.zero_stage=1", "parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true"],
     (None, 2)),
    ("offload-device", ["parallel.zero_stage=2", "parallel.offload_optimizer=gpu"], (None, None),
     ["parallel.offload_optimizer=gpu is not one of: none, cpu, nvme"],
     ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"], (None, None)),
    ("offload-stage0", ["parallel.offload_optimizer=cpu"], (None, None),
     ["parallel.offload_optimizer=cpu needs parallel.zero_stage >= 1"],
     ["parallel.offload_optimizer=cpu", "parallel.zero_stage=1"], (None, None)),
    ("offload-params", ["parallel.zero_stage=2", "parallel.offload_params=cpu"], (None, None),
     ["parallel.offload_params=cpu needs parallel.zero_stage=3", "got zero_stage=2"],
     ["parallel.zero_stage=3", "parallel.offload_params=cpu"], (None, None)),
    ("offload-nvme", ["parallel.zero_stage=3", "parallel.offload_params=nvme"], (None, None),
     ["offload to nvme needs parallel.offload_nvme_path"],
     ["parallel.zero_stage=3", "parallel.offload_params=nvme", "parallel.offload_nvme_path=/nvme"],
     (None, None)),
    ("fp16-ddp", ["train.dtype=fp16"], (None, None),
     ["train.dtype=fp16 needs loss scaling", "parallel.zero_stage >= 1"],
     ["train.dtype=fp16", "parallel.zero_stage=1"], (None, None)),
    ("deepspeed-contradiction", ["parallel.zero_stage=1", "+parallel.deepspeed.train_batch_size=32"],
     (None, None), ["parallel.deepspeed.train_batch_size=32 contradicts the derived "
                    "train_batch_size=16 (from train.global_batch_size)"],
     ["parallel.zero_stage=1", "+parallel.deepspeed.train_batch_size=16"], (None, None)),
    ("deepspeed-section-clash", ["parallel.zero_stage=1", "+parallel.deepspeed.optimizer=sgd"],
     (None, None), ["parallel.deepspeed.optimizer clashes with the derived optimizer.type"],
     ["parallel.zero_stage=1", "+parallel.deepspeed.optimizer.params.amsgrad=false"], (None, None)),
    ("deepspeed-offload", ["parallel.zero_stage=2",
                           "+parallel.deepspeed.zero_optimization.offload_optimizer.device=cpu"],
     (None, None), ["contradicts the derived zero_optimization.offload_optimizer.device='none'",
                    "parallel.offload_optimizer"],
     ["parallel.zero_stage=2",
      "+parallel.deepspeed.zero_optimization.reduce_bucket_size=1000"], (None, None)),
    ("deepspeed-scheduler", ["parallel.zero_stage=1", "+parallel.deepspeed.scheduler.type=WarmupLR"],
     (None, None), ["parallel.deepspeed.scheduler is not allowed", "optim.lr"],
     ["parallel.zero_stage=1"], (None, None)),
    ("deepspeed-without-zero", ["+parallel.deepspeed.steps_per_print=10"], (None, None),
     ["parallel.deepspeed sets raw DeepSpeed keys, but parallel.zero_stage=0 runs DDP"],
     ["parallel.zero_stage=1", "+parallel.deepspeed.steps_per_print=10"], (None, None)),
    ("device", ["launcher.device=tpu"], (None, None),
     ["launcher.device=tpu is not one of: auto, cpu, cuda"], ["launcher.device=cuda"], (None, None)),
    ("data-source", ["data.source=web"], (None, None),
     ["data.source=web is not one of: stdlib, tokens"], ["data.source=tokens"], (None, None)),
    ("kv-divides-heads", ["model.n_kv_heads=3"], (None, None),
     ["model.n_kv_heads=3 must divide model.n_heads=4"], ["model.n_kv_heads=4"], (None, None)),
    ("heads-divide-dim", ["model.dim=102"], (None, None),
     ["model.n_heads=4 must divide model.dim=102"], ["model.dim=96"], (None, None)),
    ("head_dim-even", ["model.dim=132"], (None, None),
     ["model.dim / model.n_heads = 33 must be even"], ["model.dim=136"], (None, None)),
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
    ("lr", ["optim.lr=0"], (None, None),
     ["optim.lr=0", "must be positive"], ["optim.lr=1e-4"], (None, None)),
    ("grad_clip", ["optim.grad_clip=-1"], (None, None),
     ["optim.grad_clip=-1", "must be >= 0"], ["optim.grad_clip=0"], (None, None)),
    ("collective_timeout", ["launcher.collective_timeout_s=0"], (None, None),
     ["launcher.collective_timeout_s=0 must be at least 1"],
     ["launcher.collective_timeout_s=1"], (None, None)),
    ("collective_timeout-huge", ["launcher.collective_timeout_s=100000000"], (None, None),
     ["launcher.collective_timeout_s=100000000 must be at most 604800"],
     ["launcher.collective_timeout_s=604800"], (None, None)),
]


@pytest.mark.parametrize("overrides", [
    ["parallel.dp=abc"], ["parallel.dp=2.5"], ["optim.lr=1e-4"], ["train.micro_batch_size=null"],
    ["parallel.sequence_parallel=true", "parallel.pp_schedule=interleaved_1f1b"],
])
def test_quick_compose_matches_hydra(overrides):
    # The table below uses quick() for speed; it must read overrides as Hydra does.
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(quick(*overrides)) == OmegaConf.to_container(compose(*overrides))


@pytest.mark.parametrize("bad, bad_world, fragments, good, good_world",
                         [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule_rejects_bad_and_accepts_good_neighbour(bad, bad_world, fragments, good, good_world):
    with pytest.raises(ConfigError) as info:
        validated(*bad, nnodes=bad_world[0], nproc=bad_world[1])
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message  # one line: key, value, rule
    cfg, world, _ = validated(*good, nnodes=good_world[0], nproc=good_world[1])
    p, t = cfg.parallel, cfg.train
    assert p.pp * p.dp * p.cp * p.tp == world.size
    assert t.global_batch_size == t.micro_batch_size * t.micro_batches * p.dp


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


# The same rules through the CLI, in-process (main() with sys.argv): exit 2, the message on
# stderr, no traceback, nothing on stdout.
CLI_CASES = [
    (["plan", "parallel.dp=3", "--world-size", "2"], "pp(1) * dp(3) * tp(1) = 3 != world size 2"),
    (["plan", "parallel.tp=3", "parallel.dp=1", "--world-size", "3"],
     "parallel.tp=3 must divide model.n_heads=4 (try tp in {1, 2, 4})"),
    (["plan", "parallel.pp=3", "parallel.dp=1"], "model.n_layers=4 must be divisible by pp(3)"),
    (["plan", "train.micro_batches=3"], "train.global_batch_size=16 != micro_batch_size(4)"),
    (["plan", "parallel.dp=auto", "parallel.tp=2", "--world-size", "3"],
     "parallel.dp=auto needs the world size 3 to be divisible by pp(1) * tp(2) = 2"),
    (["plan", "--world-size", "0"], "--world-size=0 must be at least 1"),
    (["plan", "parallel.pp=2", "parallel.dp=1", "train.global_batch_size=4"],
     "train.micro_batches=1 must be at least parallel.pp=2"),
    (["show", "train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_seq_len=512"),
    (["show", "parallel.zero_stage=5"], "parallel.zero_stage=5 must be 0 (DDP), 1, 2 or 3"),
    (["show", "parallel.pp_schedule=zb"], "parallel.pp_schedule=zb is not one of"),
    (["show", "model.foo=1"], "unknown config key model.foo"),
    (["show", "parallel.tp=abc"], "parallel.tp=abc"),
    (["show", "nosuch"], "unknown recipe 'nosuch'; known recipes: llama-1b-dp8, llama-7b-tp4-pp2"),
    (["launch", "parallel.zero_stage=2", "parallel.pp=2", "parallel.dp=1", "--dry-run"],
     "parallel.zero_stage=2 with parallel.pp=2"),
    (["show", "parallel.zero_stage=1", "+parallel.deepspeed.gradient_clipping=0.5"],
     "parallel.deepspeed.gradient_clipping=0.5 contradicts the derived gradient_clipping=1.0 "
     "(from optim.grad_clip)"),
    (["launch", "--node-rank", "1", "--dry-run"], "--node-rank=1 must be in 0..0"),
    (["launch", "--nnodes", "2", "parallel.dp=4", "--dry-run"], "--rdzv-endpoint"),
]


@pytest.mark.parametrize("args, fragment", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_cli_in_process_exit_2(run_main, args, fragment):
    result = run_main(*args)
    assert result.code == 2, (result.stdout, result.stderr)
    assert fragment in result.stderr
    assert result.stderr.startswith("error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_show_prints_the_tp_warning_on_stderr(run_main):
    result = run_main("show", *TP_OVER_NODE, "launcher.device=cuda", "launcher.nnodes=2")
    assert result.code == 0, result.stderr
    assert "warning:" in result.stderr and "parallel.tp=4" in result.stderr
    assert "tp: 4" in result.stdout


# A few through a real subprocess, started together to keep the suite fast.
SUBPROCESS_CASES = [
    (["show", "parallel.dp=3", "launcher.nproc_per_node=2"],
     "pp(1) * dp(3) * tp(1) = 3 != world size 2"),
    (["show", "parallel.tp=3", "parallel.dp=1", "launcher.nproc_per_node=3"],
     "parallel.tp=3 must divide model.n_heads=4 (try tp in {1, 2, 4})"),
    (["show", "train.global_batch_size=18"],
     "train.global_batch_size=18 is not divisible by micro_batch_size(4) * dp(2) = 8"),
    (["show", "parallel.zero_stage=7"], "parallel.zero_stage=7 must be 0 (DDP), 1, 2 or 3"),
    (["show", "parallel.tp=abc"], "parallel.tp=abc"),
    (["plan", "nosuch"], "unknown recipe 'nosuch'"),
]


@pytest.fixture(scope="module")
def subprocess_results():
    procs = [start_cli(*args) for args, _ in SUBPROCESS_CASES]
    return [finish(proc) for proc in procs]


@pytest.mark.parametrize("index", range(len(SUBPROCESS_CASES)),
                         ids=[" ".join(a) for a, _ in SUBPROCESS_CASES])
def test_cli_subprocess_exit_2(subprocess_results, index):
    result = subprocess_results[index]
    fragment = SUBPROCESS_CASES[index][1]
    assert result.code == 2, (result.stdout, result.stderr)
    assert fragment in result.stderr
    assert "error:" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


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
    ("model.rope_theta=0", "rotary frequencies are inf/nan"),
    ("model.rope_type=yarn", "rope_tables would silently build plain frequencies"),
    ("model.rope_factor=0", "llama3 scaling divides the frequencies by zero"),
    ("model.rope_high_freq_factor=1", "llama3 scaling blends over high - low = 0: inf/nan"),
    ("model.rope_original_max_seq_len=0", "llama3 wavelength bounds of zero"),
    ("train.wandb=yes", "wandb.init rejects the mode in rank 0 after the others started"),
]


@pytest.mark.parametrize("override, consequence", GAPS, ids=[g[0] for g in GAPS])
def test_values_that_fail_later_are_rejected_up_front(override, consequence):
    with pytest.raises(ConfigError) as info:
        validated(override)
    assert override.split("=")[0] in str(info.value)


def test_cli_plan_multiple_of_zero_is_exit_2(run_main):
    result = run_main("plan", "model.multiple_of=0")
    assert result.code == 2
    assert "model.multiple_of=0" in result.stderr

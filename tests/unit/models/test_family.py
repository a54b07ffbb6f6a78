"""Your own model (model.target): what partrain learns of it before anything starts, what it
refuses without the model's plan or split, and `plan`'s view of it. The CLI runs of the example
(examples/gpt2) are in tests/integration/test_user_model.py."""

import json

import pytest

from partrain.errors import ConfigError
from partrain.models.family import build_family_model, probe
from tests.unit.helpers import compose, resolved, save_checkpoint

GPT2 = "model.target=examples.gpt2.model:build"
PLAIN = "model.target=tests.unit.models.user_models:plain"


def test_the_example_declares_its_plan_and_split_and_counts_its_parameters():
    cfg = compose(GPT2, "model.args.dim=32", "model.args.n_layers=2")
    found = probe(cfg.model)
    built = build_family_model(cfg.model, seed=0)
    assert found.params == sum(p.numel() for p in built.parameters())
    assert (found.tensor_parallel_plan, found.pipeline_split, found.blocks) == (True, True, 2)
    # The seed fixes the weights: the same builder twice gives the same model.
    again = build_family_model(cfg.model, seed=0)
    assert all((a == b).all() for a, b in zip(built.parameters(), again.parameters()))


@pytest.mark.parametrize("overrides, fragments", [
    (("parallel.tp=2", "parallel.dp=1"), ["parallel.tp=2 needs the model's tensor_parallel_plan()"]),
    (("parallel.pp=2", "parallel.dp=1"), ["parallel.pp=2 needs the model's `layers`",
                                          "pipeline_chunk(layer_ids, first, last)"]),
    (("train.activation_checkpointing=selective",), ["selective recomputation knows the "
                                                      "built-in blocks; use full"]),
    (("parallel.cp=2", "parallel.dp=1"), ["parallel.cp is not for a user model"]),
    (("model.moe.n_experts=4",), ["model.moe.n_experts is not for a user model"]),
])
def test_what_a_plain_model_cannot_do_is_named(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        resolved(PLAIN, *overrides, "launcher.device=cpu")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert str(info.value).startswith("model.target=tests.unit.models.user_models:plain")


def test_a_plain_model_runs_every_data_parallel_backend():
    for overrides in ((), ("parallel.zero_stage=2",),
                      ("parallel.zero_stage=3", "parallel.zero_backend=fsdp")):
        cfg, _, _ = resolved(PLAIN, "launcher.device=cpu", *overrides)
        assert cfg.model.target.endswith(":plain")


@pytest.mark.parametrize("target, fragment", [
    ("nodots", "must be 'package.module:function'"),
    ("no_such_module_xyz:build", "importing no_such_module_xyz failed: ModuleNotFoundError"),
    ("tests.unit.models.user_models:missing", "has no callable 'missing'"),
    ("tests.unit.models.user_models:broken", "the builder failed with model.args={}: "
                                             "ValueError: dim must be even"),
    ("tests.unit.models.user_models:not_a_module", "returned a int, not an nn.Module"),
    # built in bf16: it trained bf16 weights under train.dtype=fp32 without a word
    ("tests.unit.models.user_models:half", "its builder makes bfloat16 parameters; build the "
                                           "model in fp32"),
    # the forward's contract, read on the meta model (each failed inside the ranks, or trained a
    # wrong model without a word)
    ("tests.unit.models.user_models:wrong_vocab", "returns logits of shape [1, 8, 259]"),
    ("tests.unit.models.user_models:masked", "its forward(tokens, attention_mask) cannot be "
                                             "called as forward(tokens)"),
    ("tests.unit.models.user_models:hf_like", "returns Output, not the logits tensor (batch, seq, "
                                              "vocabulary) (a transformers model: return its "
                                              "output's .logits)"),
    # sys.exit in the user's code ended partrain with its code (0: "success", 3: "preempted",
    # which a SLURM job requeues on) and no word; argparse at import printed partrain's usage
    ("tests.unit.models.user_models:exits", "the builder failed with model.args={}: it called "
                                            "sys.exit(0)"),
    ("tests.unit.models.exits_at_import:build", "importing tests.unit.models.exits_at_import "
                                                "failed: it called sys.exit(3)"),
    ("tests.unit.models.parses_args_at_import:build", "it called sys.exit(2) (an argparse parser "
                                                      "run at import reads partrain's command "
                                                      "line"),
    # a traceback from the launcher (ValueError: Attempted to use an uninitialized parameter)
    ("tests.unit.models.user_models:lazy", "head.weight, head.bias are lazy parameters (nn.LazyLinear and "
                                           "the like)"),
])
def test_a_target_that_cannot_build_is_one_clear_message(run_main, target, fragment):
    res = run_main("show", f"model.target={target}")
    assert res.code == 2 and fragment in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_user_keys_need_a_target_and_a_family_must_be_known(run_main):
    res = run_main("show", "model.args.dim=8")
    assert res.code == 2 and "model.args={'dim': 8} are a user model's keys" in res.stderr
    res = run_main("show", "model.family=gpt2")
    assert res.code == 2 and "model.family=gpt2 is not a registered family (known: llama)" \
        in res.stderr, res.stderr


def test_a_name_is_a_label_and_the_launcher_says_so():
    _, _, warnings = resolved("model.name=gpt2", "launcher.device=cpu")
    assert any("model.name=gpt2 is a label only: the model trained is model.family=llama"
               in w for w in warnings), warnings


def test_plan_shows_a_user_models_parameters_and_state(run_main):
    res = run_main("plan", "--json", GPT2, "model.args.dim=32", "model.args.n_layers=2",
                   "parallel.tp=2", "parallel.dp=1", "parallel.zero_stage=0")
    assert res.code == 0, res.stderr
    plan = json.loads(res.stdout)
    m = plan["model"]
    assert m["params_per_rank"] == m["params"] // 2
    # DDP in fp32: 16 bytes per parameter of the rank's share.
    assert plan["memory"]["total"] == 16 * m["params_per_rank"]
    assert "not modeled" in plan["not_modeled"]
    res = run_main("plan", "--search", "--gpus", "8", GPT2)
    assert res.code == 2 and "is your own model" in res.stderr, res.stderr


@pytest.mark.parametrize("target", ["tests.unit.models.user_models:plain",
                                    "examples.gpt2.model:build"])
def test_full_recomputation_of_a_user_model_keeps_its_gradients(target):
    """Blocks (the example's `layers`) or, for a model without any, its whole forward run again
    in backward: the same loss and gradients, the parameters' names unchanged."""
    import torch
    import torch.nn.functional as F

    from partrain.parallel.parallelize import apply_activation_checkpointing, checkpointed_blocks

    cfg = compose(f"model.target={target}", "model.args.dim=32", "model.args.n_layers=2")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(model):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_loss, plain = grads(build_family_model(cfg.model, seed=0))
    model = build_family_model(cfg.model, seed=0)
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, "full")
    assert checkpointed_blocks(model) >= 1
    assert [n for n, _ in model.named_parameters()] == names
    loss, recomputed = grads(model)
    assert loss == plain_loss
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0)


# A registered family beyond the built-in one: what it declares is what partrain asks of it, and
# what it does not is refused by name (partrain.models.family's docstring).
TOY_PARAMS, TOY_ACTIVE, TOY_FLOPS = 123_456, 23_456, 7.5e6


def _toy(model_cfg, seed: int):
    import torch

    from tests.unit.models.user_models import Plain

    torch.manual_seed(seed)
    return Plain(model_cfg.vocab_size, 16)


@pytest.fixture
def toy():
    """Register the family "toy" for one test (counts from its config), then remove it."""
    from partrain.models.family import FAMILIES, Family, register_family

    register_family(Family("toy", _toy, "a test's family",
                           count_params=lambda cfg, active=False: TOY_ACTIVE if active
                           else TOY_PARAMS,
                           flops_per_token=lambda cfg, seq_len: TOY_FLOPS))
    try:
        yield "model.family=toy"
    finally:
        del FAMILIES["toy"]


@pytest.fixture
def bare_toy():
    """A family that declares nothing but its builder."""
    from partrain.models.family import FAMILIES, Family, register_family

    register_family(Family("toy", _toy, "a test's family"))
    try:
        yield "model.family=toy"
    finally:
        del FAMILIES["toy"]


def test_the_built_in_family_declares_every_entry():
    from partrain.models import arith, llama_hf
    from partrain.models.family import FAMILIES, shape_modeled

    llama = FAMILIES["llama"]
    assert llama.count_params is arith.count_params
    assert llama.flops_per_token is arith.flops_per_token
    assert llama.moe and llama.hf.model_types == ("llama", "mistral", "qwen2", "qwen3")
    assert llama.hf.name("layers.1.attention.wq.weight") == llama_hf.hf_name(
        "layers.1.attention.wq.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert shape_modeled(compose().model)


def test_the_planner_counts_with_the_familys_functions(run_main, toy):
    res = run_main("plan", "--json", toy, "parallel.tp=2", "parallel.dp=1",
                   "parallel.zero_stage=0")
    assert res.code == 0, res.stderr
    plan = json.loads(res.stdout)
    m = plan["model"]
    assert (m["family"], m["params"], m["flops_per_token"]) == ("toy", TOY_PARAMS, TOY_FLOPS)
    assert m["params_per_rank"] == TOY_PARAMS // 2
    assert plan["memory"]["total"] == 16 * m["params_per_rank"]  # DDP in fp32
    assert "not modeled" in plan["not_modeled"]  # its shape is not the built-in arithmetic's
    res = run_main("plan", toy, "launcher.device=cuda")  # printed; no fit without the shape
    assert res.code == 0 and "model.family=toy (123,456 parameters" in res.stdout, res.stderr
    assert "0.01 GFLOP per token" in res.stdout, res.stdout
    res = run_main("plan", "--search", "--gpus", "8", toy)
    assert res.code == 2 and "model.family=toy counts its parameters without it" in res.stderr


def test_a_family_without_counts_is_counted_on_meta_like_a_users_model(run_main, bare_toy):
    from partrain.models.family import count_params, model_flops_per_token

    cfg = compose(bare_toy)
    built = _toy(cfg.model, 0)
    n = sum(p.numel() for p in built.parameters())
    assert count_params(cfg.model) == n
    assert model_flops_per_token(cfg.model, built, 64, n) == 6.0 * n
    res = run_main("plan", "--json", bare_toy)
    assert res.code == 0, res.stderr
    m = json.loads(res.stdout)["model"]
    assert (m["params"], m["flops_per_token"], m["flops_per_token_declared"]) == (n, None, False)


def test_mfu_counts_with_the_familys_flops(toy):
    from partrain.models.family import model_flops_per_token

    cfg = compose(toy)
    assert model_flops_per_token(cfg.model, _toy(cfg.model, 0), 64, 10) == TOY_FLOPS


HF_REFUSAL = "model.family=toy declares no Hugging Face adapter (Family.hf"


def test_hf_import_without_an_adapter_is_refused_naming_the_family(run_main, toy, tmp_path):
    with pytest.raises(ConfigError) as info:
        compose(toy, f"model.init_from=hf:{tmp_path}")
    assert str(info.value).startswith(f"model.init_from=hf:{tmp_path}: {HF_REFUSAL}"), info.value
    res = run_main("show", toy, f"model.init_from=hf:{tmp_path}")
    assert res.code == 2 and HF_REFUSAL in res.stderr and "Traceback" not in res.stderr


def test_hf_export_without_an_adapter_is_refused_naming_the_family(toy, tmp_path):


    from partrain.checkpoint import store
    from partrain.interop.hf import export_hf

    cfg = compose(toy)
    model = _toy(cfg.model, 0)
    save_checkpoint(model, cfg, tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        export_hf(store.newest(tmp_path / "run" / store.CHECKPOINTS), tmp_path / "out")
    assert HF_REFUSAL in str(info.value) and "--format hf" in str(info.value), info.value
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, key", [
    (("model.moe.n_experts=4",), "model.moe.n_experts=4"),
    (("parallel.ep=2", "parallel.dp=2"), "parallel.ep=2"),
])
def test_experts_without_moe_are_refused_naming_the_family(bare_toy, overrides, key):
    with pytest.raises(ConfigError) as info:
        resolved(bare_toy, *overrides, "launcher.device=cpu", nproc=2)
    assert str(info.value).startswith(f"{key}: model.family=toy declares no mixture of experts"), \
        info.value


def test_sample_and_export_build_the_llama_family_only(toy, tmp_path):
    """Another family's checkpoint is not built as a Llama by sample or export: refused, and
    the end of its run suggests only training on."""
    from omegaconf import OmegaConf

    from partrain.launch.start import next_steps
    from partrain.models.family import builds_offline
    from tests.unit.launch.test_runs import _run_dir

    assert builds_offline(compose().model)
    assert not builds_offline(compose(toy).model)
    assert not builds_offline(OmegaConf.create({"target": "pkg.mod:build", "family": "llama"}))
    run = _run_dir(tmp_path, "toy run", checkpoint=10)
    lines = next_steps(run, compose(toy, "train.max_steps=10"))
    assert [line.split("   #")[0] for line in lines] == [
        f"next: partrain launch --resume '{run}' train.max_steps=20"]


# A parameter shared between modules (one Parameter under two names) stays one only where the
# layout keeps the modules holding it together; elsewhere it would become copies trained apart
# (partrain.models.shared). Checked by `launch --dry-run` and `plan`, before anything starts.
USER_MODELS = "model.target=tests.unit.models.user_models:"
SHARED_WEIGHT = "layers.0.mlp.up.weight = layers.1.mlp.up.weight"
SHARED_BIAS = "layers.0.mlp.up.bias = layers.1.mlp.up.bias"
SHARED_ADVICE = ("give each module its own parameter, name a tied input embedding and head "
                 "tok_embeddings and output")
FSDP = ("parallel.zero_stage=3", "parallel.zero_backend=fsdp")


@pytest.mark.parametrize("builder, overrides, key, named, not_named", [
    ("shared_block", ("parallel.pp=2",),
     "parallel.pp=2 would train a copy of it on each pipeline stage",
     [SHARED_WEIGHT, SHARED_BIAS], []),
    ("shared_block", ("parallel.pp=2", "parallel.pp_virtual_stages=2",
                      "parallel.pp_schedule=interleaved_1f1b", "model.args.n_layers=4"),
     "parallel.pp=2 would train a copy", [SHARED_WEIGHT, SHARED_BIAS], []),
    # tp ties again the weights of modules its plan splits alike; a split bias is its own copy.
    ("shared_block", ("parallel.tp=2",), "parallel.tp=2 would shard it into separate copies",
     [SHARED_BIAS], [SHARED_WEIGHT]),
    ("shared_block", FSDP, "parallel.zero_backend=fsdp would fail as it builds",
     [SHARED_WEIGHT, SHARED_BIAS], []),
    ("shared_block", ("parallel.zero_stage=2", "parallel.zero_backend=fsdp"),
     "parallel.zero_backend=fsdp would fail", [SHARED_WEIGHT], []),
    # The tie pp keeps is named tok_embeddings/output; Hugging Face GPT-2's names are not it.
    ("tied_hf", ("parallel.pp=2",), "parallel.pp=2 would train a copy",
     ["wte.weight = lm_head.weight"], []),
])
def test_a_parameter_shared_between_modules_that_the_layout_splits_is_refused(
        run_main, tmp_path, builder, overrides, key, named, not_named):
    for command in (("launch", "--dry-run", "--run-dir", str(tmp_path / "run")), ("plan",)):
        res = run_main(*command, USER_MODELS + builder, *overrides, "launcher.device=cpu")
        assert res.code == 2, (command, res.stdout, res.stderr)
        message = " ".join(res.stderr.split())
        assert message.startswith(f"error: {USER_MODELS}{builder}: a parameter your model "
                                  "shares between modules"), message
        for fragment in (key, *named, SHARED_ADVICE,
                         "ZeRO with parallel.zero_backend=deepspeed"):
            assert fragment in message, (fragment, message)
        for fragment in not_named:
            assert fragment not in message, (fragment, message)
        assert res.stderr.count("error:") == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("builder, overrides", [
    # DDP and DeepSpeed ZeRO keep one parameter on every rank.
    ("shared_block", ("parallel.dp=2",)),
    ("shared_block", ("parallel.dp=2", "parallel.zero_stage=2")),
    ("shared_block", ("parallel.dp=2", "parallel.zero_stage=3")),
    # Both sharing blocks on one pipeline stage: one Parameter there.
    ("shared_block", ("parallel.pp=2", "model.args.n_layers=3", "parallel.pp_layers=[2,1]")),
    # The tie partrain keeps: pp sums its two copies' gradients, tp's plan splits both over the
    # vocabulary, FSDP holds both in the root's unit.
    ("tied", ("parallel.pp=2",)),
    ("tied", ("parallel.tp=2",)),
    ("tied", FSDP),
    # (tied's MLP has a colwise bias, which FSDP2 cannot shard again under tp: refused)
    ("tied_unbiased", ("parallel.pp=2", "parallel.tp=2", "parallel.dp=2", *FSDP)),
    ("tied_hf", ("parallel.tp=2",)),
    ("tied_hf", FSDP),
])
def test_a_parameter_shared_between_modules_that_the_layout_keeps_is_accepted(
        run_main, tmp_path, builder, overrides):
    res = run_main("launch", "--dry-run", "--run-dir", str(tmp_path / "run"),
                   USER_MODELS + builder, *overrides, "launcher.device=cpu")
    assert res.code == 0, res.stderr
    assert "nothing started" in res.stdout, res.stdout


@pytest.mark.parametrize("target, overrides, fragments", [
    ("misplanned", ["parallel.tp=2", "parallel.dp=1"],
     ["layers.1.mlp.up: unknown style 'columnwise'", "layers.0.ghost: the model has no such module",
      "layers.0.mlp.down (rowwise): a bias, which only colwise layers keep"]),
    # the byte vocabulary's 256 rows split at tp2; 257 do not
    ("stack", ["parallel.tp=2", "parallel.dp=1", "model.vocab_size=257"],
     ["tok_embeddings (vocab_embedding): its 257 vocabulary rows do not split into "
      "parallel.tp=2", "output (vocab_head): its 257 vocabulary rows"]),
    # Split linears without partners failed at the first step: "mat1 and mat2 shapes cannot be
    # multiplied (1024x64 and 32x16)".
    ("unpartnered", ["parallel.tp=2", "parallel.dp=1"],
     ["layers.0.mlp.down (rowwise): it reads each rank's 1/2 of its inputs, and no colwise layer "
      "in layers.0.mlp makes them", "layers.1.mlp.up (colwise): each rank makes 1/2 of its "
      "outputs, and no rowwise layer in layers.1.mlp reads them: plan the layer that reads "
      "layers.1.mlp.up's outputs rowwise, or layers.1.mlp.up replicated"]),
    ("unplanned", ["parallel.tp=2", "parallel.dp=1"],
     ["tensor_parallel_plan() returned NoneType, not a mapping"]),
    # A whole head on every rank: it trained, exit 0, with a loss log(tp) too high.
    ("head_whole", ["parallel.tp=2", "parallel.dp=1"],
     ['no module is planned "vocab_head": under tp the loss reads each rank\'s logits as its '
      "1/2 of the vocabulary (model.vocab_size=256)"]),
])
def test_a_tp_plan_the_ranks_cannot_follow_is_refused_before_the_start(run_main, target, overrides,
                                                                       fragments):
    """Mistakes in a user's plan failed inside every rank (exit 1, a traceback in the rank log,
    and 'the same command starts the run again'): now exit 2, each named, from the model built on
    the meta device."""
    res = run_main("launch", "--dry-run", f"model.target=tests.unit.models.user_models:{target}",
                   *overrides)
    said = " ".join(res.stderr.split())
    assert res.code == 2, res.stderr
    for fragment in fragments:
        assert fragment in said, said
    assert "Traceback" not in said


def test_the_examples_plan_passes_the_check(run_main):
    res = run_main("launch", "--dry-run", GPT2, "parallel.tp=2", "parallel.dp=1")
    assert res.code == 0, res.stderr
    # A head split colwise is split over the vocabulary too.
    res = run_main("launch", "--dry-run", USER_MODELS + "head_colwise", "parallel.tp=2",
                   "parallel.dp=1")
    assert res.code == 0, res.stderr
    # An MLP layer as wide as the vocabulary (4 x 64 = 256 bytes) is the MLP's, partnered by
    # its rowwise layer (it was taken for a head, and the rowwise one refused as unpartnered).
    res = run_main("launch", "--dry-run", USER_MODELS + "stack", "model.args.dim=64",
                   "parallel.tp=2", "parallel.dp=1")
    assert res.code == 0, res.stderr


def test_the_process_generator_starts_from_the_seed_for_every_family():
    """The built-in family draws its weights from a generator of its own: the process's was left
    as it was (two runs saved other rng states; dropout would have drawn other masks)."""
    import torch

    cfg = compose("launcher.device=cpu")
    states = []
    for noise in (1, 2):
        torch.manual_seed(noise)
        build_family_model(cfg.model, 7)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])


def test_a_plan_with_attention_before_its_head_passes_the_check():
    """The check once kept an attention entry's head count in the list of vocabulary heads: a
    plan naming "attention" before its head failed with partrain's own AttributeError, reported
    as the user's plan failing (CI, the GPT-2 example at dp2 x tp2 x pp2)."""
    from torch import nn

    from partrain.models.tp_plan import plan_problems

    class Attn(nn.Module):
        n_heads = n_kv_heads = 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.output = Attn(), nn.Linear(8, 16, bias=False)

        def tensor_parallel_plan(self):
            return {"attn": "attention", "output": "vocab_head"}

    assert plan_problems(Model(), 2, 16) == []
    model = Model()
    model.tensor_parallel_plan = lambda: {"attn": "attention", "output": "colwise"}
    assert plan_problems(model, 2, 16) == []


@pytest.mark.parametrize("overrides", [(), ("model=tiny-moe",), ("model.qk_norm=true",
                                                                    "model.qkv_bias=true")],
                         ids=["dense", "moe", "qk-norm"])
def test_the_built_in_plan_passes_the_check_a_users_plan_gets(overrides):
    """The built-in family's plan is the reference the styles are written for: the check a
    user's plan gets (split sizes, partners, the vocabulary head) finds nothing in it."""
    import torch

    from partrain.models.tp_plan import plan_problems

    cfg = compose("launcher.device=cpu", *overrides)
    with torch.device("meta"):
        model = build_family_model(cfg.model, 0)
    assert plan_problems(model, 2, cfg.model.vocab_size) == []

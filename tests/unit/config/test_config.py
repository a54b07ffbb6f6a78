"""compose_config: recipes and YAML files plus Hydra overrides into one typed config, and the
ConfigErrors for everything a user can get wrong at compose time."""

import json

import pytest
import yaml
from omegaconf import OmegaConf

from partrain.config.compose import compose_config, find_recipe, known_recipes
from partrain.config.paths import recipes_dir
from partrain.config.resolve import resolve_world
from partrain.config.validate import resolve_and_validate
from partrain.errors import ConfigError
from tests.unit.helpers import compose, resolved

RECIPES = ["llama-1b-dp8", "llama-7b-tp4-pp2", "mixtral-8x7b-ep8", "moe-tiny", "quickstart"]


def test_known_recipes_are_the_files_in_recipes_dir():
    assert known_recipes() == RECIPES
    assert find_recipe("llama-1b-dp8") == recipes_dir() / "llama-1b-dp8.yaml"


def test_no_config_means_quickstart():
    default = OmegaConf.to_container(compose_config(None, []))
    quickstart = OmegaConf.to_container(compose_config("quickstart", []))
    assert default == quickstart
    assert default["name"] == "quickstart"
    # The quickstart recipe's diff over configs/: dp=2 on two CPU processes, 16 x 256 tokens.
    assert default["parallel"]["dp"] == 2
    assert default["launcher"] == {**default["launcher"], "nproc_per_node": None, "device": "cpu"}
    assert (default["train"]["global_batch_size"], default["train"]["micro_batch_size"],
            default["train"]["micro_batches"], default["train"]["seq_len"]) == (16, 4, None, 256)
    assert default["model"]["name"] == "tiny"
    assert default["data"]["source"] == "stdlib"


def test_quickstart_resolves_to_two_cpu_ranks_and_is_launchable():
    cfg, world, warnings = resolved()
    assert (world.nnodes, world.nproc_per_node, world.size) == (1, 2, 2)
    assert warnings == []
    assert cfg.parallel.dp == 2
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size,
            cfg.train.micro_batches) == (16, 4, 2)
    assert (cfg.launcher.nnodes, cfg.launcher.nproc_per_node) == (1, 2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = compose_config(recipe, [])
    assert cfg.name == recipe
    world = resolve_world(cfg, None, None, cuda_devices=0)
    resolve_and_validate(cfg, world)
    p, t = cfg.parallel, cfg.train
    assert p.pp * p.dp * p.tp == world.size
    assert t.global_batch_size == t.micro_batch_size * t.micro_batches * p.dp


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_opens_with_its_command(recipe):
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    first = text.splitlines()[0]
    assert first.startswith("# partrain "), first
    assert recipe in first or recipe == "quickstart"


def test_plan_math_llama_7b_tp4_pp2(run_main):
    result = run_main("plan", "llama-7b-tp4-pp2", "--json")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["world_size"], plan["nnodes"], plan["nproc_per_node"]) == (32, 4, 8)
    assert plan["degrees"] == {"pp": 2, "dp": 4, "cp": 1, "tp": 4, "ep": 1, "zero_stage": 0}  # dp: auto
    batch = plan["batch"]
    assert (batch["global_batch_size"], batch["micro_batch_size"], batch["micro_batches"],
            batch["dp"]) == (1024, 1, 256, 4)
    assert batch["tokens_per_step"] == 1024 * 4096
    assert batch["rule"] == "1024 = micro_batch_size(1) * micro_batches(256) * dp(4)"
    # Llama-2-7B's published parameter count.
    assert plan["model"]["params"] == 6_738_415_616
    assert len(plan["ranks"]) == 32
    assert plan["warnings"] == []


def test_plan_math_llama_1b_dp8(run_main):
    result = run_main("plan", "llama-1b-dp8", "--json")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["world_size"], plan["nnodes"], plan["nproc_per_node"]) == (8, 1, 8)
    assert plan["degrees"] == {"pp": 1, "dp": 8, "cp": 1, "tp": 1, "ep": 1, "zero_stage": 0}
    batch = plan["batch"]
    assert (batch["global_batch_size"], batch["micro_batch_size"], batch["micro_batches"]) == (256, 2, 16)
    assert batch["tokens_per_step"] == 256 * 4096 == 2**20  # "1M tokens per step"
    assert plan["groups"]["dp"] == [list(range(8))]
    # Llama-3.2-1B has 1,235,814,400 parameters with tied embeddings; untied adds 128256 * 2048.
    assert plan["model"]["params"] == 1_235_814_400 + 128256 * 2048


def test_plan_world_size_keeps_gpus_per_node(run_main):
    result = run_main("plan", "llama-7b-tp4-pp2", "--json", "--world-size", "16")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["nnodes"], plan["nproc_per_node"]) == (2, 8)
    assert plan["degrees"]["dp"] == 2
    assert plan["batch"]["micro_batches"] == 1024 // 2


@pytest.mark.parametrize("args, world", [
    (("parallel.pp=2", "parallel.tp=2", "parallel.dp=2"), (8, 2, 2, 2)),
    (("parallel.dp=1",), (1, 1, 1, 1)),
    (("parallel.tp=2",), (4, 1, 2, 2)),
])
def test_plan_follows_the_degrees_without_world_size(run_main, args, world):
    """The quickstart pins no process count: plan (and launch on CPU) take the degrees' product."""
    result = run_main("plan", *args, "--json")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    d = plan["degrees"]
    assert (plan["world_size"], d["pp"], d["dp"], d["tp"]) == world
    assert plan["nproc_per_node"] == world[0] and plan["ranks_complete"]


def test_plan_of_a_large_world_is_compact_and_fast(run_main):
    """A million ranks: the ends of the rank list and each dimension's group pattern."""
    result = run_main("plan", "--json", "--world-size", str(1 << 20), "parallel.dp=auto",
                      "parallel.tp=2", "parallel.pp=2", "train.global_batch_size=null",
                      "train.micro_batches=2")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert not plan["ranks_complete"] and plan["groups"] is None
    assert [r["rank"] for r in plan["ranks"]] == [*range(8), *range((1 << 20) - 8, 1 << 20)]
    tp, pp = plan["group_pattern"]["tp"], plan["group_pattern"]["pp"]
    assert (tp["groups"], tp["size"], tp["stride"], tp["first"]) == (1 << 19, 2, 1, [0, 1])
    assert (pp["size"], pp["stride"], pp["last"]) == (2, 1 << 19, [(1 << 19) - 1, (1 << 20) - 1])
    human = run_main("plan", "--world-size", str(1 << 20), "parallel.dp=auto", "parallel.tp=2",
                     "parallel.pp=2", "train.global_batch_size=null", "train.micro_batches=2")
    assert human.code == 0 and "the first and last 8 of 1,048,576" in human.stdout
    assert "524,288 groups of 2 ranks, stride 1" in " ".join(human.stdout.split())


def test_plan_human_output_spells_the_product(run_main):
    result = run_main("plan")
    assert result.code == 0, result.stderr
    assert "pp(1) * dp(2) * tp(1) = 2" in result.stdout
    assert "16 = micro_batch_size(4) * micro_batches(2) * dp(2)" in result.stdout


def test_show_prints_the_resolved_yaml(run_main):
    result = run_main("show", "parallel.dp=auto", "train.micro_batch_size=2",
                      "launcher.nproc_per_node=2")
    assert result.code == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["parallel"]["dp"] == 2  # auto resolved for the quickstart's 2 ranks
    assert shown["train"]["micro_batches"] == 4  # 16 / (2 * 2)
    assert shown["launcher"]["nproc_per_node"] == 2


@pytest.mark.parametrize("overrides, check", [
    (["parallel.tp=2"], lambda c: c.parallel.tp == 2),
    (["train.seed=7", "optim.lr=0.01"], lambda c: (c.train.seed, c.optim.lr) == (7, 0.01)),
    (["model=llama-7b"], lambda c: (c.model.name, c.model.n_layers, c.model.dim) == ("llama-7b", 32, 4096)),
    (["model=llama-7b", "model.n_layers=2"], lambda c: (c.model.dim, c.model.n_layers) == (4096, 2)),
    (["data=tokens", "data.path=/some/dir"], lambda c: (c.data.source, c.data.path) == ("tokens", "/some/dir")),
    (["parallel.dp=auto"], lambda c: c.parallel.dp == "auto"),
    (["train.micro_batch_size=null"], lambda c: c.train.micro_batch_size is None),
    (["parallel.zero_stage=1", "+parallel.deepspeed.foo=1"],
     lambda c: c.parallel.deepspeed.foo == 1),
    (["name=mine"], lambda c: c.name == "mine"),
])
def test_overrides_apply(overrides, check):
    assert check(compose(*overrides))


def test_override_beats_recipe_value():
    assert compose_config("llama-7b-tp4-pp2", []).parallel.tp == 4
    assert compose_config("llama-7b-tp4-pp2", ["parallel.tp=8"]).parallel.tp == 8


def test_later_override_of_the_same_key_wins():
    assert compose("train.seed=1", "train.seed=2").train.seed == 2


@pytest.mark.parametrize("overrides, fragments", [
    (["model.foo=1"], ["unknown config key model.foo", "model.foo=1"]),
    (["parallel.tp=abc"], ["parallel.tp=abc", "abc", "Integer"]),
    (["train.seq_len=1.5"], ["train.seq_len", "1.5"]),
    (["model=nosuch"], ["model=nosuch", "not an option", "llama-7b"]),
    (["~train.seed"], ["train.seed"]),
    (["parallel.zero_stage=true"], ["parallel.zero_stage", "True"]),
    (["notakey=1"], ["notakey"]),
])
def test_bad_override_is_a_config_error(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        compose(*overrides)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        compose_config("nosuch", [])
    message = str(info.value)
    assert "nosuch" in message
    for recipe in RECIPES:
        assert recipe in message


def test_missing_yaml_path(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        compose_config(str(missing), [])
    assert str(missing) in str(info.value)
    assert "does not exist" in str(info.value)


def test_yaml_without_defaults_list(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nparallel:\n  dp: 2\n")
    with pytest.raises(ConfigError) as info:
        compose_config(str(path), [])
    assert "no defaults list" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["defaults: [config\n", "- just\n- a list\n", ""])
def test_yaml_that_is_broken_or_not_a_mapping(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        compose_config(str(path), [])


def test_yaml_with_unknown_key_fails_at_compose(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("defaults:\n  - config\n  - _self_\ntrain:\n  max_stepz: 10\n")
    with pytest.raises(ConfigError) as info:
        compose_config(str(path), [])
    assert "max_stepz" in str(info.value)


def test_user_yaml_with_defaults_composes(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("defaults:\n  - config\n  - override model: llama-1b\n  - _self_\n\n"
                    "name: mine\nparallel:\n  tp: 2\ntrain:\n  max_steps: 7\n")
    cfg = compose_config(str(path), ["train.seed=3"])
    assert cfg.name == "mine"
    assert cfg.parallel.tp == 2
    assert cfg.train.max_steps == 7
    assert cfg.train.seed == 3
    assert cfg.model.name == "llama-1b"
    # Everything else comes from configs/: the file is a diff over the defaults.
    assert cfg.optim.name == "adamw"
    assert cfg.train.global_batch_size == 16


def test_user_yml_suffix_composes(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text("defaults:\n  - config\n  - _self_\nname: mine\n")
    assert compose_config(str(path), []).name == "mine"


def test_user_yaml_with_dp_auto_needs_a_world(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("defaults:\n  - config\n  - _self_\nparallel:\n  dp: auto\n")
    cfg = compose_config(str(path), [])
    with pytest.raises(ConfigError) as info:
        resolve_world(cfg, None, None, cuda_devices=0)
    assert "parallel.dp=auto needs a world size" in str(info.value)
    world = resolve_world(cfg, None, 4, cuda_devices=0)
    resolve_and_validate(cfg, world)
    assert cfg.parallel.dp == 4


def test_user_yaml_named_config_yaml(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("defaults:\n  - config\n  - _self_\nname: mine\n")
    try:
        cfg = compose_config(str(path), [])
    except ConfigError as e:
        assert "config.yaml" in str(e)  # a clear error naming the file is one acceptable fix
    else:
        assert cfg.name == "mine"


def test_compose_is_repeatable():
    # Hydra's global state is set up and torn down per call: composing twice gives the same config.
    first = OmegaConf.to_container(compose("parallel.tp=2"))
    second = OmegaConf.to_container(compose("parallel.tp=2"))
    assert first == second


def test_resolve_world_uses_cuda_devices_unless_cpu():
    cfg = compose("parallel.dp=auto", "launcher.nproc_per_node=null", "launcher.device=auto")
    assert resolve_world(cfg, None, None, cuda_devices=4).nproc_per_node == 4
    cfg = compose("parallel.dp=auto", "launcher.nproc_per_node=null", "launcher.device=cpu")
    with pytest.raises(ConfigError, match="dp=auto needs a world size"):
        resolve_world(cfg, None, None, cuda_devices=4)


def test_resolve_world_flags_win_over_config():
    cfg = compose("launcher.nnodes=3", "launcher.nproc_per_node=5")
    world = resolve_world(cfg, 2, 4, cuda_devices=8)
    assert (world.nnodes, world.nproc_per_node, world.size) == (2, 4, 8)
    world = resolve_world(cfg, None, None, cuda_devices=8)
    assert (world.nnodes, world.nproc_per_node) == (3, 5)


def test_resolve_world_derives_nproc_from_integer_degrees():
    cfg = compose("parallel.dp=2", "parallel.tp=2", "launcher.nproc_per_node=null",
                  "model.n_kv_heads=2")
    world = resolve_world(cfg, None, None, cuda_devices=0)
    assert world.nproc_per_node == 4
    world = resolve_world(cfg, 2, None, cuda_devices=0)
    assert (world.nnodes, world.nproc_per_node) == (2, 2)


@pytest.mark.parametrize("nnodes, nproc, fragment", [
    (0, 2, "--nnodes=0 must be at least 1"),
    (1, 0, "--nproc-per-node=0 must be at least 1"),
    (1, -1, "--nproc-per-node=-1 must be at least 1"),
])
def test_resolve_world_rejects_empty_worlds(nnodes, nproc, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_world(compose(), nnodes, nproc, cuda_devices=0)
    assert fragment in str(info.value)

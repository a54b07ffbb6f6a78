"""Hostile and careless input: tables that prove the exit-2 contract edge by edge (this file:
config keys, values and files; test_hostile_io.py: run dirs, flags and the environment;
test_hostile_data.py: token dirs and `data prepare`).

Every row is an input a user can type by mistake or a file they can hand partrain: non-finite or
out-of-range numbers, unknown keys and group options, config files partrain cannot read, run dirs
it must not use, token dirs whose meta.json lies, bad flags and network settings, absurd sizes,
rich markup in user text, values of the wrong type. For each one the CLI must (docs/design.md,
exit code 2):

- exit with code 2, with exactly one `error: ...` message on stderr and nothing on stdout;
- name the key or flag, the value as given and the rule: each row lists fragments that must
  appear (a tuple inside the list means any one of them); whitespace is collapsed, as rich wraps;
- show no traceback and no library internals (OmegaConf's `full_key:` / `object_type=` lines, the
  private copy a user's recipe is composed from);
- start nothing and write nothing: the test's directory is the same afterwards, entry by entry
  (it is the cwd, so a default `runs/...` would land in it, and it holds the system temp dir, so a
  temporary dir left behind shows too), and no process mentions it.

Rows run in-process through `run_main`; test_hostile_subprocess.py also runs a few as real
`python -m partrain` subprocesses, and test_hostile_disks.py on read-only and full disks. The shared inputs and checks are in tests/unit/cli/hostile.py.
"""

import pytest

from tests.unit.cli.hostile import (
    FLOAT_KEYS,
    RECIPE_HEAD,
    Ctx,
    check_row,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    row,
)

# ------------------------------------------------------------------------------------------------
# The table. Fragments: the key or flag, the value as the user gave it, a word of the rule.


def _rows_non_finite():
    """Family 1: every float key of the schema with nan, inf and -inf (Hydra parses them as
    floats; `show` validates)."""
    assert len(FLOAT_KEYS) >= 10, FLOAT_KEYS
    return [row(f"float-{key}={value}", ["show", f"{key}={value}"], f"{key}={value}", "finite")
            for key in FLOAT_KEYS for value in ("nan", "inf", "-inf")]


ROWS_FLOAT_RANGE = [
    row("optim.lr=0", ["show", "optim.lr=0"], "optim.lr=0", "positive"),
    row("optim.lr=1e-400 (underflows to 0)", ["show", "optim.lr=1e-400"], "optim.lr=", "positive"),
    row("optim.grad_clip=-1", ["show", "optim.grad_clip=-1"], "optim.grad_clip=-1", ">= 0"),
    row("optim.weight_decay=-0.1", ["show", "optim.weight_decay=-0.1"],
        "optim.weight_decay=-0.1", ">= 0"),
    row("optim.beta1=1", ["show", "optim.beta1=1"], "optim.beta1=1", "[0, 1)"),
    row("optim.eps=0", ["show", "optim.eps=0"], "optim.eps=0", "positive"),
    row("optim.min_lr_ratio=2", ["show", "optim.min_lr_ratio=2"], "optim.min_lr_ratio=2", "[0, 1]"),
    row("model.rope_theta=-1", ["show", "model.rope_theta=-1"], "model.rope_theta=-1", "positive"),
    row("data.val_fraction=0", ["show", "data.val_fraction=0"], "data.val_fraction=0", "between"),
]

ROWS_UNKNOWN_KEYS = [
    row("+train.max_step", ["show", "+train.max_step=50"], "train.max_step", "+train.max_step=50",
        "did you mean train.max_steps?"),
    row("train.max_step", ["show", "train.max_step=50"], "train.max_step=50",
        "did you mean train.max_steps?"),
    row("max_steps without section", ["show", "max_steps=3"], "max_steps=3",
        "did you mean train.max_steps?"),
    row("trian.seed", ["show", "trian.seed=1"], "trian.seed=1", "did you mean train.seed?"),
    row("+foo", ["show", "+foo=1"], "+foo=1", "unknown config key"),
    row("++foo", ["show", "++foo=1"], "++foo=1", "unknown config key"),
    row("+model.bar", ["show", "+model.bar=2"], "model.bar", "+model.bar=2", "unknown config key"),
    row("+train.seed (exists)", ["show", "+train.seed=3"], "train.seed", "train.seed=3", "already"),
    row("model=tinyy", ["show", "model=tinyy"], "model=tinyy", "not an option",
        "did you mean tiny?"),
    row("parallel=nosuch", ["show", "parallel=nosuch"], "parallel=nosuch", "not an option"),
    row("model= (empty)", ["show", "model="], "model=", "not an option"),
    row("model=null", ["show", "model=null"], ("model=null", "model=None"), "not an option"),
    row("model={a:1}", ["show", "model={a:1}"], "model=", "not an option"),
    row("hydra.run.dir", ["show", "hydra.run.dir=x"], "hydra.run.dir", "unknown config key"),
    row("sweep model=tiny,llama-1b", ["show", "model=tiny,llama-1b"], "model=tiny,llama-1b",
        "sweep"),
    row("grammar data.path=/x/[run1]", ["show", "data.path=/x/[run1]"], "data.path=/x/[run1]",
        "not understood"),
    row("grammar +=", ["show", "train.max_steps+=1"], "train.max_steps+=1", "not understood"),
    row("empty key =5", ["show", "=5"], "=5", "names no key"),
    row("delete ~train.seed", ["show", "~train.seed"], "~train.seed", "cannot be removed"),
    row("delete a group ~model", ["show", "~model"], "~model", "cannot be removed"),
    row("deepspeed keys with zero_stage=0", ["show", "+parallel.deepspeed.X=1"],
        "parallel.deepspeed", "parallel.zero_stage=0", "DeepSpeed"),
    row("deepspeed key contradicts zero_stage",
        ["show", "+parallel.deepspeed.zero_optimization.stage=2", "parallel.zero_stage=1"],
        "parallel.deepspeed.zero_optimization.stage=2", "contradicts"),
    # DeepSpeed's own config models read the raw keys before anything starts: these passed every
    # check and --dry-run, and failed inside the ranks with exit 1 (a pydantic dump)
    row("deepspeed raw key of the wrong type",
        ["show", "+parallel.deepspeed.zero_optimization.reduce_bucket_size=abc",
         "parallel.zero_stage=1"],
        "DeepSpeed's config refuses zero_optimization.reduce_bucket_size='abc'", "valid integer"),
    # DeepSpeed's CPU accelerator has no fp16: every rank failed at the engine's start, exit 1
    row("fp16 with ZeRO on CPU", ["launch", "--dry-run", "train.dtype=fp16",
                                  "parallel.zero_stage=2", "launcher.device=cpu"],
        "train.dtype=fp16 on CPU", "bf16 or fp32"),
    row("deepspeed raw key unknown inside a section",
        ["show", "+parallel.deepspeed.zero_optimization.bogus=1", "parallel.zero_stage=2"],
        "zero_optimization.bogus=1", "Extra inputs are not permitted"),
]


def _big_yaml(c: Ctx) -> str:
    return c.file("big.yaml", RECIPE_HEAD + ("# " + "x" * 100 + "\n") * 11000)


def _deep_yaml(c: Ctx) -> str:
    return c.file("deep.yaml", RECIPE_HEAD + "name: " + "[" * 50000 + "]" * 50000 + "\n")


def _frozen_with_bad_key(c: Ctx) -> str:
    return c.frozen("old-run/config.yaml",
                    lambda t: t.replace("\ntrain:\n", "\ntrain:\n  bogus_key: 1\n", 1))


ROWS_CONFIG_FILES = [
    row("yaml duplicate key",
        lambda c: ["show", c.recipe("dup.yaml", "train:\n  seed: 1\n  seed: 2\n")],
        "dup.yaml", "duplicate key 'seed'", "line 6"),
    row("yaml not UTF-8 (Latin-1)",
        lambda c: ["show", c.file("latin1.yaml", RECIPE_HEAD.encode() + b"name: caf\xe9\n")],
        "latin1.yaml", "not UTF-8", "0xe9"),
    row("yaml binary garbage",
        lambda c: ["show", c.file("garbage.yaml", bytes(range(256)) * 8)],
        "garbage.yaml", ("not UTF-8", "not valid YAML")),
    row("config is a directory (tmp_path)", lambda c: ["show", c.path()], "config file",
        "is a directory"),
    row("config is a directory named x.yaml", lambda c: ["show", c.dir("x.yaml")],
        "x.yaml", "is a directory"),
    row("yaml empty file", lambda c: ["show", c.file("empty.yaml", b"")],
        "empty.yaml", "defaults"),
    row("yaml list, not a mapping", lambda c: ["show", c.file("list.yaml", "- a\n- b\n")],
        "list.yaml", ("defaults", "mapping")),
    row("yaml without defaults",
        lambda c: ["show", c.file("nodefaults.yaml", "train:\n  seed: 1\n")],
        "nodefaults.yaml", "no defaults list"),
    row("yaml defaults: 5", lambda c: ["show", c.file("defs5.yaml", "defaults: 5\n")],
        "defs5.yaml", "defaults", "list"),
    row("yaml unknown key in a section",
        lambda c: ["show", c.recipe("unknown.yaml", "train:\n  max_step: 3\n")],
        "unknown.yaml", "train.max_step", "did you mean train.max_steps?"),
    row("yaml unknown top-level int key", lambda c: ["show", c.recipe("intkey.yaml", "1: x\n")],
        "intkey.yaml", "unknown config key 1"),
    row("yaml wrong type train: {seed: abc}",
        lambda c: ["show", c.recipe("wrongtype.yaml", "train: {seed: abc}\n")],
        "wrongtype.yaml", "train.seed", "'abc'", "Integer"),
    row("yaml section is a number (train: 5)",
        lambda c: ["show", c.recipe("trainint.yaml", "train: 5\n")],
        "trainint.yaml", "train", ("mapping", "section"), absent=("did you mean train?",)),
    row("yaml section is null (train: null)",
        lambda c: ["show", c.recipe("trainnull.yaml", "train: null\n")],
        "trainnull.yaml", "train", ("mapping", "section"), absent=("did you mean train?",)),
    row("yaml override model: tinyy",
        lambda c: ["show", c.file("override.yaml", "defaults:\n  - config\n  - override model: "
                                                   "tinyy\n  - _self_\n")],
        "override.yaml", "override model: tinyy", "did you mean tiny?"),
    row("yaml defaults model: tinyy (no override)",
        lambda c: ["show", c.file("defnoover.yaml", "defaults:\n  - config\n  - model: tinyy\n"
                                                    "  - _self_\n")],
        "defnoover.yaml", "tinyy", "not an option"),
    row("yaml defaults with an unknown group",
        lambda c: ["show", c.file("defgroup.yaml", "defaults:\n  - config\n  - nosuchgroup: x\n"
                                                   "  - _self_\n")],
        "defgroup.yaml", "nosuchgroup"),
    row("yaml tab indentation", lambda c: ["show", c.recipe("tab.yaml", "\tname: x\n")],
        "tab.yaml", "not valid YAML", "line 4"),
    row("yaml python tag",
        lambda c: ["show", c.recipe("tag.yaml", "x: !!python/object:os.system {}\n")],
        "tag.yaml", "not valid YAML", "python/object"),
    row("yaml list as a key", lambda c: ["show", c.recipe("listkey.yaml", "? [a, b]\n: x\n")],
        "listkey.yaml", "not valid YAML", "list or mapping"),
    row("yaml interpolation of a missing env variable",
        lambda c: ["show", c.recipe("interp.yaml", "name: ${oc.env:PARTRAIN_HOSTILE_NOPE}\n")],
        "interp.yaml", "name", "PARTRAIN_HOSTILE_NOPE", "not found"),
    row("yaml nested 50000 deep", lambda c: ["show", _deep_yaml(c)], "deep.yaml"),
    row("yaml over 1 MiB", lambda c: ["show", _big_yaml(c)], "big.yaml", "bytes", "at most"),
    row("config /dev/null", ["show", "/dev/null"], "/dev/null", "not a regular file"),
    row("config .yaml that does not exist", lambda c: ["show", c.path("nosuch.yaml")],
        "nosuch.yaml", "does not exist"),
    row("config .yml that does not exist", lambda c: ["show", c.path("nosuch.yml")],
        "nosuch.yml", "does not exist"),
    row("unknown recipe name", ["show", "quickstrat"], "quickstrat", "unknown recipe"),
    row("empty CONFIG argument", ["launch", "--dry-run", ""], "CONFIG", "empty"),
    row("frozen config with an unknown key", lambda c: ["show", _frozen_with_bad_key(c)],
        "old-run/config.yaml", "train.bogus_key", "unknown config key"),
    row("frozen config with overrides",
        lambda c: ["show", c.frozen("run/config.yaml"), "train.seed=3"],
        "run/config.yaml", "train.seed=3", "no overrides"),
    row("frozen config with a wrong type",
        lambda c: ["show", c.frozen("run/config.yaml",
                                    lambda t: t.replace("\n  seed: 0\n", "\n  seed: abc\n"))],
        "run/config.yaml", "train.seed", "'abc'", "Integer"),
    row("frozen config with a section that is a number",
        lambda c: ["show", c.frozen("run/config.yaml",
                                    lambda t: t.replace("\noptim:\n", "\noptim: 5\nxoptim:\n"))],
        "run/config.yaml", "optim", absent=("did you mean optim?",)),
    row("frozen config with nan", lambda c: ["show", c.frozen(
        "run/config.yaml", lambda t: t.replace("\n  lr: 0.003\n", "\n  lr: .nan\n"))],
        "optim.lr=nan", "finite"),
    row("token dir meta.json in Latin-1",
        lambda c: ["launch", "--dry-run", "data=tokens", "data.path=" + c.tokens(
            "tok", raw_meta='{"format": "partrain-tokens/1", "tokenizer": "bytés"}'.encode(
                "latin-1"))],
        "data.path=", "meta.json", "not UTF-8", "0xe9"),
]


ROWS_ABSURD = [
    row("show parallel.dp=1000000000", ["show", "parallel.dp=1000000000"],
        "parallel.dp=1000000000", "exceeds"),
    row("plan --world-size 1000000000", ["plan", "--world-size", "1000000000"],
        "--world-size", "1,000,000,000", "exceeds"),
    row("launch dp=2000 past the per-node cap",
        ["launch", "--dry-run", "parallel.dp=2000", "train.global_batch_size=null",
         "train.micro_batches=1"],
        ("parallel.dp=2000", "dp(2000)"), "1024"),
    row("show model.n_heads=1000000007", ["show", "model.n_heads=1000000007"],
        "model.n_heads=1000000007", "divide"),
    row("show train.seed=10**20", ["show", "train.seed=99999999999999999999"],
        "train.seed=99999999999999999999", "at most"),
    row("show collective_timeout_s=10**8", ["show", "launcher.collective_timeout_s=100000000"],
        "launcher.collective_timeout_s=100000000", "at most"),
    row("show pp_virtual_stages=10**9",
        ["show", "parallel.pp_virtual_stages=1000000000", "parallel.pp_schedule=interleaved_1f1b",
         "parallel.pp=2", "parallel.dp=1"],
        "pp_virtual_stages(1000000000)", "exceeds"),
    row("plan model.n_layers=10**12 (a MemoryError traceback before)",
        ["plan", "model.n_layers=1000000000000"], "model.n_layers=1000000000000", "exceeds 4096"),
    row("plan --search model.n_layers=10**6 (over a minute before)",
        ["plan", "--search", "--gpus", "8", "model.n_layers=1000000"], "model.n_layers=1000000",
        "exceeds 4096"),
    row("show model.dim=10**20 (beyond int64)",
        ["show", "model.dim=100000000000000000000", "model.n_heads=1", "model.n_kv_heads=1"],
        "model.dim=100000000000000000000"),
]

ROWS_BLAME = [
    # The divergence guard needs at least one skipped step to stop on.
    row("launch train.max_skipped_steps=0", ["launch", "--dry-run", "train.max_skipped_steps=0"],
        "train.max_skipped_steps=0", "at least 1"),
    row("show train.max_skipped_steps=-3", ["show", "train.max_skipped_steps=-3"],
        "train.max_skipped_steps=-3", "at least 1"),
    row("show train.max_skipped_steps=nan", ["show", "train.max_skipped_steps=nan"],
        "train.max_skipped_steps"),
    row("launch --max-restarts -1", ["launch", "--dry-run", "--max-restarts", "-1"],
        "--max-restarts=-1", "at least 0"),
    row("launch launcher.max_restarts=5000", ["launch", "--dry-run", "launcher.max_restarts=5000"],
        "launcher.max_restarts=5000", "0..1000"),
    row("slurm --max-restarts x", ["slurm", "--nodes", "1", "--dry-run", "--max-restarts", "x"],
        "--max-restarts='x'", "whole number"),
    row("blame parallel.dp=0", ["launch", "--dry-run", "parallel.dp=0"], "parallel.dp=0",
        "at least 1", absent=("--nproc-per-node",)),
    row("blame parallel.tp=0", ["launch", "--dry-run", "parallel.tp=0"], "parallel.tp=0",
        "at least 1", absent=("--nproc-per-node",)),
    row("blame parallel.dp=1.5", ["launch", "--dry-run", "parallel.dp=1.5"], "parallel.dp=1.5",
        "positive integer", absent=("--nproc-per-node",)),
    row("blame parallel.dp=abc", ["launch", "--dry-run", "parallel.dp=abc"], "parallel.dp=abc",
        "positive integer", absent=("--nproc-per-node",)),
    row("blame launcher.nproc_per_node=0", ["launch", "--dry-run", "launcher.nproc_per_node=0"],
        "launcher.nproc_per_node=0", "at least 1", absent=("--nproc-per-node",)),
    row("blame launcher.nnodes=0", ["launch", "--dry-run", "launcher.nnodes=0"],
        "launcher.nnodes=0", "at least 1", absent=("--nnodes",)),
    row("blame parallel.dp=auto without a world size", ["launch", "--dry-run", "parallel.dp=auto"],
        "parallel.dp=auto", "world size"),
    row("blame --nproc-per-node 3 against dp=2", ["launch", "--dry-run", "--nproc-per-node", "3"],
        "dp(2)", "world size 3", "--nproc-per-node"),
    row("blame --nnodes 3 against 2 ranks",
        ["launch", "--dry-run", "--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:29999"],
        "--nnodes=3", "spread evenly"),
]


ROWS_TYPES_AND_CHOICES = [
    row("type: train.seed=abc", ["show", "train.seed=abc"], "train.seed", "'abc'", "Integer"),
    row("type: model.n_layers=1.5", ["show", "model.n_layers=1.5"], "model.n_layers", "1.5",
        "Integer"),
    row("type: optim.lr=abc", ["show", "optim.lr=abc"], "optim.lr", "'abc'", "Float"),
    row("type: model.dim={a:1}", ["show", "model.dim={a:1}"], "model.dim", "'a'", "Integer"),
    # OmegaConf takes any number for a bool: 2 was true, 0 false, without a word
    row("type: parallel.sequence_parallel=2", ["show", "parallel.sequence_parallel=2"],
        "parallel.sequence_parallel=2", "true or false"),
    row("type: train.compile=0", ["show", "train.compile=0"], "train.compile=0", "true or false"),
    row("type: parallel.sequence_parallel=maybe", ["show", "parallel.sequence_parallel=maybe"],
        "parallel.sequence_parallel", "'maybe'", "bool"),
    row("type: parallel.deepspeed=5", ["show", "parallel.deepspeed=5"], "parallel.deepspeed",
        "int", "Dict"),
    row("type: parallel.pp_layers=abc", ["show", "parallel.pp_layers=abc"],
        "parallel.pp_layers", "str", "list"),
    row("null: name=null", ["show", "name=null"], "name", "null", "not Optional"),
    row("null: train.seed=null", ["show", "train.seed=null"], "train.seed", "null",
        "not Optional"),
    row("null: train.micro_batch_size=null (two of three)",
        ["show", "train.micro_batch_size=null"], "train.micro_batch_size", "set two of"),
    row("interpolation: train.seed=${oc.env:...}",
        ["show", "train.seed=${oc.env:PARTRAIN_HOSTILE_NOPE}"], "train.seed",
        "PARTRAIN_HOSTILE_NOPE", "not found"),
    row("interpolation: train.seed=${nosuch.key}", ["show", "train.seed=${nosuch.key}"],
        "train.seed", "nosuch.key", "not found"),
    row("choice: parallel.pp_schedule=foo", ["show", "parallel.pp_schedule=foo"],
        "parallel.pp_schedule=foo", "not one of"),
    row("choice: train.dtype=true", ["show", "train.dtype=true"],
        ("train.dtype=true", "train.dtype=True"), "not one of"),
    row("choice: launcher.device=tpu", ["show", "launcher.device=tpu"], "launcher.device=tpu",
        "not one of"),
    row("choice: data.source=web", ["show", "data.source=web"], "data.source=web", "not one of"),
    row("choice: parallel.offload_optimizer=disk",
        ["show", "parallel.offload_optimizer=disk", "parallel.zero_stage=1"],
        "parallel.offload_optimizer=disk", "not one of"),
    row("choice: parallel.zero_stage=4", ["show", "parallel.zero_stage=4"],
        "parallel.zero_stage=4", "0 (DDP), 1, 2 or 3"),
    row("choice: optim.name=lion", ["show", "optim.name=lion"], "optim.name=lion",
        "adamw, adam, sgd"),
    row("rule: offload_optimizer=cpu at zero_stage=0", ["show", "parallel.offload_optimizer=cpu"],
        "parallel.offload_optimizer=cpu", "zero_stage >= 1"),
    row("rule: nvme offload without a path",
        ["show", "parallel.offload_optimizer=nvme", "parallel.zero_stage=1"],
        "parallel.offload_nvme_path", "nvme"),
    row("rule: fp16 without ZeRO", ["show", "train.dtype=fp16"], "train.dtype=fp16",
        "zero_stage >= 1"),
    row("rule: pp_layers=[0,4]", ["show", "parallel.pp_layers=[0,4]", "parallel.pp=2",
                                  "parallel.dp=1"],
        "parallel.pp_layers=[0, 4]", "positive"),
    row("rule: batch triple inconsistent", ["show", "train.micro_batches=3"],
        "micro_batches(3)", "train.global_batch_size=16", "!="),
    row("rule: tp=3 on llama-70b", ["show", "model=llama-70b", "parallel.tp=3"],
        "parallel.tp=3", "model.n_heads=64", "divide"),
    *[row(f"negative: {key}={value}", ["show", f"{key}={value}"], f"{key}={value}", rule)
      for key, value, rule in [
          ("train.max_steps", -1, "at least 1"), ("model.vocab_size", -5, "at least 1"),
          ("data.stdlib_max_bytes", -1, "at least 1"), ("launcher.rdzv_timeout_s", 0, "at least 1"),
          ("train.micro_batch_size", -2, "at least 1"), ("train.eval_batches", 0, "at least 1")]],
]

TABLE = [*_rows_non_finite(), *ROWS_FLOAT_RANGE, *ROWS_UNKNOWN_KEYS, *ROWS_CONFIG_FILES,
         *ROWS_ABSURD, *ROWS_BLAME, *ROWS_TYPES_AND_CHOICES]


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


def test_table_is_big_enough():
    assert len(TABLE) >= 80


def test_deepspeed_takes_free_keys(run_main):
    """A control: the one open section takes keys partrain does not declare (DeepSpeed's own;
    one DeepSpeed does not know is refused: it would ignore it)."""
    result = run_main("show", "+parallel.deepspeed.steps_per_print=7", "parallel.zero_stage=1")
    assert result.code == 0, result.stderr
    assert "steps_per_print: 7" in result.stdout
    result = run_main("show", "+parallel.deepspeed.X=1", "parallel.zero_stage=1")
    assert result.code == 2 and "DeepSpeed has no key X" in result.stderr

"""The validation rules through the CLI: in-process (main() with sys.argv) and in a real
subprocess, each a bad value that must exit 2 with one message on stderr, no traceback and
nothing on stdout. The rules themselves are test_validate.py's."""

import pytest

from tests.unit.helpers import finish, start_cli

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
    # the recipe after an override: Hydra's `missing EQUAL at '<EOF>'`
    (["show", "train.max_steps=3", "quickstart"], "quickstart is a CONFIG (a recipe or a YAML "
     "file), given after overrides: it comes first"),
    (["show", "parallel.zero_stage=1", "parallel.deepspeed_config=/"],
     "parallel.deepspeed_config=/: it is a directory, not a file"),
    # the same words in another order: spelling alone said `tiny`; case alone said nothing
    (["show", "model=moe-tiny"], "(did you mean tiny-moe?)"),
    (["show", "train.MAX_STEPS=3"], "(did you mean train.max_steps?)"),
    # An empty value (an unset shell variable) was read as unset: from scratch, the built-in
    # model, no DeepSpeed file, and not a word.
    (["launch", "--dry-run", "model.init_from="],
     "model.init_from='' is empty (an unset shell variable?)"),
    (["show", "model.target="], "model.target='' is empty"),
    (["show", "parallel.zero_stage=2", "parallel.deepspeed_config="],
     "parallel.deepspeed_config='' is empty"),
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


def test_cli_plan_multiple_of_zero_is_exit_2(run_main):
    result = run_main("plan", "model.multiple_of=0")
    assert result.code == 2
    assert "model.multiple_of=0" in result.stderr

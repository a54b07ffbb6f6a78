"""Hostile input, round three, the SLURM part: `slurm --sbatch-arg` spelling an option that
partrain's script sets itself (short forms, attached values, abbreviations, grouped letters, GPU
requests by --gres, and --cpus-per-task, --mem, --exclusive, which are partrain's flags now), or
one that blocks or submits nothing, is refused naming the partrain flag; every other sbatch
option is written as given. The values of --cpus-per-task, --mem and --setup (and the config's
launcher.setup) are refused naming the flag or key, the value and the rule. The contract and the
checks are test_hostile.py's (tests/unit/cli/hostile.py); the other inputs of the round are in
test_hostile_round3_interop.py."""

import pytest

from tests.unit.cli.hostile import Ctx, check_row, isolated, row  # noqa: F401 (isolated: autouse)

# ------------------------------------------------------------------------------------------------
# slurm --sbatch-arg: every spelling of an option partrain's script sets.


def _sbatch(arg: str):
    return lambda c: ["slurm", "--nodes", "2", "--nproc-per-node", "1", "parallel.dp=2",
                      "--dry-run", "--run-dir", "run", f"--sbatch-arg={arg}"]


CONTRADICTS = "contradicts what partrain writes itself"

ROWS_SBATCH = [
    row(f"--sbatch-arg {arg}", _sbatch(arg), f"--sbatch-arg {arg!r}", CONTRADICTS,
        f"--{option}", f"from {source}", *extra)
    for arg, option, source, extra in (
        ("-N 4", "nodes", "--nodes", ["-N is its short form"]),
        ("-N4", "nodes", "--nodes", ["-N is its short form"]),
        ("-N", "nodes", "--nodes", []),
        ("--nod=4", "nodes", "--nodes", ["sbatch takes --nod for --nodes"]),
        ("--node=4", "nodes", "--nodes", []),
        ("--nodes 4", "nodes", "--nodes", []),
        ("-vN4", "nodes", "--nodes", []),
        ("-HQN4", "nodes", "--nodes", []),
        ("--ntasks-per-node=8", "ntasks-per-node", "--nproc-per-node", ["one task per node"]),
        ("--ntasks-per-n=8", "ntasks-per-node", "--nproc-per-node", []),
        ("--tasks-per-node=8", "tasks-per-node", "--nproc-per-node", []),
        ("-n16", "ntasks", "--nproc-per-node", []),
        ("--ntasks=16", "ntasks", "--nproc-per-node", []),
        ("--ntasks-per-gpu=1", "ntasks-per-gpu", "--nproc-per-node", []),
        ("--gres=gpu:4", "gpus-per-node", "--gpus-per-node", ["--gres=gpu:4 asks for GPUs"]),
        ("--gres=gpu:a100:8,nvme:1", "gpus-per-node", "--gpus-per-node", []),
        ("--gres=gres/gpu:2", "gpus-per-node", "--gpus-per-node", []),
        ("--tres-per-task=gres/gpu=1", "gpus-per-node", "--gpus-per-node", []),
        ("--gpus=8", "gpus", "--gpus-per-node", []),
        ("-G8", "gpus", "--gpus-per-node", []),
        ("--gpus-per-task=1", "gpus-per-task", "--gpus-per-node", []),
        ("--gpus-per-n=4", "gpus-per-node", "--gpus-per-node", []),
        ("--output=/tmp/x.out", "output", "--run-dir", ["logs go to RUN_DIR/logs"]),
        ("-o/tmp/x.out", "output", "--run-dir", []),
        ("--out=/tmp/x.out", "output", "--run-dir", []),
        ("-e/tmp/x.err", "error", "--run-dir", []),
        ("--signal=B:USR1@60", "signal", "its preemption handling", ["USR2 120 s"]),
        ("--sig=USR1", "signal", "its preemption handling", []),
        ("--requeue", "requeue", "its preemption handling", []),
        ("--req", "requeue", "its preemption handling", []),
        ("--open-mode=truncate", "open-mode", "--run-dir", ["appends to its log"]),
        ("-Jother", "job-name", "the config's name", []),
        # An array's tasks would all train in the one run dir at once (each its own job).
        ("--array=0-3", "array", "--run-dir", ["each array task would train in the same run dir"]),
        ("-a0-3", "array", "--run-dir", ["-a is its short form"]),
        ("-pdebug", "partition", "--partition", []),
        ("--part=debug", "partition", "--partition", []),
        ("-t10", "time", "--time", []),
        ("-Aproj", "account", "--account", []),
        ("-qhigh", "qos", "--qos", []),
        ("--wait", "wait", "its submission", ["--parsable"]),
        ("-W", "wait", "its submission", []),
        ("--test-only", "test-only", "its submission", []),
        ("--version", "version", "its submission", []),
        ("-c8", "cpus-per-task", "--cpus-per-task", ["-c is its short form", "srun's step"]),
        ("-c 8", "cpus-per-task", "--cpus-per-task", []),
        ("-vc8", "cpus-per-task", "--cpus-per-task", []),
        ("--cpus-per-task=8", "cpus-per-task", "--cpus-per-task", []),
        ("--cpus-per-t=8", "cpus-per-task", "--cpus-per-task",
         ["sbatch takes --cpus-per-t for --cpus-per-task"]),
        ("--mem=0", "mem", "--mem", ["use --mem"]),
        ("--mem=64G", "mem", "--mem", []),
        ("--exclusive", "exclusive", "--exclusive", ["use --exclusive"]),
        ("--excl", "exclusive", "--exclusive", []),
        ("--excl=user", "exclusive", "--exclusive", []),  # also --exclude's: not the sharing mode
        ("--e=/tmp/x.err", "error", "--run-dir", []))
] + [
    row("--sbatch-arg two options in one", _sbatch("--hold --nice=10"),
        "--sbatch-arg '--hold --nice=10'", "one option per --sbatch-arg", "'hold --nice'"),
    # After a value: sbatch took it all as --constraint's value (or lost --mail-type silently in
    # a --comment's).
    row("--sbatch-arg two options, the first with a value",
        _sbatch("--constraint=a100 --mail-type=END"),
        "--sbatch-arg '--constraint=a100 --mail-type=END' holds 2 options",
        "one value of --constraint",
        "--sbatch-arg=--constraint=a100 --sbatch-arg=--mail-type=END"),
    row("--sbatch-arg a long option after a short one's value",
        _sbatch("-C a100 --mail-type=END"), "holds 2 options", "one value of -C:",
        "--sbatch-arg=-C a100 --sbatch-arg=--mail-type=END"),
    row("--sbatch-arg a value without its option", _sbatch("4"), "--sbatch-arg '4'",
        "must be an sbatch option"),
]


@pytest.mark.parametrize("argv, fragments, absent", ROWS_SBATCH)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


# slurm --cpus-per-task, --mem, --exclusive, --setup and launcher.setup: their values.


def _slurm(*flags: str):
    return lambda c: ["slurm", "--nodes", "2", "--nproc-per-node", "1", "parallel.dp=2",
                      "--dry-run", "--run-dir", "run", *flags]


MEM_RULE = "not a SLURM memory size"

ROWS_FLAGS = [
    row("--mem 64GiB", _slurm("--mem", "64GiB"), "--mem '64GiB'", MEM_RULE, "K, M, G or T"),
    row("--mem 500B", _slurm("--mem", "500B"), "--mem '500B'", MEM_RULE),
    row("--mem 1.5G", _slurm("--mem", "1.5G"), "--mem '1.5G'", MEM_RULE),
    row("--mem=-1", _slurm("--mem=-1"), "--mem '-1'", MEM_RULE),
    row("--mem ''", _slurm("--mem", ""), "--mem ''", MEM_RULE),
    row("--mem 64 G", _slurm("--mem", "64 G"), "--mem '64 G'", MEM_RULE),
    row("--mem 13 digits", _slurm("--mem", "9" * 13), "--mem '9999999999999'", "at most 12 digits"),
    row("--mem with a newline", _slurm("--mem", "64G\n#SBATCH --x"), "--mem=", "control character"),
    row("--cpus-per-task 0", _slurm("--cpus-per-task", "0"), "--cpus-per-task=0", "at least 1"),
    row("--cpus-per-task x", _slurm("--cpus-per-task", "x"), "--cpus-per-task='x'",
        "not a whole number"),
    row("--cpus-per-task 65535", _slurm("--cpus-per-task", "65535"), "--cpus-per-task=65535",
        "between 1 and 65534"),
    row("--cpus-per-task of 50 digits", _slurm("--cpus-per-task", "9" * 50), "--cpus-per-task",
        "too large a number"),
    row("--exclusive=yes", _slurm("--exclusive=yes"), "--exclusive", "does not take a value"),
    row("--setup ''", _slurm("--setup", ""), "--setup ''", "empty", "give a shell line"),
    row("--setup with a newline", _slurm("--setup", "module load x\nrm -rf ~"),
        "--setup='module load x\\nrm -rf ~'", "control character"),
    row("--setup with a tab", _slurm("--setup", "echo\ta"), "--setup='echo\\ta'",
        "control character"),
    row("launcher.setup with a tab", lambda c: ["slurm", c.file(
        "cfg.yaml", "defaults:\n  - config\n  - _self_\nlauncher:\n  setup:\n"
                    '    - "echo\\ta"\n'), *_slurm()(c)[1:]],
        "launcher.setup", "'echo\\ta'", "control character"),
    row("launcher.setup with an empty line", _slurm("launcher.setup=[a,' ']"), "launcher.setup",
        "must be a shell line"),
    row("--exclusive with --sbatch-arg=--exclusive=user",
        _slurm("--exclusive", "--sbatch-arg=--exclusive=user"), "--sbatch-arg '--exclusive=user'",
        "--exclusive", "two ways of sharing"),
    row("--mem with --sbatch-arg=--mem-per-cpu",
        _slurm("--mem", "8G", "--sbatch-arg=--mem-per-cpu=1G"),
        "--sbatch-arg '--mem-per-cpu=1G'", "--mem", "takes one of"),
    # On an #SBATCH line, sbatch takes "packjob" or "hetjob" anywhere as the start of another
    # component of a heterogeneous job: the signal and requeue lines after it were not the job's.
    row("name holding hetjob", _slurm("name=my-hetjob-run"), "name='my-hetjob-run'",
        "'hetjob'", "heterogeneous job"),
    row("--partition holding packjob", _slurm("--partition", "gpu-PackJob"),
        "--partition='gpu-PackJob'", "'packjob'"),
    row("--run-dir holding hetjob", lambda c: ["slurm", "--nodes", "2", "--nproc-per-node", "1",
                                                "parallel.dp=2", "--dry-run", "--run-dir",
                                                c.path("hetjob-runs", "r")],
        "--run-dir=", "hetjob-runs", "'hetjob'"),
    # What the job asks SLURM for against what its ranks use.
    row("launcher.device=cuda without --gpus-per-node", _slurm("launcher.device=cuda"),
        "launcher.device=cuda and no --gpus-per-node", "no GPUs", "--gpus-per-node 1"),
    row("more ranks than GPUs", lambda c: ["slurm", "--nodes", "1", "--nproc-per-node", "2",
                                           "--gpus-per-node", "1", "parallel.dp=2",
                                           "launcher.device=cuda", "--dry-run", "--run-dir",
                                           "run"],
        "--nproc-per-node 2 > --gpus-per-node 1", "would have none"),
    # The quickstart's cpu with GPUs asked for: the job held them idle and trained on CPUs.
    row("launcher.device=cpu with --gpus-per-node", _slurm("launcher.device=cpu",
                                                           "--gpus-per-node", "8"),
        "launcher.device=cpu and --gpus-per-node 8", "hold 8 GPUs on each node and train on its "
        "CPUs", "launcher.device=cuda"),
    row("--cpus-per-task with --sbatch-arg=--cpus-per-gpu",
        _slurm("--cpus-per-task", "8", "--sbatch-arg=--cpus-per-gpu=4"),
        "--sbatch-arg '--cpus-per-gpu=4'", "--cpus-per-task", "takes one of"),
]


@pytest.mark.parametrize("argv, fragments, absent", ROWS_FLAGS)
def test_bad_job_values_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


def test_dry_run_shows_every_new_flag(run_main, tmp_path, monkeypatch):
    c = Ctx(tmp_path, monkeypatch)
    config = c.file("cfg.yaml", "defaults:\n  - config\n  - _self_\nlauncher:\n  setup:\n"
                                "    - module load cuda/12.4\n")
    argv = _slurm("--cpus-per-task", "4", "--mem", "64G", "--exclusive",
                  "--setup", "echo \"it's $HOSTNAME\"")(c)
    result = run_main("slurm", config, *argv[1:])
    assert result.code == 0, result.stderr
    for line in ("#SBATCH --cpus-per-task=4\n", "#SBATCH --mem=64G\n", "#SBATCH --exclusive\n",
                 " --cpus-per-task=4 --export=ALL \\\n",
                 "setup=(\n    'module load cuda/12.4'\n    'echo \"it'\"'\"'s $HOSTNAME\"'\n)\n"):
        assert line in result.stdout, line
    assert result.stdout == (tmp_path / "run" / "job.sbatch").read_text()


@pytest.mark.parametrize("name, value, flags, option", [
    ("SBATCH_NO_REQUEUE", "1", (), "--requeue"),
    ("SBATCH_SIGNAL", "USR1@60", (), "--signal"),
    ("SBATCH_ARRAY_INX", "0-3", (), "--array"),
    ("SBATCH_PARTITION", "debug", ("--partition", "gpu"), "--partition"),
    ("SBATCH_TIMELIMIT", "10", ("--time", "04:00:00"), "--time"),
])
def test_an_sbatch_variable_that_overrides_the_script_is_refused(run_main, tmp_path, monkeypatch,
                                                                  name, value, flags, option):
    """sbatch takes SBATCH_* variables over the script's #SBATCH lines (man sbatch): a site
    profile's SBATCH_NO_REQUEUE or SBATCH_SIGNAL undid the preemption handling in silence."""
    monkeypatch.setenv(name, value)
    result = run_main(*_slurm(*flags)(Ctx(tmp_path, monkeypatch)))
    assert result.code == 2, result.stderr
    said = " ".join(result.stderr.split())
    assert f"{name}={value!r} is set in the environment" in said and option in said, said
    assert not (tmp_path / "run").exists()


def test_an_sbatch_variable_for_an_option_not_given_is_the_sites_default(run_main, tmp_path,
                                                                         monkeypatch):
    # No --partition: SBATCH_PARTITION is the site's default, which the script does not set.
    monkeypatch.setenv("SBATCH_PARTITION", "debug")
    result = run_main(*_slurm()(Ctx(tmp_path, monkeypatch)))
    assert result.code == 0, result.stderr


def test_a_job_on_auto_that_asks_for_no_gpus_is_a_warning(run_main, tmp_path, monkeypatch):
    """launcher.device=auto (the default) and no --gpus-per-node: the job asks SLURM for no
    GPUs; said, since it trains on the nodes' CPUs where they show it none. With GPUs asked
    for, or on CPU, nothing is said."""
    said = "launcher.device=auto and no --gpus-per-node: the job asks SLURM for no GPUs"
    result = run_main(*_slurm("launcher.device=auto")(Ctx(tmp_path, monkeypatch)))
    assert result.code == 0 and said in " ".join(result.stderr.split()), result.stderr
    for flags in (("launcher.device=auto", "--gpus-per-node", "1"), ("launcher.device=cpu",)):
        result = run_main("slurm", "--nodes", "2", "--nproc-per-node", "1", "parallel.dp=2",
                          "--dry-run", "--run-dir", str(tmp_path / f"run{len(flags)}"), *flags)
        assert "#SBATCH --gpus-per-node=1" in result.stdout or "cpu" in flags[0]
        assert result.code == 0 and "no --gpus-per-node" not in result.stderr, result.stderr


def test_fewer_cpus_than_ranks_is_a_warning(run_main, tmp_path, monkeypatch):
    result = run_main("slurm", "--nodes", "1", "--nproc-per-node", "2", "parallel.dp=2",
                      "--dry-run", "--run-dir", "run", "--cpus-per-task", "1")
    assert result.code == 0, result.stderr
    assert "warning: --cpus-per-task=1 gives the 2 ranks of each node less than a core each; " \
        "ask for at least 2" in " ".join(result.stderr.split())


@pytest.mark.parametrize("arg", ["--gres=nvme:1",
                                 "--gres-flags=enforce-binding", "--constraint=a100",
                                 "-Ca100", "-bnow", "--begin=now",
                                 "--comment=a b", "--nodelist=n[1-2]", "--no-kill",
                                 "--time-min=10", "--mem-per-gpu=10G", "--cpus-per-gpu=4",
                                 "--gpu-bind=closest", "--exclusive=user", "--export=ALL",
                                 "--mail-type=END", "--dependency=afterok:1", "-dafterok:1",
                                 "-HQv", "--hold", "--nice=10", "--mem-per-cpu=2G"])
def test_sbatch_args_partrain_does_not_set_are_written(arg, run_main, tmp_path, monkeypatch):
    from partrain.launch.slurm import _sbatch_quote

    result = run_main(*_sbatch(arg)(Ctx(tmp_path, monkeypatch)))
    assert result.code == 0, f"exit {result.code}\n{result.stdout}\n{result.stderr}"
    assert "error:" not in result.stderr, result.stderr
    assert f"#SBATCH {_sbatch_quote(arg)}\n" in result.stdout

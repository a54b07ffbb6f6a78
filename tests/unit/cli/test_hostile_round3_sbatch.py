"""Hostile input, round three, the SLURM part: `slurm --sbatch-arg` spelling an option that
partrain's script sets itself (short forms, attached values, abbreviations, grouped letters, GPU
requests by --gres), or one that blocks or submits nothing, is refused naming the partrain flag;
every other sbatch option is written as given. The contract and the checks are test_hostile.py's
(tests/unit/cli/hostile.py); the other inputs of the round are in
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
        ("-pdebug", "partition", "--partition", []),
        ("--part=debug", "partition", "--partition", []),
        ("-t10", "time", "--time", []),
        ("-Aproj", "account", "--account", []),
        ("-qhigh", "qos", "--qos", []),
        ("--wait", "wait", "its submission", ["--parsable"]),
        ("-W", "wait", "its submission", []),
        ("--test-only", "test-only", "its submission", []),
        ("--version", "version", "its submission", []))
] + [
    row("--sbatch-arg two options in one", _sbatch("--exclusive --mem=0"),
        "--sbatch-arg '--exclusive --mem=0'", "one option per --sbatch-arg",
        "'exclusive --mem'"),
    row("--sbatch-arg a value without its option", _sbatch("4"), "--sbatch-arg '4'",
        "must be an sbatch option"),
]


@pytest.mark.parametrize("argv, fragments, absent", ROWS_SBATCH)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


@pytest.mark.parametrize("arg", ["--exclusive", "--mem=0", "--gres=nvme:1",
                                 "--gres-flags=enforce-binding", "--constraint=a100",
                                 "-Ca100", "-bnow", "--begin=now",
                                 "--comment=a b", "--nodelist=n[1-2]", "--no-kill",
                                 "--time-min=10", "--mem-per-gpu=10G", "--cpus-per-gpu=4",
                                 "--gpu-bind=closest", "--exclusive=user", "--export=ALL",
                                 "--mail-type=END", "--dependency=afterok:1", "-dafterok:1",
                                 "-HQv", "--hold", "--nice=10", "-c8"])
def test_sbatch_args_partrain_does_not_set_are_written(arg, run_main, tmp_path, monkeypatch):
    from partrain.launch.slurm import _sbatch_quote

    result = run_main(*_sbatch(arg)(Ctx(tmp_path, monkeypatch)))
    assert result.code == 0, f"exit {result.code}\n{result.stdout}\n{result.stderr}"
    assert "error:" not in result.stderr, result.stderr
    assert f"#SBATCH {_sbatch_quote(arg)}\n" in result.stdout

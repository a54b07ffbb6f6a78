"""Hostile and careless input, part two: run dirs partrain must not use, bad flags and network
settings, rich markup in user text, the scheduler's environment. The contract and the checks are
test_hostile.py's (tests/unit/cli/hostile.py); token dirs whose meta.json lies and `data prepare`
that must not read or cannot write are test_hostile_data.py's, disks that refuse writes
test_hostile_disks.py's, and a few cases run as a user runs them, in a subprocess,
test_hostile_subprocess.py's.
"""

import os

import pytest

from tests.unit.cli.hostile import (
    MULTI_NODE,
    UNRESOLVABLE,
    Ctx,
    check_row,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    row,
)


def _run_dir_with_other_config(c: Ctx) -> str:
    c.frozen("other/config.yaml", lambda t: t.replace("\n  seed: 0\n", "\n  seed: 5\n"))
    return c.path("other")


def _run_dir_rows(command: list[str], name: str) -> list:
    return [
        row(f"{name} run dir under a file",
            lambda c: [*command, "--run-dir", c.file("afile") + "/run"],
            "--run-dir", "afile/run", "is a file"),
        row(f"{name} run dir is a file", lambda c: [*command, "--run-dir", c.file("afile")],
            "--run-dir", "afile", "existing file"),
        row(f"{name} run dir holds notes.txt",
            lambda c: [*command, "--run-dir", c.dir("notes", **{"notes.txt": "mine"})],
            "--run-dir", "notes", "not empty"),
        row(f"{name} run dir holds another config.yaml",
            lambda c: [*command, "--run-dir", _run_dir_with_other_config(c)],
            "--run-dir", "other", "holds another config (train.seed: 5 there, 0 here)"
            if command[0] == "launch" else "not empty"),
        row(f"{name} run dir under /dev/null", [*command, "--run-dir", "/dev/null/run"],
            "--run-dir", "/dev/null/run", "is a file"),
        row(f"{name} run dir name too long",
            lambda c: [*command, "--run-dir", c.path("a" * 300, "run")],
            "--run-dir", "a" * 300, "too long"),
    ]


ROWS_RUN_DIRS = [
    *_run_dir_rows(["launch", "--dry-run"], "launch"),
    *_run_dir_rows(["slurm", "--nodes", "1", "--dry-run"], "slurm")[:4],
    # '' (an unset variable) was the current directory: refused only where that was not empty
    row("launch run dir ''", ["launch", "--dry-run", "--run-dir", ""], "--run-dir is empty",
        "--run-dir ."),
    row("slurm bad value and a run dir",
        lambda c: ["slurm", "--nodes", "1", "--dry-run", "optim.lr=nan", "--run-dir",
                   c.path("run")],
        "optim.lr=nan", "finite"),
]


ROWS_NETWORK = [
    row("--local-addr not-an-ip",
        ["launch", "--dry-run", "--local-addr", "not-an-ip", *MULTI_NODE],
        "--local-addr", "not-an-ip", "not an IP address"),
    row("--rdzv-endpoint without port", ["launch", "--dry-run", *MULTI_NODE[:2],
                                         "--rdzv-endpoint", "127.0.0.1", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1", "HOST:PORT"),
    row("--rdzv-endpoint port 0", ["launch", "--dry-run", *MULTI_NODE[:2],
                                   "--rdzv-endpoint", "127.0.0.1:0", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:0", "1..65535"),
    row("--rdzv-endpoint port 70000", ["launch", "--dry-run", *MULTI_NODE[:2],
                                       "--rdzv-endpoint", "127.0.0.1:70000", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:70000", "1..65535"),
    row("--rdzv-endpoint without port, one node",
        ["launch", "--dry-run", "--rdzv-endpoint", "127.0.0.1"],
        "--rdzv-endpoint", "127.0.0.1", "HOST:PORT"),
    row("--rdzv-endpoint host does not resolve",
        ["launch", "--dry-run", *MULTI_NODE[:2], "--rdzv-endpoint", f"{UNRESOLVABLE}:29999",
         "parallel.dp=4"],
        "--rdzv-endpoint", UNRESOLVABLE, "does not resolve"),
    row("--ifname nosuchif0", ["launch", "--dry-run", "--ifname", "nosuchif0", *MULTI_NODE],
        "--ifname", "nosuchif0", "no such interface"),
    # partrain keeps a user's GLOO_SOCKET_IFNAME: a name the node lacks passed --dry-run, wrote the
    # run dir and failed every rank (gloo's "Unable to find address for: nosuchif0", exit 1)
    row("GLOO_SOCKET_IFNAME=nosuchif0, one node",
        lambda c: c.setenv(GLOO_SOCKET_IFNAME="nosuchif0") or ["launch", "--dry-run"],
        "GLOO_SOCKET_IFNAME=nosuchif0", "no interface nosuchif0 on this node"),
    row("GLOO_SOCKET_IFNAME=lo,nosuchif0, two nodes",
        lambda c: c.setenv(GLOO_SOCKET_IFNAME="lo,nosuchif0") or ["launch", "--dry-run",
                                                                  *MULTI_NODE],
        "GLOO_SOCKET_IFNAME=lo,nosuchif0", "no interface nosuchif0"),
    row("--nnodes 2 without --rdzv-endpoint", ["launch", "--dry-run", "--nnodes", "2",
                                               "parallel.dp=4"],
        "--nnodes=2", "--rdzv-endpoint"),
    row("--rdzv-endpoint without port, with --local-addr",
        ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1", "--local-addr",
         "127.0.0.1", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1", "HOST:PORT"),
    row("--rdzv-endpoint port 70000, with --ifname",
        ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:70000", "--ifname",
         "lo", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:70000", "1..65535"),
    row("--rdzv-endpoint port 0, with --local-addr and --ifname",
        ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr",
         "127.0.0.1", "--ifname", "lo", "parallel.dp=4"],
        "--rdzv-endpoint", "127.0.0.1:0", "1..65535"),
]

ROWS_MARKUP = [
    row("markup: data.path='/x/[run1]'", ["launch", "--dry-run", "data=tokens",
                                          "data.path='/x/[run1]'"],
        "data.path=/x/[run1]", "not a directory"),
    row("markup: run dir with [/x] under a file",
        lambda c: ["launch", "--dry-run", "--run-dir", c.file("afile") + "/[/x]"],
        "--run-dir", "afile/[/x]", "is a file"),
    row("markup: name='[bold]x'", ["show", "name='[bold]x'"], "name='[bold]x'", "plain name"),
    row("markup: --ifname [bold]x", ["launch", "--dry-run", "--ifname", "[bold]x", *MULTI_NODE],
        "--ifname [bold]x", "no such interface"),
]

def _slurm_env(c: Ctx, **override: str) -> None:
    c.setenv(**{"SLURM_JOB_ID": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
                "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_NTASKS_PER_NODE": "1", **override})


def _in_slurm(argv: list[str], **env: str):
    def build(c: Ctx) -> list[str]:
        _slurm_env(c, **env)
        return argv
    return build


ROWS_FLAGS = [
    row("--nproc-per-node abc", ["launch", "--dry-run", "--nproc-per-node", "abc"],
        "--nproc-per-node", "'abc'", "whole number"),
    row("--nproc-per-node 0", ["launch", "--dry-run", "--nproc-per-node", "0"],
        "--nproc-per-node=0", "at least 1"),
    row("--nproc-per-node -3", ["launch", "--dry-run", "--nproc-per-node", "-3"],
        "--nproc-per-node=-3", "at least 1"),
    row("--nproc-per-node 1.5", ["launch", "--dry-run", "--nproc-per-node", "1.5"],
        "--nproc-per-node", "'1.5'", "whole number"),
    row("--nproc-per-node ''", ["launch", "--dry-run", "--nproc-per-node", ""],
        "--nproc-per-node", "''", "whole number"),
    row("--nnodes -1", ["launch", "--dry-run", "--nnodes", "-1"], "--nnodes=-1", "at least 1"),
    row("--nnodes abc", ["launch", "--dry-run", "--nnodes", "abc"], "--nnodes", "'abc'",
        "whole number"),
    row("--node-rank 5 of 2 nodes", ["launch", "--dry-run", "--node-rank", "5", *MULTI_NODE],
        "--node-rank=5", "0..1"),
    row("--node-rank -1", ["launch", "--dry-run", "--node-rank", "-1"], "--node-rank=-1",
        "at least 0"),
    row("--node-rank 1 of 1 node", ["launch", "--dry-run", "--node-rank", "1"], "--node-rank=1",
        "0..0"),
    row("plan --world-size 0", ["plan", "--world-size", "0"], "--world-size=0", "at least 1"),
    row("plan --world-size abc", ["plan", "--world-size", "abc"], "--world-size", "'abc'",
        "whole number"),
    row("slurm --time bogus", ["slurm", "--time", "bogus", "--nodes", "1", "--dry-run"],
        "--time", "bogus", "time limit"),
    # A limit within the save signal's 120 s lead would preempt and requeue every start at once.
    row("slurm --time 2 (minutes)", ["slurm", "--time", "2", "--nodes", "1", "--dry-run"],
        "--time 2 is 120 s", "--signal=USR2@120", "longer than 3 minutes"),
    row("slurm --time 0-0:3:00 (SLURM may signal 60 s early)",
        ["slurm", "--time", "0-0:3:00", "--nodes", "1", "--dry-run"],
        "--time 0-0:3:00 is 180 s", "up to 60 s earlier"),
    # ... and so would SLURM lowering the limit to --time-min to start the job sooner (was let by)
    row("slurm --sbatch-arg=--time-min=1", ["slurm", "--time", "10", "--sbatch-arg=--time-min=1",
                                           "--nodes", "1", "--dry-run"],
        "SLURM may lower the job's time limit to 60 s", "longer than 3 minutes"),
    row("slurm --sbatch-arg=--time-m=0:2:00", ["slurm", "--sbatch-arg=--time-m=0:2:00",
                                              "--nodes", "1", "--dry-run"],
        "--time-m=0:2:00", "to 120 s"),
    row("slurm --nodes 0", ["slurm", "--nodes", "0", "--dry-run"], "--nodes=0", "at least 1"),
    row("slurm --nodes abc", ["slurm", "--nodes", "abc", "--dry-run"], "--nodes", "'abc'",
        "whole number"),
    row("slurm without --nodes", ["slurm", "--dry-run"], "--nodes", "Missing"),
    row("slurm --gpus-per-node 0", ["slurm", "--nodes", "1", "--gpus-per-node", "0", "--dry-run"],
        "--gpus-per-node=0", "at least 1"),
    row("slurm --partition with a newline",
        ["slurm", "--nodes", "1", "--partition", "gpu\nrm -rf ~", "--dry-run"],
        "--partition", "control character"),
    row("slurm --sbatch-arg with a newline",
        ["slurm", "--nodes", "1", "--sbatch-arg", "--constraint=a\n#SBATCH --x", "--dry-run"],
        "--sbatch-arg", "control character"),
    row("name=../../x", ["launch", "--dry-run", "name=../../x"], "name='../../x'", "plain name"),
    row("name of 129 characters", ["show", "name=" + "a" * 129], "a" * 129, "at most 128"),
    row("name=${oc.env:HOME}", ["show", "name=${oc.env:HOME}"], "name='", "plain name"),
    row("launch --bogus-flag", ["launch", "--bogus-flag"], "--bogus-flag", "No such option"),
    row("--dry-run=3", ["launch", "--dry-run=3"], "--dry-run", "does not take a value"),
    # A flag's missing value took the next flag: `--run-dir --dry-run` trained into ./--dry-run,
    # `slurm --partition --dry-run` submitted the job, `data prepare --out --workers` wrote
    # ./--workers (an unset variable, `--run-dir $DIR --dry-run`, does it)
    row("--run-dir --dry-run", ["launch", "train.max_steps=2", "--run-dir", "--dry-run"],
        "--run-dir takes a value and got none", "--dry-run", "--run-dir=VALUE"),
    row("--rdzv-id --dry-run", ["launch", "--rdzv-id", "--dry-run"], "--rdzv-id", "--dry-run",
        "flag of `partrain launch`"),
    row("slurm --partition --dry-run", ["slurm", "--nodes", "1", "--partition", "--dry-run"],
        "--partition takes a value", "--dry-run", "flag of `partrain slurm`"),
    row("data prepare --out --workers",
        ["data", "prepare", "in.txt", "--out", "--workers", "2"], "--out takes a value",
        "--workers", "flag of `partrain data prepare`"),
    row("--resume=", ["launch", "--resume=", "--dry-run"], "--resume is empty"),
    # An unset variable before an override: `--run-dir $DIR train.max_steps=3` trained the
    # quickstart's 300 steps into ./train.max_steps=3
    row("--run-dir train.max_steps=3", ["launch", "--dry-run", "--run-dir", "train.max_steps=3"],
        "--run-dir takes a path and got none", "train.max_steps=3, is a config override"),
    row("unknown command", ["bogus"], "bogus", "No such command"),
    row("show --help-me", ["show", "--help-me"], "--help-me", "No such option"),
    row("SLURM_NODEID=7 of 2 nodes", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                               SLURM_NODEID="7"),
        "SLURM_NODEID=7", "0..1", absent=("--node-rank",)),
    row("SLURM_NODEID=x", _in_slurm(["launch", "--dry-run", "parallel.dp=4"], SLURM_NODEID="x"),
        "SLURM_NODEID=x", "not a whole number"),
    row("SLURM_JOB_ID=abc", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                      SLURM_JOB_ID="abc"),
        "SLURM_JOB_ID=abc", "not a job number"),
    row("SLURM node list n[1-2", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                           SLURM_JOB_NODELIST="n[1-2"),
        "SLURM_JOB_NODELIST", "n[1-2", "not a SLURM node list"),
    row("SLURM 4 tasks per node", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                            SLURM_NTASKS_PER_NODE="4"),
        "4 tasks", "double launch"),
    row("SLURM node list does not resolve",
        _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                  SLURM_JOB_NODELIST=f"a.{UNRESOLVABLE},b.{UNRESOLVABLE}"),
        "SLURM_JOB_NODELIST", UNRESOLVABLE, "does not resolve"),
    row("under torchrun", lambda c: c.setenv(TORCHELASTIC_RUN_ID="5", LOCAL_RANK="0") or
        ["launch", "--dry-run"], "TORCHELASTIC_RUN_ID=5", "torchrun"),
]

def _symlink(c: Ctx, name: str, target: str) -> str:
    os.symlink(target, c.root / name)
    return c.path(name)


def _run_dir_with_fifo_config(c: Ctx) -> str:
    c.dir("run")
    c.fifo("run/config.yaml")
    return c.path("run")


# Found by a second, reviewing pass over the first table's fixes.
ROWS_SECOND_PASS = [
    row("CONFIG path too long", ["show", "c" * 300 + ".yaml"], "c" * 40, "too long"),
    row("CONFIG bare name too long", ["show", "c" * 300], "c" * 40, "too long"),
    row("data.path too long", ["launch", "--dry-run", "data=tokens", "data.path=/" + "a" * 5000],
        "a" * 40, "too long"),
    row("prepare input too long", lambda c: ["data", "prepare", "c" * 300, "--out", c.path("o")],
        "c" * 40, "too long"),
    row("escaped interpolation name=\\${x}", ["show", "name=\\${x}"], "name=${x}", "interpolation"),
    row("yaml defaults without config", lambda c: ["show", c.file("nc.yaml", "defaults: [_self_]\n")],
        "nc.yaml", "defaults", "config"),
    row("yaml defaults empty", lambda c: ["show", c.file("ne.yaml", "defaults: []\n")],
        "ne.yaml", "defaults", "config"),
    row("yaml _self_ before config",
        lambda c: ["show", c.file("sf.yaml", "defaults: [_self_, config]\nname: x\n")],
        "sf.yaml", "_self_", "config"),
    row("yaml defaults option is a list",
        lambda c: ["show", c.file("ol.yaml", "defaults:\n  - config\n  - override model: "
                                             "[tiny, llama-1b]\n  - _self_\n")],
        "ol.yaml", "override model", "one name"),
    row("yaml defaults option is null",
        lambda c: ["show", c.file("on.yaml", "defaults:\n  - config\n  - override model: null\n"
                                             "  - _self_\n")],
        "on.yaml", "override model: null", "one name"),
    row("pp_layers nested lists", ["show", "parallel.pp=2", "parallel.pp_layers=[[1],[2]]"],
        "parallel.pp_layers=[[1], [2]]", "whole block counts"),
    row("run dir is a symlink loop", lambda c: ["launch", "--dry-run", "--run-dir",
                                                _symlink(c, "loop", "loop")],
        "--run-dir", "loop", "symbolic link"),
    row("run dir is a dangling symlink", lambda c: ["launch", "--dry-run", "--run-dir",
                                                    _symlink(c, "dangle", "nowhere/run")],
        "--run-dir", "dangle", "symbolic link"),
    row("run dir whose config.yaml is a FIFO",
        lambda c: ["launch", "--dry-run", "--run-dir", _run_dir_with_fifo_config(c)],
        "--run-dir", "not empty"),
    row("SLURM_JOB_ID of 5000 digits", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                                  SLURM_JOB_ID="9" * 5000),
        "SLURM_JOB_ID", "job number"),
    row("SLURM_JOB_ID with a path", _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                                               SLURM_JOB_ID="1/../../etc"),
        "SLURM_JOB_ID", "1/../../etc", "job number"),
    row("SLURM node list whose ranges multiply",
        _in_slurm(["launch", "--dry-run", "parallel.dp=4"],
                  SLURM_JOB_NODELIST="r[1-100000]n[1-100000]"),
        "SLURM_JOB_NODELIST", "more than"),
    row("SLURM_NNODES=0", _in_slurm(["launch", "--dry-run", "parallel.dp=4"], SLURM_NNODES="0"),
        "SLURM_NNODES=0", "at least 1"),
    row("SLURM node list of 10**8 nodes",
        _in_slurm(["launch", "--dry-run", "parallel.dp=4"], SLURM_JOB_NODELIST="n[1-99999999]"),
        "SLURM_JOB_NODELIST", "more than"),
    row("!!binary under parallel.deepspeed",
        lambda c: ["show", c.recipe("bin.yaml", "parallel:\n  zero_stage: 1\n  deepspeed:\n"
                                                "    x: !!binary aGVsbG8=\n")],
        "bin.yaml", "bytes", "quote"),
    row("a date as the name", lambda c: ["show", c.recipe("date.yaml", "name: 2024-01-01\n")],
        "date.yaml", "date", "quote"),
    row("n_heads a huge prime, tp=3", ["show", "model.n_heads=2305843009213693951",
                                       "model.n_kv_heads=2305843009213693951",
                                       "model.dim=4611686018427387902", "parallel.tp=3"],
        "parallel.tp=3", "model.n_heads=2305843009213693951"),
    row("pp of 4096 stages", ["plan", "parallel.pp=4096", "model.n_layers=4096",
                              "--world-size", "8192"],
        "pp(4096)", "exceeds"),
    row("+model=tiny adds a group twice", ["show", "+model=tiny"], "+model=tiny", "model=tiny"),
    row("model@foo=tiny", ["show", "model@foo=tiny"], "model@foo=tiny", "GROUP=OPTION"),
    row("--sbatch-arg contradicts --nodes",
        lambda c: ["slurm", "--nodes", "1", "--sbatch-arg=--nodes=3", "--dry-run",
                   "--run-dir", c.path("run")], "--nodes=3", "contradicts"),
    row("--sbatch-arg=-", lambda c: ["slurm", "--nodes", "1", "--sbatch-arg=-", "--dry-run",
                                     "--run-dir", c.path("run")], "--sbatch-arg", "'-'"),
    row("--partition ''", lambda c: ["slurm", "--nodes", "1", "--partition", "", "--dry-run",
                                     "--run-dir", c.path("run")], "--partition=''", "empty"),
    row("--ifname ''", ["launch", "--dry-run", *MULTI_NODE, "--ifname", ""], "--ifname ''",
        "empty"),
    row("--rdzv-endpoint [::1:29500", ["launch", "--dry-run", "--nnodes", "2", "--rdzv-endpoint",
                                       "[::1:29500", "parallel.dp=4"],
        "--rdzv-endpoint", "[::1:29500", "HOST:PORT"),
    row("plan --world-size names itself", ["plan", "--world-size", "4"],
        "--world-size=4", "!= world size 4"),
]

TABLE = [*ROWS_RUN_DIRS, *ROWS_NETWORK, *ROWS_MARKUP, *ROWS_FLAGS, *ROWS_SECOND_PASS]


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


def test_table_is_big_enough():
    assert len(TABLE) >= 45


# ------------------------------------------------------------------------------------------------
# Allowed by design (controls: the table's refusals are not refusals of everything)


def test_dry_run_into_an_empty_run_dir_writes_nothing(run_main, tmp_path):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    result = run_main("launch", "--dry-run", "--run-dir", str(run_dir))
    assert result.code == 0, result.stderr
    assert list(run_dir.iterdir()) == []

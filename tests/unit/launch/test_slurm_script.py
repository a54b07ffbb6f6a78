"""The sbatch script of `partrain slurm`: rendered against a stored expected file, hostile values
and the launcher's exit codes (3: requeue) run through bash with stub `srun`/`scontrol` (stubs,
because these tests need no cluster; the real daemons run in tests/integration/test_slurm*.py),
the setup lines (launcher.setup, --setup) run in the task srun starts on each node, before
partrain, and the first that fails stops it there; --cpus-per-task asked for again by srun; and
the CLI around it: --dry-run, sbatch missing or refusing the job (exit 2 with sbatch's own
message, nothing left behind). `slurm --resume` is test_slurm_resume.py's."""

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from partrain.errors import ConfigError
from partrain.launch.cluster import slurm_port
from partrain.launch.sbatch_checks import SlurmJob
from partrain.launch.slurm import NODE_PROGRAM, render_script, write_script

EXPECTED = Path(__file__).parent / "expected" / "llama-2x8.sbatch"

FULL_JOB = SlurmJob(
    run_dir=Path("/shared/runs/llama-7b-tp4-pp2"), job_name="llama-7b-tp4-pp2", nodes=2,
    nproc_per_node=8, partrain=("/opt/venv/bin/partrain",), gpus_per_node=8, partition="gpu",
    time="04:00:00", account="proj-42", qos="high", cpus_per_task=96, mem="0", exclusive=True,
    sbatch_args=("--constraint=h100",),
    env=(("NCCL_DEBUG", "WARN"), ("NCCL_IB_HCA", "mlx5_0,mlx5_1")),
    setup=("module load cuda/12.4", "source /shared/venvs/train/bin/activate"))


def test_rendered_script_matches_the_stored_file():
    # To update after a deliberate change: python -c "from tests.unit.launch.test_slurm_script import *;
    # EXPECTED.write_text(render_script(FULL_JOB))", then read the diff.
    assert render_script(FULL_JOB) == EXPECTED.read_text()


def test_script_has_what_the_issue_asks():
    script = render_script(FULL_JOB)
    for line in ("#SBATCH --ntasks-per-node=1", "#SBATCH --signal=USR2@120", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "#SBATCH --cpus-per-task=96", "#SBATCH --mem=0",
                 "#SBATCH --exclusive\n", "#SBATCH --constraint=h100",
                 "--ntasks-per-node=1 --cpus-per-task=96 --export=ALL",
                 "    'module load cuda/12.4'\n",
                 "#SBATCH --output=/shared/runs/llama-7b-tp4-pp2/logs/slurm-%j.out",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST"', "srun --kill-on-bad-exit=0",
                 "/opt/venv/bin/partrain launch /shared/runs/llama-7b-tp4-pp2/config.yaml",
                 'scontrol requeue "$SLURM_JOB_ID"', "trap : USR2"):
        assert line in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def _stubs(bin_dir: Path, record: Path) -> None:
    """srun records its arguments (NUL-separated) and one passed-through variable, then runs
    $SRUN_DOES (default: nothing, exit 0); scontrol answers like a two-node job on n1, n2 with n1
    at 10.0.0.5, and records a requeue and answers it with $REQUEUE_EXIT (default 0)."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\nprintf "%s\\0" "$@" > {record}\nprintf "%s" "$NCCL_DEBUG" > {record}.env\n'
        'eval "${SRUN_DOES:-exit 0}"\n')
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$1" = requeue ]; then echo "$2" >> {record}.requeue; '
        'exit "${REQUEUE_EXIT:-0}"; fi\n'
        'if [ "$2" = hostnames ]; then echo n1; echo n2; '
        'else echo "NodeName=$4 Arch=x86_64 NodeAddr=10.0.0.5 NodeHostName=$4"; fi\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)


def _run_script(tmp_path: Path, job: SlurmJob, **env: str) -> subprocess.CompletedProcess:
    """The job's script under bash as the batch step runs it, with the stubs first on PATH."""
    script = write_script(job)
    _stubs(tmp_path / "bin", tmp_path / "srun-args")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "n[1-2]", **env}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=30)


HOSTILE = "x'; touch {canary}; '"


def test_hostile_values_stay_literal(tmp_path):
    canary = tmp_path / "pwned"
    hostile = HOSTILE.format(canary=canary)
    run_dir = tmp_path / f"run $(touch {canary}) `touch {canary}` {hostile}"
    run_dir.mkdir(parents=True)
    job = SlurmJob(run_dir=run_dir, job_name=hostile, nodes=2, nproc_per_node=2,
                   partrain=(str(tmp_path / "bin" / "partrain"),), partition=f"$(touch {canary})",
                   account=hostile, sbatch_args=(f"--comment={hostile}",),
                   env=(("NCCL_DEBUG", hostile),), setup=(hostile, f"echo $(touch {canary})"))
    result = _run_script(tmp_path, job)
    assert result.returncode == 0, result.stderr
    record = tmp_path / "srun-args"
    argv = record.read_text().split("\0")[:-1]
    assert argv == ["--kill-on-bad-exit=0", "--wait=60", "--nodes=2", "--ntasks-per-node=1",
                    "--export=ALL", "bash", "-c", NODE_PROGRAM, "partrain-setup", "2", hostile,
                    f"echo $(touch {canary})",  # to run on the nodes, not in the batch shell
                    str(tmp_path / "bin" / "partrain"), "launch", str(run_dir / "config.yaml"),
                    "--run-dir", str(run_dir), "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-endpoint", f"10.0.0.5:{slurm_port('1234')}"]
    assert Path(f"{record}.env").read_text() == hostile
    assert not canary.exists()


PLAIN_JOB = SlurmJob(run_dir=Path("/unused"), job_name="run", nodes=2, nproc_per_node=2,
                     partrain=("partrain",))


@pytest.mark.parametrize("srun_exit, requeue_exit, script_exit, requeued", [
    (0, 0, 0, False),  # trained to the end
    (1, 0, 1, False),  # a rank failed: the job fails with the launcher's code, no requeue
    (130, 0, 130, False),
    (3, 0, 0, True),  # saved on a preemption signal: requeued (SLURM then ends the script)
    (3, 1, 3, True),  # the requeue refused (e.g. --no-requeue by the site): the job fails with 3
])
def test_exit_3_requeues_the_job_and_other_codes_pass_through(
        tmp_path, srun_exit, requeue_exit, script_exit, requeued):
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run")
    job.run_dir.mkdir()
    result = _run_script(tmp_path, job, SRUN_DOES=f"exit {srun_exit}",
                         REQUEUE_EXIT=str(requeue_exit))
    assert result.returncode == script_exit, result.stderr
    requeue = tmp_path / "srun-args.requeue"
    assert (requeue.read_text() if requeue.exists() else "") == ("1234\n" if requeued else "")


def test_batch_shell_survives_usr2_and_still_requeues(tmp_path):
    # `scancel --full --signal=USR2` or `--signal=B:USR2` also signal the batch shell, while
    # srun runs: bash's default would be to die of it (exit -12) and never requeue.
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run")
    job.run_dir.mkdir()
    result = _run_script(tmp_path, job, SRUN_DOES='kill -USR2 "$PPID"; sleep 0.2; exit 3')
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert (tmp_path / "srun-args.requeue").read_text() == "1234\n"


def test_srun_inherits_usr2_as_not_ignored(tmp_path):
    # `trap '' USR2` would pass SIG_IGN on to srun and, through it, to the launchers and ranks.
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run")
    job.run_dir.mkdir()
    # SigIgn of srun's own process: the bit of signal 12 must be clear.
    result = _run_script(tmp_path, job, SRUN_DOES=(
        f'grep SigIgn /proc/$$/status > {tmp_path}/sigign; exit 0'))
    assert result.returncode == 0, result.stderr
    mask = int((tmp_path / "sigign").read_text().split()[1], 16)
    assert not mask >> (12 - 1) & 1


# srun's stand-in that runs the task as a node would: its options dropped, the rest executed.
RUN_THE_TASK = 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"'


def _fake_partrain(tmp_path: Path, log: Path) -> tuple[str]:
    """A `partrain` that appends what it got (a variable a setup line exports, its arguments)."""
    fake = tmp_path / "fake-partrain"
    fake.write_text(f'#!/bin/bash\necho "partrain FROM_SETUP=${{FROM_SETUP:-unset}} $1" >> {log}\n')
    fake.chmod(0o755)
    return (str(fake),)


def test_setup_lines_run_in_the_nodes_task_in_order_before_partrain(tmp_path):
    log = tmp_path / "order"
    lines = (f"echo one >> {log}", "export FROM_SETUP=yes",
             f"""echo "it's $((1 + 1)) `echo x`" >> {log}""")
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run",
                              partrain=_fake_partrain(tmp_path, log), setup=lines)
    job.run_dir.mkdir()
    result = _run_script(tmp_path, job, SRUN_DOES=RUN_THE_TASK, SLURMD_NODENAME="n1")
    assert result.returncode == 0, result.stderr
    # Each line ran once, as written, and what it exported reached partrain, which ran last.
    assert log.read_text() == "one\nit's 2 x\npartrain FROM_SETUP=yes launch\n"


def test_setup_lines_do_not_run_on_the_batch_host(tmp_path):
    marker = tmp_path / "ran"
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run", setup=(f"touch {marker}",))
    job.run_dir.mkdir()
    result = _run_script(tmp_path, job)  # srun does nothing: no task runs
    assert result.returncode == 0, result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("failing, code", [("false", 1), ("exit 7", 7), ("exit 0", 1),
                                           ("f() { false; echo past; }; f", 1),
                                           ('echo "unclosed', 2), ("false; true", 1)])
def test_a_failing_setup_line_stops_the_node_and_names_the_line(tmp_path, failing, code):
    log = tmp_path / "order"
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run",
                              partrain=_fake_partrain(tmp_path, log),
                              setup=(f"echo one >> {log}", failing, f"echo three >> {log}"))
    job.run_dir.mkdir()
    result = _run_script(tmp_path, job, SRUN_DOES=RUN_THE_TASK, SLURMD_NODENAME="n1")
    assert result.returncode == code, result.stderr  # the job fails with the line's code
    said = [line for line in result.stderr.splitlines() if line.startswith("partrain:")]
    shown = {"exit 0": 0}.get(failing, code)
    assert said == [f"partrain: setup line 2 of 3 failed on node n1 (exit {shown}); partrain not "
                    f"started there: {failing}"], result.stderr
    assert log.read_text() == "one\n"  # neither the next line nor partrain ran


@pytest.mark.parametrize("cpus, srun_has", [(8, ["--cpus-per-task=8"]), (None, [])])
def test_srun_asks_for_the_cpus_per_task_again(tmp_path, cpus, srun_has):
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run", cpus_per_task=cpus)
    job.run_dir.mkdir()
    result = _run_script(tmp_path, job)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "srun-args").read_text().split("\0")
    assert [a for a in argv if a.startswith("--cpus-per-task")] == srun_has
    assert ("#SBATCH --cpus-per-task=8\n" in render_script(job)) == bool(cpus)


@pytest.mark.parametrize("mem", ["0", "500", "500M", "500m", "64G", "64GB", "64gb", "2T", "512k"])
def test_memory_sizes_sbatch_takes_are_written(mem):
    # What sbatch 22.05 takes (tried against the real one): a suffix in either case, a B after it.
    assert f"#SBATCH --mem={mem}\n" in render_script(dataclasses.replace(PLAIN_JOB, mem=mem))


def test_sbatch_lines_quote_for_sbatchs_parser():
    job = SlurmJob(run_dir=Path("/r/100%"), job_name='a "b" \\c', nodes=1, nproc_per_node=1,
                   partrain=("partrain",))
    script = render_script(job)
    assert '#SBATCH --job-name="a \\"b\\" \\\\c"' in script
    assert "#SBATCH --output=/r/100%%/logs/slurm-%j.out" in script  # % is sbatch's pattern sign


@pytest.mark.parametrize("field, value, fragment", [
    ("job_name", "a\nsrun rm -rf /", "name='a\\nsrun rm -rf /' contains a control character"),
    ("partition", "gpu\r", "--partition='gpu\\r' contains a control character"),
    ("sbatch_args", ("exclusive",), "--sbatch-arg 'exclusive' must be an sbatch option"),
    ("sbatch_args", ("--no-requeue",), "the job requeues itself after a save on a preemption"),
    ("sbatch_args", ("--open-mode=truncate",), "a requeued job appends to its log"),
    ("mem", "64GiB", "--mem '64GiB' is not a SLURM memory size"),
    ("mem", "1.5G", "--mem '1.5G' is not a SLURM memory size"),
    ("mem", "-1", "--mem '-1' is not a SLURM memory size"),
    ("mem", "", "--mem '' is not a SLURM memory size"),
    ("mem", "1" * 13, "at most 12 digits"),
    ("mem", "64G\n", "--mem='64G\\n' contains a control character"),
    ("cpus_per_task", 0, "--cpus-per-task=0 must be between 1 and 65534"),
    ("cpus_per_task", 65535, "--cpus-per-task=65535 must be between 1 and 65534"),
    ("setup", ("echo a\nrm -rf ~",), "--setup='echo a\\nrm -rf ~' contains a control character"),
    ("setup", ("  ",), "--setup '  ' is empty: give a shell line"),
    ("sbatch_args", ("--exclusive=user",), "'--exclusive=user' and --exclusive ask for two ways"),
    ("sbatch_args", ("--mem-per-gpu=10G",), "sbatch takes one of --mem, --mem-per-gpu"),
    ("sbatch_args", ("--mem-per=10G",), "takes one of --mem, --mem-per-cpu, --mem-per-gpu"),
    ("sbatch_args", ("--cpus-per-gpu=4",), "sbatch takes one of --cpus-per-task, --cpus-per-gpu"),
])
def test_values_no_quoting_makes_safe_are_refused(field, value, fragment):
    job = dataclasses.replace(FULL_JOB, **{field: value})
    with pytest.raises(ConfigError) as info:
        render_script(job)
    assert fragment in str(info.value)


SLURM_ARGS = ("slurm", "parallel.dp=auto", "--nodes", "2", "--nproc-per-node", "2")


def test_dry_run_prints_the_script_it_wrote(run_main, tmp_path):
    # The command it says to paste quotes the path: `$(...)` in a run dir's name ran there.
    run_dir = tmp_path / "run $(touch pwned)"
    result = run_main(*SLURM_ARGS, "--partition", "cpu", "--run-dir", str(run_dir), "--dry-run")
    assert result.code == 0, result.stderr
    assert result.stdout == (run_dir / "job.sbatch").read_text()
    assert result.stdout.startswith("#!/bin/bash\n")
    assert "#SBATCH --partition=cpu" in result.stdout and "--nproc-per-node 2" in result.stdout
    assert "nothing submitted" in result.stderr
    assert f"(submit with: sbatch '{run_dir / 'job.sbatch'}')" in " ".join(result.stderr.split())
    assert "nnodes: 2" in (run_dir / "config.yaml").read_text()


def test_submission_prints_job_id_and_logs(run_main, tmp_path, sbatch_stub):
    sbatch_stub(f'echo "$@" > {tmp_path}/sbatch-args; echo "4242;cluster"')
    run_dir = tmp_path / "run"
    result = run_main(*SLURM_ARGS, "--run-dir", str(run_dir))
    assert result.code == 0, result.stderr
    assert f"submitted job 4242: 2 node(s) x 2 rank(s); run dir {run_dir}" in result.stdout
    assert f"{run_dir}/logs/slurm-4242.out" in result.stdout
    assert (tmp_path / "sbatch-args").read_text().split() == ["--parsable", str(run_dir / "job.sbatch")]


def test_sbatch_refusing_exits_2_with_its_message_and_takes_back_the_run_dir(
        run_main, tmp_path, sbatch_stub):
    sbatch_stub('echo "sbatch: error: invalid partition specified: nope" >&2; exit 1')
    # The parents made for it go too (new/a was left behind); tmp_path, there before, stays.
    run_dir = tmp_path / "new" / "a" / "run"
    result = run_main(*SLURM_ARGS, "--partition", "nope", "--run-dir", str(run_dir))
    assert result.code == 2
    assert "sbatch refused the job (exit 1): sbatch: error: invalid partition specified: nope" \
        in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()


def test_sbatch_missing_exits_2(run_main, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    run_dir = tmp_path / "run"
    result = run_main(*SLURM_ARGS, "--run-dir", str(run_dir))
    assert result.code == 2 and "sbatch not found on PATH" in result.stderr
    assert "--dry-run" in result.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("args, fragment", [
    (("slurm", "--nodes", "0"), "--nodes=0 must be at least 1"),
    (("slurm", "--nodes", "2", "--gpus-per-node", "4"),
     "pp(1) * dp(2) * tp(1) = 2 != world size 8 (nnodes 2 * nproc_per_node 4"),
    (("slurm", *SLURM_ARGS[1:], "--sbatch-arg", "exclusive"), "must be an sbatch option"),
])
def test_bad_slurm_flags_exit_2_and_write_nothing(run_main, tmp_path, args, fragment):
    result = run_main(*args, "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert result.code == 2 and fragment in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_one_node_job_takes_a_free_port(tmp_path):
    """A fixed port (29500 + job id % 1000) could be another job's on a shared node: one node
    needs no endpoint, and `partrain launch` takes a free port on 127.0.0.1."""
    job = dataclasses.replace(PLAIN_JOB, run_dir=tmp_path / "run", nodes=1)
    job.run_dir.mkdir()
    assert _run_script(tmp_path, job).returncode == 0
    argv = (tmp_path / "srun-args").read_text().split("\0")[:-1]
    assert argv[-4:] == ["--nnodes", "1", "--nproc-per-node", "2"]
    assert "rdzv" not in write_script(job).read_text()


def test_the_nodes_run_the_partrain_this_process_imported(monkeypatch, tmp_path):
    """Imported from the working directory (`python -m partrain` in a checkout), the nodes run
    `python -m partrain` in it too (the job starts where it was submitted): the console script
    imports the installed package, which may be another, older one beside the checkout."""
    import sys

    import partrain
    from partrain.launch.slurm import partrain_command

    checkout = Path(partrain.__file__).resolve().parent.parent
    monkeypatch.chdir(checkout)
    assert partrain_command() == (sys.executable, "-m", "partrain")
    monkeypatch.chdir(tmp_path)
    script = Path(sys.executable).parent / "partrain"
    assert partrain_command() == ((str(script),) if script.is_file() else
                                  (sys.executable, "-m", "partrain"))


def test_a_run_dir_of_several_nodes_on_a_local_file_system_is_said(tmp_path):
    """Each node of a job writes its own run dir on a local disk: said at submission (the
    start found out only after the job waited in the queue)."""
    from partrain.launch.rundir import file_system_of, node_local_warning

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/shared /shared nfs4 rw 0 0\n"
                      "tmpfs /shared/tmp\\040dir tmpfs rw 0 0\n")
    assert file_system_of(Path("/shared/runs/a"), str(mounts)) == ("nfs4", "/shared")
    assert file_system_of(Path("/shared/tmp dir/x"), str(mounts)) == ("tmpfs", "/shared/tmp dir")
    assert file_system_of(Path("/home/u/runs"), str(mounts)) == ("ext4", "/")
    # This machine's own table: the warning names the kind and the mount point, for 2 nodes
    found = file_system_of(tmp_path)
    said = node_local_warning(tmp_path / "run", 2)
    assert (said is None) == (found is None or found[0] not in ("tmpfs", "ext4", "xfs",
                                                                "overlay", "btrfs"))
    if said:
        assert f"is on {found[0]} (mounted at {found[1]})" in said and "2 nodes" in said
    assert node_local_warning(tmp_path / "run", 1) is None

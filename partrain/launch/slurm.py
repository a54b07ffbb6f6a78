"""`partrain slurm`: the sbatch script for a run dir, and its submission.

The script asks for N nodes with one task each; `srun` starts `partrain launch` on the frozen
config.yaml once per node, and each launcher starts that node's workers under the elastic agent
(c10d rendezvous on the head node, port from the job id). One task per GPU would be a double
launch (see cluster.py).

Preemption: SLURM sends SIGUSR2 to the launchers 120 s before the time limit (`--signal`), and a
site does the same to preempt (`scancel --signal=USR2`); the ranks save at one step and the
launchers exit 3. The script then requeues the job (`scontrol requeue`; SLURM ends the script
itself), and the requeued job runs this same script: `partrain launch` on a run dir holding a
checkpoint of this config resumes from it. The job's log is appended to, not truncated, so it
tells both runs. srun must not kill the other nodes when one exits non-zero
(`--kill-on-bad-exit=0`): exit 3 is no failure, and a node killed while it ends would turn srun's
exit code into 130 or 137. `--wait` bounds how long a node may hang once another has ended.

CPUs: with --cpus-per-task N the job asks N CPUs per node (its one task), and srun asks them
again: since SLURM 22.05 a step no longer inherits sbatch's --cpus-per-task, and a step asked
for one CPU per task is bound to one core. Without it the script asks for none, and srun's step
gets every CPU the job holds on each node (srun's default without --exact); either way each
`partrain launch` shares out the cores its task may run on among its ranks (cluster.py's
usable_cores: the affinity, and no more than the step's SLURM_CPUS_ON_NODE and
SLURM_CPUS_PER_TASK).

Setup (launcher.setup, then --setup): shell lines that must run on every node, in the task srun
starts there, so that a `module load` or an activated environment reaches partrain. srun runs
NODE_PROGRAM under bash with the lines as arguments: each is eval'd in order under `set -e`, and
the first that fails ends the task with its code and a line in the job log that names it;
partrain is exec'd only after the last.

Every value that comes from the user is checked before the script is written (sbatch_checks.py)
and quoted: shlex.quote in the shell body, and sbatch's own quoting in `#SBATCH` lines, which
sbatch parses itself (it takes backslash as an escape even inside quotes, so shlex.quote is not
right there).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from partrain.errors import ConfigError
from partrain.launch.cluster import SLURM_BASE_PORT, SLURM_PORT_SPAN
from partrain.launch.sbatch_checks import (
    SCRIPT,
    SIGNAL_BEFORE_END_S,
    SlurmJob,
    check_job,
)

PASSED_THROUGH = ("NCCL_", "TORCH_NCCL_", "GLOO_")  # network settings the workers need as set here
# Once one node's launcher has ended, srun stops the others after this many seconds (`--wait`):
# after a run, a save or a failure they end within seconds of each other, unless one hangs.
NODES_END_WITHIN_S = 60
EXIT_PREEMPTED = 3  # `partrain launch`: saved at a step on a preemption signal (launch/local.py)


def partrain_command() -> tuple[str, ...]:
    """This install of partrain, so that the nodes run the same code as the submitting shell:
    its console script, except where this process imported partrain from the working
    directory (`python -m partrain` in a checkout): the console script imports the installed
    package, which may be another (an older `pip install` beside the checkout). The job runs
    in the directory it was submitted from, where `python -m partrain` finds the same one."""
    import partrain

    script = Path(sys.executable).parent / "partrain"
    from_cwd = Path(partrain.__file__).resolve().parent.parent == Path.cwd().resolve()
    return (str(script),) if script.is_file() and not from_cwd else (sys.executable, "-m",
                                                                       "partrain")


def passed_through_env(env=os.environ) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(PASSED_THROUGH)))


def _sbatch_quote(value: str) -> str:
    """Quoting for `#SBATCH` lines as sbatch reads them: double quotes, backslash escapes."""
    if re.fullmatch(r"[A-Za-z0-9_.,:=/@%+-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_script(job: SlurmJob) -> str:
    """The sbatch script, exactly as submitted (and as `--dry-run` prints it)."""
    check_job(job)
    run_dir, q = job.run_dir, shlex.quote
    log_pattern = str(run_dir / "logs").replace("%", "%%") + "/slurm-%j.out"
    cpus = job.cpus_per_task and str(job.cpus_per_task)
    options = [("job-name", job.job_name), ("nodes", str(job.nodes)), ("ntasks-per-node", "1"),
               ("cpus-per-task", cpus),
               ("gpus-per-node", job.gpus_per_node and str(job.gpus_per_node)),
               ("mem", job.mem), ("partition", job.partition), ("time", job.time),
               ("account", job.account), ("qos", job.qos), ("output", log_pattern),
               ("signal", f"USR2@{SIGNAL_BEFORE_END_S}")]
    lines = ["#!/bin/bash",
             f"# Written by `partrain slurm`: {job.nodes} node(s) x {job.nproc_per_node} rank(s) "
             f"= {job.nodes * job.nproc_per_node} ranks.",
             f"# Run dir {q(str(run_dir))}; submit again with: sbatch {q(str(run_dir / SCRIPT))}"]
    lines += [f"#SBATCH --{key}={_sbatch_quote(value)}" for key, value in options if value]
    lines += ["#SBATCH --exclusive"] * job.exclusive
    lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    lines += [f"#SBATCH {_sbatch_quote(arg)}" for arg in job.sbatch_args]
    lines += ["", "set -euo pipefail",
              "# USR2 is for the ranks; if a site signals this shell too, bash would die of it.",
              "# A trap, not `trap '' USR2`: an ignored signal stays ignored in srun and below.",
              "trap : USR2", ""]
    if job.env:
        lines += ["# NCCL and gloo settings of the shell that ran `partrain slurm`"]
        lines += [f"export {name}={q(value)}" for name, value in job.env] + [""]
    if job.nodes > 1:
        lines += [
            "# Node 0 hosts the rendezvous; the port follows from the job id as in `partrain "
            "launch`.",
            # sed reads to the end: `head -n 1` would close the pipe early, and under pipefail
            # scontrol's SIGPIPE (a long node list, or just timing) would end the script with
            # 141.
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
            'head_addr=$(scontrol show node -o "$head_node" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
            f"rdzv_port=$(({SLURM_BASE_PORT} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))",
            ""]
    else:  # a fixed port could be another job's on a shared node (ids 1000 apart)
        lines += ["# One node: the rendezvous takes a free port on 127.0.0.1.", ""]
    endpoint = (' --rdzv-endpoint "${head_addr:-$head_node}:$rdzv_port"' if job.nodes > 1
                else "")
    lines += [
        *_setup_lines(job.setup),
        "# One task per node: each `partrain launch` starts its node's ranks itself. No kill on a",
        "# non-zero exit: after a save the nodes exit 3 a moment apart, and a node killed as it ends",
        "# would make srun's code 130 or 137, not 3. --wait still stops a node that hangs.",
        *(["# srun asks for the CPUs again: a step does not inherit sbatch's --cpus-per-task."]
          if cpus else []),
        "code=0",
        f"srun --kill-on-bad-exit=0 --wait={NODES_END_WITHIN_S} --nodes={job.nodes} "
        f"--ntasks-per-node=1{f' --cpus-per-task={cpus}' if cpus else ''} --export=ALL \\",
        *(['    bash -c "$on_each_node" partrain-setup "${#setup[@]}" "${setup[@]}" \\']
          if job.setup else []),
        f"    {' '.join(q(part) for part in job.partrain)} launch "
        f"{q(str(run_dir / 'config.yaml'))} --run-dir {q(str(run_dir))} \\",
        f"    --nnodes {job.nodes} --nproc-per-node {job.nproc_per_node}{endpoint} || code=$?",
        "",
        "# Saved on a preemption signal: the requeued job runs this script again and resumes from",
        "# the checkpoint. SLURM ends this script as it requeues; if it cannot, the job fails with 3.",
        f'if [ "$code" -eq {EXIT_PREEMPTED} ] && scontrol requeue "$SLURM_JOB_ID"; then',
        "    exit 0",
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


# What srun runs on each node before partrain when there are setup lines: its arguments are their
# count, the lines, then the `partrain launch` command. Each line is eval'd in this shell (what it
# exports or activates reaches partrain) under `set -e`; the EXIT trap names the line that ended
# the shell, which exits non-zero even on a line's `exit 0`, and partrain is never started there.
# Written with no single quote: the script holds it in one.
NODE_PROGRAM = """\
set -e
partrain_setup=("${@:2:$1}") partrain_launch=("${@:$1+2}") partrain_at=0
partrain_failed() {
    local code=$?
    echo "partrain: setup line $partrain_at of ${#partrain_setup[@]} failed on node" \\
        "${SLURMD_NODENAME:-$HOSTNAME} (exit $code); partrain not started there:" \\
        "${partrain_setup[partrain_at-1]}" >&2
    exit $((code ? code : 1))
}
trap partrain_failed EXIT
for partrain_line in "${partrain_setup[@]}"; do
    partrain_at=$((partrain_at + 1))
    eval "$partrain_line"
done
trap - EXIT
exec "${partrain_launch[@]}"
"""


def _setup_lines(setup: tuple[str, ...]) -> list[str]:
    """The script's setup part: the lines as a bash array (each quoted), and NODE_PROGRAM."""
    if not setup:
        return []
    return ["# launcher.setup, then --setup: run on every node before partrain, in the task srun",
            "# starts there (on_each_node), each under set -e; the first that fails ends that",
            "# node's task with its code and names the line in this log; partrain does not start.",
            "setup=(", *(f"    {shlex.quote(line)}" for line in setup), ")",
            f"on_each_node={shlex.quote(NODE_PROGRAM)}", ""]


def write_script(job: SlurmJob) -> Path:
    path = job.run_dir / SCRIPT
    path.write_text(render_script(job))
    path.chmod(0o755)
    return path


SBATCH_TIMEOUT_S = 120


class SubmissionUnknown(ConfigError):
    """sbatch took too long to answer: the job may be queued all the same, so the script and
    config it was given stay (taken back, a queued job would start on the old pair)."""


def submit(script: Path) -> str:
    """Submit with sbatch and return the job id; sbatch's own message if it is missing or fails."""
    try:
        result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                                text=True, timeout=SBATCH_TIMEOUT_S)
    except FileNotFoundError:
        raise ConfigError("sbatch not found on PATH: `partrain slurm` submits through SLURM's "
                          "sbatch; run it on the cluster's login node, or use --dry-run to "
                          "print the script") from None
    except OSError as e:  # not executable (EACCES), a wrapper without a #! line (ENOEXEC)
        raise ConfigError(f"sbatch could not be run ({e.strerror or e}): `partrain slurm` "
                          "submits through SLURM's sbatch") from None
    except subprocess.TimeoutExpired:
        raise SubmissionUnknown(
            f"sbatch did not answer within {SBATCH_TIMEOUT_S} s, so whether the job was queued "
            f"is unknown (is slurmctld reachable?): see `squeue --me`; {script} is the script "
            "it was given, kept with its config, and `sbatch` of it submits it") from None
    if result.returncode != 0:
        message = (result.stderr.strip() or result.stdout.strip() or "(no message)")
        raise ConfigError(f"sbatch refused the job (exit {result.returncode}): {message}")
    return result.stdout.strip().split(";")[0]


def remove_prepared(run_dir: Path, created: Path | None) -> None:
    """After a failed submission, take back what `partrain slurm` wrote: nothing half-done stays.
    `created`: the nearest directory there before the run dir was made (None: it was there);
    the caller takes back the parents made below it (rundir.remove_made)."""
    if created is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in (SCRIPT, "config.yaml"):
        (run_dir / name).unlink(missing_ok=True)
    if (run_dir / "logs").is_dir() and not any((run_dir / "logs").iterdir()):
        (run_dir / "logs").rmdir()


def job_files(run_dir: Path) -> dict[str, tuple[bytes, int] | None]:
    """The run dir's config and script as they are, with their modes (None: not there), for
    put_back."""
    found = {}
    for name in (SCRIPT, "config.yaml"):
        try:
            found[name] = ((run_dir / name).read_bytes(), (run_dir / name).stat().st_mode)
        except FileNotFoundError:
            found[name] = None
    return found


def put_back(run_dir: Path, files: dict[str, tuple[bytes, int] | None]) -> None:
    """After a failed submission of `slurm --resume`: the run's config and script as they were."""
    for name, kept in files.items():
        if kept is None:
            (run_dir / name).unlink(missing_ok=True)
        else:
            tmp = run_dir / f".{name}.put-back.tmp"
            tmp.write_bytes(kept[0])
            tmp.chmod(kept[1] & 0o7777)
            os.replace(tmp, run_dir / name)


def check_no_job_in(run_dir: Path) -> None:
    """Refuse a resume's submission into a run dir whose script a job of this user still runs
    or waits to run (squeue: pending, running, requeued, suspended): two jobs would train in one
    run dir at once, writing and pruning each other's checkpoints. Where squeue is missing or
    fails (no SLURM here: --dry-run on a laptop), nothing is checked."""
    script = (run_dir / SCRIPT).resolve()
    try:  # by uid: $USER may name someone else (squeue -u of an unknown user lists nothing)
        result = subprocess.run(["squeue", "-h", "-u", str(os.getuid()), "-o", "%i|%T|%Z|%o"],
                                capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return
    if result.returncode != 0:
        return
    for line in result.stdout.splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) != 4 or "\0" in line:
            continue
        job_id, state, workdir, command = parts
        # The script, or the script and its arguments (`sbatch job.sbatch x`).
        if any((Path(workdir) / path).resolve() == script
               for path in (command, command.split(" ", 1)[0])):
            raise ConfigError(
                f"--resume {run_dir}: job {job_id} ({state}) runs its script {script}; two jobs "
                f"would train in one run dir at once. Wait for it to end, or end it (scancel "
                f"{job_id}), and submit again")


# The #SBATCH options a resume on another allocation changes on purpose, or partrain derives.
RESIZED = ("--nodes=", "--gpus-per-node=", "--output=", "--job-name=")


def dropped_settings(old_script: bytes, new_script: str) -> list[str]:
    """What the run dir's earlier script asked of sbatch or ran on every node that the new one
    does not (`slurm --resume` takes its flags anew: --partition, --time, --setup, ...)."""
    def asked(text: str) -> list[str]:
        lines, setup = text.splitlines(), []
        if "setup=(" in lines and ")" in lines:  # the setup lines' bash array (_setup_lines)
            start = lines.index("setup=(") + 1
            setup = [f"--setup {line.strip()}" for line in lines[start:lines.index(")", start)]]
        return [line[len("#SBATCH "):] for line in lines if line.startswith("#SBATCH ")
                and not line[len("#SBATCH "):].startswith(RESIZED)] + setup
    new = set(asked(new_script))
    return [item for item in asked(old_script.decode("utf-8", "replace")) if item not in new]

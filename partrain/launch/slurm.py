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

Every value that comes from the user (run name, paths, partition, extra sbatch arguments, the
NCCL variables passed through) is quoted: shlex.quote in the shell body, and sbatch's own quoting
in `#SBATCH` lines, which sbatch parses itself (it takes backslash as an escape even inside
quotes, so shlex.quote is not right there). Control characters are refused: a newline in an
`#SBATCH` comment would end the comment and run the rest as a command.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from partrain.errors import ConfigError
from partrain.launch.cluster import SLURM_BASE_PORT, SLURM_PORT_SPAN

SCRIPT = "job.sbatch"
PASSED_THROUGH = ("NCCL_", "TORCH_NCCL_", "GLOO_")  # network settings the workers need as set here
SIGNAL_BEFORE_END_S = 120
# Once one node's launcher has ended, srun stops the others after this many seconds (`--wait`):
# after a run, a save or a failure they end within seconds of each other, unless one hangs.
NODES_END_WITHIN_S = 60
EXIT_PREEMPTED = 3  # `partrain launch`: saved at a step on a preemption signal (launch/local.py)
# sbatch options the script sets from partrain's own flags and layout; a raw --sbatch-arg that
# repeats one would contradict it (the last one wins in sbatch, silently).
FIXED_SBATCH_OPTIONS = {
    **dict.fromkeys(("--nodes", "-N"), "use --nodes"),
    **dict.fromkeys(("--ntasks-per-node", "--ntasks", "-n"), "one task per node, which starts "
                    "the node's ranks; use --nproc-per-node"),
    **dict.fromkeys(("--output", "-o", "--error", "-e"), "logs go to RUN_DIR/logs"),
    **dict.fromkeys(("--job-name", "-J"), "the job is named after the config's name"),
    **dict.fromkeys(("--gpus-per-node",), "use --gpus-per-node"),
    **dict.fromkeys(("--partition", "-p"), "use --partition"),
    **dict.fromkeys(("--time", "-t"), "use --time"),
    **dict.fromkeys(("--account", "-A"), "use --account"),
    **dict.fromkeys(("--qos", "-q"), "use --qos"),
    **dict.fromkeys(("--signal",), "partrain asks for USR2 before the time limit"),
    **dict.fromkeys(("--no-requeue",), "the job requeues itself after a save on a preemption "
                    "signal"),
    **dict.fromkeys(("--open-mode",), "a requeued job appends to its log"),
}
# The formats sbatch's --time takes (man sbatch), and its words for no limit.
SLURM_TIME = re.compile(r"\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+|"
                        r"UNLIMITED|INFINITE", re.IGNORECASE)


@dataclass(frozen=True)
class SlurmJob:
    """Everything the script says: where, how big, and the user's sbatch options."""

    run_dir: Path  # absolute: the job may start in another directory
    job_name: str
    nodes: int
    nproc_per_node: int
    partrain: tuple[str, ...]  # how to run partrain on the nodes (this install's, absolute)
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    sbatch_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=())  # exported before srun


def partrain_command() -> tuple[str, ...]:
    """This install of partrain, so that the nodes run the same code as the submitting shell."""
    script = Path(sys.executable).parent / "partrain"
    return (str(script),) if script.is_file() else (sys.executable, "-m", "partrain")


def passed_through_env(env=os.environ) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(PASSED_THROUGH)))


def _check_printable(what: str, value: str) -> None:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"{what}={value!r} contains a control character (newline, tab, ...); "
                          "it would break the sbatch script: use printable characters only")


def _sbatch_quote(value: str) -> str:
    """Quoting for `#SBATCH` lines as sbatch reads them: double quotes, backslash escapes."""
    if re.fullmatch(r"[A-Za-z0-9_.,:=/@%+-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_job(job: SlurmJob) -> None:
    """Refuse values that no quoting makes safe, naming the flag that carried them."""
    values = [("name", job.job_name), ("--run-dir", str(job.run_dir)),
              ("--partition", job.partition), ("--time", job.time), ("--account", job.account),
              ("--qos", job.qos), *(("--sbatch-arg", a) for a in job.sbatch_args),
              *((name, value) for name, value in job.env)]
    for what, value in values:
        if value is not None:
            _check_printable(what, value)
    if job.time is not None and not SLURM_TIME.fullmatch(job.time):
        raise ConfigError(
            f"--time {job.time!r} is not a SLURM time limit: give minutes, MM:SS, HH:MM:SS, "
            "D-HH, D-HH:MM or D-HH:MM:SS (e.g. 04:00:00 or 2-00:00:00), or UNLIMITED")
    for what, value in (("--partition", job.partition), ("--account", job.account),
                        ("--qos", job.qos)):
        if value is not None and not value.strip():
            raise ConfigError(f"{what}={value!r} is empty; leave the flag out for SLURM's default")
    for arg in job.sbatch_args:
        name = arg.split("=", 1)[0]
        if not arg.startswith("-") or not name.strip("-"):
            raise ConfigError(f"--sbatch-arg {arg!r} must be an sbatch option starting with '-', "
                              "e.g. --sbatch-arg=--exclusive or --sbatch-arg=--mem=0")
        if name in FIXED_SBATCH_OPTIONS:
            raise ConfigError(
                f"--sbatch-arg {arg!r} contradicts what partrain writes itself "
                f"({FIXED_SBATCH_OPTIONS[name]})")


def render_script(job: SlurmJob) -> str:
    """The sbatch script, exactly as submitted (and as `--dry-run` prints it)."""
    check_job(job)
    run_dir, q = job.run_dir, shlex.quote
    log_pattern = str(run_dir / "logs").replace("%", "%%") + "/slurm-%j.out"
    options = [("job-name", job.job_name), ("nodes", str(job.nodes)), ("ntasks-per-node", "1"),
               ("gpus-per-node", job.gpus_per_node and str(job.gpus_per_node)),
               ("partition", job.partition), ("time", job.time), ("account", job.account),
               ("qos", job.qos), ("output", log_pattern),
               ("signal", f"USR2@{SIGNAL_BEFORE_END_S}")]
    lines = ["#!/bin/bash",
             f"# Written by `partrain slurm`: {job.nodes} node(s) x {job.nproc_per_node} rank(s) "
             f"= {job.nodes * job.nproc_per_node} ranks.",
             f"# Run dir {q(str(run_dir))}; submit again with: sbatch {q(str(run_dir / SCRIPT))}"]
    lines += [f"#SBATCH --{key}={_sbatch_quote(value)}" for key, value in options if value]
    lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    lines += [f"#SBATCH {_sbatch_quote(arg)}" for arg in job.sbatch_args]
    lines += ["", "set -euo pipefail",
              "# USR2 is for the ranks; if a site signals this shell too, bash would die of it.",
              "# A trap, not `trap '' USR2`: an ignored signal stays ignored in srun and below.",
              "trap : USR2", ""]
    if job.env:
        lines += ["# NCCL and gloo settings of the shell that ran `partrain slurm`"]
        lines += [f"export {name}={q(value)}" for name, value in job.env] + [""]
    lines += [
        "# Node 0 hosts the rendezvous; the port follows from the job id as in `partrain launch`.",
        # sed reads to the end: `head -n 1` would close the pipe early, and under pipefail
        # scontrol's SIGPIPE (a long node list, or just timing) would end the script with 141.
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        'head_addr=$(scontrol show node -o "$head_node" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        f"rdzv_port=$(({SLURM_BASE_PORT} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))",
        "",
        "# One task per node: each `partrain launch` starts its node's ranks itself. No kill on a",
        "# non-zero exit: after a save the nodes exit 3 a moment apart, and a node killed as it ends",
        "# would make srun's code 130 or 137, not 3. --wait still stops a node that hangs.",
        "code=0",
        f"srun --kill-on-bad-exit=0 --wait={NODES_END_WITHIN_S} --nodes={job.nodes} "
        "--ntasks-per-node=1 --export=ALL \\",
        f"    {' '.join(q(part) for part in job.partrain)} launch "
        f"{q(str(run_dir / 'config.yaml'))} --run-dir {q(str(run_dir))} \\",
        f"    --nnodes {job.nodes} --nproc-per-node {job.nproc_per_node} "
        '--rdzv-endpoint "${head_addr:-$head_node}:$rdzv_port" || code=$?',
        "",
        "# Saved on a preemption signal: the requeued job runs this script again and resumes from",
        "# the checkpoint. SLURM ends this script as it requeues; if it cannot, the job fails with 3.",
        f'if [ "$code" -eq {EXIT_PREEMPTED} ] && scontrol requeue "$SLURM_JOB_ID"; then',
        "    exit 0",
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def write_script(job: SlurmJob) -> Path:
    path = job.run_dir / SCRIPT
    path.write_text(render_script(job))
    path.chmod(0o755)
    return path


def submit(script: Path) -> str:
    """Submit with sbatch and return the job id; sbatch's own message if it is missing or fails."""
    try:
        result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                                text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError("sbatch not found on PATH: `partrain slurm` submits through SLURM's "
                          "sbatch; run it on the cluster's login node, or use --dry-run to "
                          "print the script") from None
    except subprocess.TimeoutExpired:
        raise ConfigError("sbatch did not answer within 120 s; is slurmctld reachable?") from None
    if result.returncode != 0:
        message = (result.stderr.strip() or result.stdout.strip() or "(no message)")
        raise ConfigError(f"sbatch refused the job (exit {result.returncode}): {message}")
    return result.stdout.strip().split(";")[0]


def remove_prepared(run_dir: Path, created: bool) -> None:
    """After a failed submission, take back what `partrain slurm` wrote: nothing half-done stays."""
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in (SCRIPT, "config.yaml"):
        (run_dir / name).unlink(missing_ok=True)
    if (run_dir / "logs").is_dir() and not any((run_dir / "logs").iterdir()):
        (run_dir / "logs").rmdir()

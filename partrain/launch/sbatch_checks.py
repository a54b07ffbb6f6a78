"""What a `partrain slurm` job may ask of sbatch: the job's settings (`SlurmJob`) and the checks of
every value partrain writes into its script, of each --sbatch-arg, and of the SBATCH_* variables
sbatch would take over the script's lines. slurm.py renders and submits what passes.

Values no quoting makes safe are refused here, each naming the flag that carried it (slurm.py
quotes the rest): control characters (a newline in an `#SBATCH` comment would end the comment
and run the rest as a command), and the words that start another component of a heterogeneous
job. An extra sbatch option (--sbatch-arg) may not set what the script sets itself, in any
spelling sbatch reads: `-N4`, `-N 4`, `--nod=4`, `-vN4` are all --nodes, and sbatch keeps the
last value given.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from partrain.errors import ConfigError

SCRIPT = "job.sbatch"
SIGNAL_BEFORE_END_S = 120
SIGNAL_EARLY_S = 60  # man sbatch, --signal: "may be sent up to 60 seconds earlier than specified"

# The sbatch options the script sets itself, by sbatch's long name: the partrain flag (or what)
# that sets each one, and why. An --sbatch-arg that sets one again, in any spelling sbatch takes,
# would contradict it: the user's lines come last, and sbatch keeps the last value, silently.
# (--wait, --test-only and the like are partrain's too: it submits and reads the job id.)
_TASKS = ("--nproc-per-node", "one task per node, which starts the node's ranks; use "
          "--nproc-per-node")
_GPUS = ("--gpus-per-node", "GPUs are asked for per node; use --gpus-per-node")
_LOGS = ("--run-dir", "logs go to RUN_DIR/logs")
_REQUEUE = ("its preemption handling", "the job requeues itself after a save on a preemption "
            "signal")
_SUBMIT = ("its submission", "partrain submits the job with sbatch --parsable and reads its id; "
           "this would make sbatch wait for the job's end, or submit nothing")
PARTRAIN_SETS = {
    "nodes": ("--nodes", "use --nodes"),
    **dict.fromkeys(("ntasks", "ntasks-per-node", "tasks-per-node", "ntasks-per-gpu",
                     "ntasks-per-tres"), _TASKS),
    **dict.fromkeys(("gpus-per-node", "gpus", "gpus-per-task", "gpus-per-socket"), _GPUS),
    **dict.fromkeys(("output", "error"), _LOGS),
    "open-mode": ("--run-dir", "a requeued job appends to its log"),
    "job-name": ("the config's name", "the job is named after the config's name"),
    "partition": ("--partition", "use --partition"),
    "time": ("--time", "use --time"),
    "account": ("--account", "use --account"),
    "qos": ("--qos", "use --qos"),
    "cpus-per-task": ("--cpus-per-task", "use --cpus-per-task, which srun's step asks for too"),
    "mem": ("--mem", "use --mem"),
    # Only bare: --exclusive=user (or =mcs, =topo) is another sharing mode, passed on as given.
    "exclusive": ("--exclusive", "use --exclusive"),
    "signal": ("its preemption handling", f"USR2 {SIGNAL_BEFORE_END_S} s before the time "
               "limit, on which the ranks save a checkpoint"),
    **dict.fromkeys(("requeue", "no-requeue"), _REQUEUE),
    **dict.fromkeys(("wait", "test-only", "help", "usage", "version"), _SUBMIT),
    # An array's tasks are jobs of their own (their own ids, ports and rendezvous), all told to
    # train in the one --run-dir at once.
    "array": ("--run-dir", "each array task would train in the same run dir at once; submit "
              "one job per run dir"),
}
# sbatch's one-letter forms of those (src/common/slurm_opt.c), and the letters that take no
# value: getopt reads `-vN4` as -v -N 4, and `-N4`, `-N 4` (one argument) as --nodes.
SHORT_FORMS = {"N": "nodes", "n": "ntasks", "G": "gpus", "o": "output", "e": "error", "a": "array",
               "J": "job-name", "p": "partition", "t": "time", "A": "account", "q": "qos",
               "c": "cpus-per-task", "W": "wait", "h": "help", "V": "version"}
SHORT_FLAGS = frozenset("HIOQsuv")
# Options that ask for GPUs in their value (`--gres=gpu:4`, `--tres-per-task=gres/gpu:1`).
GPU_VALUED = ("gres", "tres-per-task")
# The formats sbatch's --time takes (man sbatch), and its words for no limit.
SLURM_TIME = re.compile(r"\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+|"
                        r"UNLIMITED|INFINITE", re.IGNORECASE)
# sbatch's --mem: megabytes, or K, M, G, T in either case, a B after it allowed (64G, 64gb, as
# sbatch 22.05 takes them; 64GiB, 1.5G, 64 G it refuses); 0 = all of each node's memory.
SLURM_MEM = re.compile(r"\d{1,12}(?:[KMGT]B?)?", re.IGNORECASE)
MAX_CPUS_PER_TASK = 65534  # SLURM holds it in 16 bits, the top value meaning "not set"
# sbatch refuses these together with partrain's flag ("mutually exclusive").
EXCLUDES = {"mem": ("--mem", ("mem-per-cpu", "mem-per-gpu")),
            "cpus_per_task": ("--cpus-per-task", ("cpus-per-gpu",))}


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
    cpus_per_task: int | None = None  # per node (its one task); None = SLURM's default
    mem: str | None = None  # per node, sbatch's format: 64G, 0 = all
    exclusive: bool = False  # whole nodes
    sbatch_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=())  # exported before srun
    setup: tuple[str, ...] = ()  # launcher.setup, then --setup: run on every node before partrain


def _check_printable(what: str, value: str) -> None:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"{what}={value!r} contains a control character (newline, tab, ...); "
                          "it would break the sbatch script: use printable characters only")


def _time_limit_s(time: str) -> int | None:
    """A SLURM time limit in seconds (man sbatch: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM,
    D-HH:MM:SS); None for no limit (UNLIMITED, INFINITE, 0) or a text that is none of these."""
    if not SLURM_TIME.fullmatch(time) or not time[0].isdigit():
        return None
    days, _, clock = time.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        seconds = int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    else:  # MM, MM:SS, HH:MM:SS
        seconds = {1: lambda: parts[0] * 60, 2: lambda: parts[0] * 60 + parts[1],
                   3: lambda: parts[0] * 3600 + parts[1] * 60 + parts[2]}[len(parts)]()
    return seconds or None


def check_job(job: SlurmJob) -> None:
    """Refuse values that no quoting makes safe, naming the flag that carried them."""
    on_sbatch_lines = [("name", job.job_name), ("--run-dir", str(job.run_dir)),
                       ("--partition", job.partition), ("--time", job.time),
                       ("--account", job.account), ("--qos", job.qos), ("--mem", job.mem),
                       *(("--sbatch-arg", a) for a in job.sbatch_args)]
    values = [*on_sbatch_lines,
              *((name, value) for name, value in job.env),
              # launcher.setup passed the same rule in validation: only a flag's line gets here.
              *(("--setup", line) for line in job.setup)]
    for what, value in values:
        if value is not None:
            _check_printable(what, value)
    for what, value in on_sbatch_lines:
        if value is not None:
            _check_not_a_component_break(what, value)
    for line in job.setup:
        if not line.strip():
            raise ConfigError(f"--setup {line!r} is empty: give a shell line, e.g. "
                              "--setup 'module load cuda/12.4'")
    if job.time is not None and not SLURM_TIME.fullmatch(job.time):
        raise ConfigError(
            f"--time {job.time!r} is not a SLURM time limit: give minutes, MM:SS, HH:MM:SS, "
            "D-HH, D-HH:MM or D-HH:MM:SS (e.g. 04:00:00 or 2-00:00:00), or UNLIMITED")
    limit = _time_limit_s(job.time) if job.time is not None else None
    least = SIGNAL_BEFORE_END_S + SIGNAL_EARLY_S
    if limit is not None and limit <= least:
        raise ConfigError(
            f"--time {job.time} is {limit} s, within the {SIGNAL_BEFORE_END_S} s before its end "
            f"at which the job is told to save and requeue (--signal=USR2@{SIGNAL_BEFORE_END_S}; "
            f"SLURM may send it up to {SIGNAL_EARLY_S} s earlier): every start would be stopped "
            f"at once and requeued without end; give a limit longer than {least // 60} minutes")
    if job.mem is not None and not SLURM_MEM.fullmatch(job.mem):
        raise ConfigError(
            f"--mem {job.mem!r} is not a SLURM memory size: give a whole number of megabytes, or "
            "one with a K, M, G or T suffix (e.g. 64G, 64GB or 500M; at most 12 digits), or 0 for "
            "all of each node's memory")
    if job.cpus_per_task is not None and not 1 <= job.cpus_per_task <= MAX_CPUS_PER_TASK:
        raise ConfigError(f"--cpus-per-task={job.cpus_per_task} must be between 1 and "
                          f"{MAX_CPUS_PER_TASK}, the most SLURM takes")
    for what, value in (("--partition", job.partition), ("--account", job.account),
                        ("--qos", job.qos)):
        if value is not None and not value.strip():
            raise ConfigError(f"{what}={value!r} is empty; leave the flag out for SLURM's default")
    for arg in job.sbatch_args:
        check_sbatch_arg(arg)
        _check_not_against_flags(job, arg)
        _check_time_min(arg)


def _check_time_min(arg: str) -> None:
    """--time-min lets SLURM lower the job's limit down to it to start the job sooner: the same
    rule as --time (a limit within the preemption notice stops and requeues every start)."""
    name, value = _long_name(arg) or "", arg.partition("=")[2]
    if not (len(name) > len("time") and "time-min".startswith(name)):
        return
    limit, least = _time_limit_s(value.strip()), SIGNAL_BEFORE_END_S + SIGNAL_EARLY_S
    if limit is not None and limit <= least:
        raise ConfigError(
            f"--sbatch-arg {arg!r}: SLURM may lower the job's time limit to {limit} s to start "
            f"it sooner, within the {SIGNAL_BEFORE_END_S} s before its end at which the job is "
            f"told to save and requeue (--signal=USR2@{SIGNAL_BEFORE_END_S}; up to "
            f"{SIGNAL_EARLY_S} s earlier): every start would be stopped at once and requeued "
            f"without end; give a --time-min longer than {least // 60} minutes")


# sbatch takes an #SBATCH line holding either word anywhere, in any case, as the start of
# another component of a heterogeneous job (src/sbatch/opt.c, _opt_batch_script): the lines after
# it, partrain's signal and requeue among them, would no longer be the batch step's.
COMPONENT_BREAKS = ("packjob", "hetjob")


def _check_not_a_component_break(what: str, value: str) -> None:
    found = [word for word in COMPONENT_BREAKS if word in value.lower()]
    if found:
        raise ConfigError(f"{what}={value!r} holds {found[0]!r}, which sbatch reads on an "
                          "#SBATCH line as the start of another component of a heterogeneous "
                          "job, whatever comes around it; choose another name")


def _long_name(arg: str) -> str | None:
    """The option name of a long sbatch argument (`--mem-per-gpu=10G` -> 'mem-per-gpu')."""
    return arg[2:].partition("=")[0] if arg.startswith("--") else None


# sbatch's input environment variables for the options the script sets (man sbatch): sbatch
# takes them over the script's #SBATCH lines, silently. Each with the SlurmJob field that makes
# the script set it, None where it always does.
ENV_OVERRIDES = {
    "SBATCH_SIGNAL": ("--signal", None), "SBATCH_REQUEUE": ("--requeue", None),
    "SBATCH_NO_REQUEUE": ("--requeue", None), "SBATCH_OPEN_MODE": ("--open-mode", None),
    "SBATCH_JOB_NAME": ("--job-name", None), "SBATCH_ARRAY_INX": ("--array", None),
    "SBATCH_WAIT": ("its submission (sbatch would wait for the job's end)", None),
    "SBATCH_PARTITION": ("--partition", "partition"), "SBATCH_TIMELIMIT": ("--time", "time"),
    "SBATCH_ACCOUNT": ("--account", "account"), "SBATCH_QOS": ("--qos", "qos"),
    "SBATCH_MEM_PER_NODE": ("--mem", "mem"), "SBATCH_EXCLUSIVE": ("--exclusive", "exclusive"),
    "SBATCH_CPUS_PER_TASK": ("--cpus-per-task", "cpus_per_task"),
    **dict.fromkeys(("SBATCH_GPUS_PER_NODE", "SBATCH_GPUS", "SBATCH_GPUS_PER_TASK",
                     "SBATCH_GRES"), ("--gpus-per-node", "gpus_per_node")),
}


def check_sbatch_env(job: SlurmJob, environ) -> None:
    """Refuse an SBATCH_* variable in the environment that would replace an option the script
    sets (a site profile's SBATCH_NO_REQUEUE or SBATCH_SIGNAL would undo the preemption
    handling, SBATCH_PARTITION a --partition given): sbatch reads the script's lines, then its
    environment, then its command line, the later winning."""
    for name, (option, field) in ENV_OVERRIDES.items():
        if name in environ and (field is None or getattr(job, field) not in (None, False)):
            raise ConfigError(
                f"{name}={environ[name]!r} is set in the environment, and sbatch takes it over "
                f"the script's own {option} line; unset it for this job (`env -u {name} "
                f"partrain slurm ...`; a later `sbatch {SCRIPT}` by hand needs the same)")


def _check_not_against_flags(job: SlurmJob, arg: str) -> None:
    """An --sbatch-arg that sbatch takes as the same thing as one of partrain's flags, another
    way: --exclusive=user with --exclusive, --mem-per-gpu with --mem (sbatch refuses the pair)."""
    name = _long_name(arg)
    if not name:
        return
    if job.exclusive and len(name) >= len("exclus") and "exclusive".startswith(name):
        raise ConfigError(f"--sbatch-arg {arg!r} and --exclusive ask for two ways of sharing the "
                          "nodes; give one of them")
    for attribute, (flag, options) in EXCLUDES.items():
        taken = [option for option in options if option.startswith(name)]
        if getattr(job, attribute) is not None and taken:
            raise ConfigError(f"--sbatch-arg {arg!r} and {flag} cannot go together: sbatch "
                              f"takes one of {flag}, --{', --'.join(taken)}")


def check_sbatch_arg(arg: str) -> None:
    """One option per --sbatch-arg, none that partrain sets itself (PARTRAIN_SETS)."""
    name = arg.split("=", 1)[0]
    if not arg.startswith("-") or not name.strip("-"):
        raise ConfigError(f"--sbatch-arg {arg!r} must be an sbatch option starting with '-', "
                          "e.g. --sbatch-arg=--constraint=a100 or --sbatch-arg=--mail-type=END")
    own = partrain_option(arg)
    if own is not None:
        option, how = own
        source, rule = PARTRAIN_SETS[option]
        raise ConfigError(
            f"--sbatch-arg {arg!r} contradicts what partrain writes itself: sbatch reads it as "
            f"--{option}{how}, which partrain sets from {source} ({rule})")
    if arg.startswith("--") and len(name.split()) > 1:
        raise ConfigError(f"--sbatch-arg {arg!r}: one option per --sbatch-arg, its value after "
                          "'=' (e.g. --sbatch-arg=--constraint=a100); sbatch reads this as one "
                          f"option named {name[2:]!r}")
    # A long option after a value ("--constraint=a100 --mail-type=END"): sbatch reads it all as
    # the first one's value. (A short one may be a value's own text: --comment='run -x'.)
    options = re.split(r"\s+(?=--[A-Za-z])", arg.strip())
    if len(options) > 1:
        first = re.split(r"[=\s]", arg.strip(), maxsplit=1)[0]
        each = " ".join(f"--sbatch-arg={option}" for option in options)
        raise ConfigError(f"--sbatch-arg {arg!r} holds {len(options)} options; sbatch would read "
                          f"them as one value of {first}: give each its own flag ({each})")


def partrain_option(arg: str) -> tuple[str, str] | None:
    """The option of PARTRAIN_SETS that sbatch reads `arg` as setting, and how it gets there
    ('' when spelled out); None if it sets none. sbatch parses with getopt_long: a long name may
    be abbreviated to any unambiguous prefix, and one-letter options may be grouped, their value
    attached."""
    if arg.startswith("--"):
        name, _, value = arg[2:].partition("=")
        name = (name.split() or [""])[0]  # "--nodes 4" as one argument: sbatch's --nodes, refused
        if value and len(name) >= len("exclus") and "exclusive".startswith(name):
            return None  # --exclusive=user: a sharing mode partrain's --exclusive does not set
        if name in PARTRAIN_SETS:
            return name, ""
        longer = sorted(option for option in PARTRAIN_SETS if option.startswith(name))
        if longer:
            return longer[0], f" (sbatch takes --{name} for --{' or --'.join(longer)})"
        for option in GPU_VALUED:
            if option.startswith(name) and _asks_for_gpus(value):
                return "gpus-per-node", f" (--{option}={value} asks for GPUs)"
        return None
    for letter in arg[1:]:
        if letter in SHORT_FORMS:
            return SHORT_FORMS[letter], f" (-{letter} is its short form)"
        if letter not in SHORT_FLAGS:
            return None  # a letter that takes a value: the rest of the argument is that value
    return None


def _asks_for_gpus(value: str) -> bool:
    """A --gres or --tres-per-task list that names gpu: `gpu`, `gpu:4`, `gpu:a100:4`,
    `gres/gpu=1`."""
    for item in value.split(","):
        kind = re.split(r"[:=]", item.strip())[0].lower()
        if kind.removeprefix("gres/") == "gpu":
            return True
    return False

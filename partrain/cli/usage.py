"""What the `partrain` command says about a usage error: for an unknown flag, the partrain flag
another launcher's user most likely means (torchrun, DeepSpeed, Accelerate, Hydra)."""

import re

# Other launchers' flags, by what they mean: their nearest partrain flag by spelling can mean
# the opposite (--master-addr is node 0's address; --local-addr is this node's). The first flag
# the command has is suggested; a name with underscores is looked up with dashes.
FLAG_SYNONYMS = {
    "num-gpus": ("--gpus-per-node", "--nproc-per-node", "--gpus"),  # DeepSpeed
    "gpus": ("--gpus-per-node", "--nproc-per-node"),
    "num-processes": ("--nproc-per-node", "--gpus"),  # Accelerate
    "nproc": ("--nproc-per-node",), "nprocs": ("--nproc-per-node",),
    "num-nodes": ("--nodes", "--nnodes"), "num-machines": ("--nodes", "--nnodes"),
    "nodes": ("--nnodes",),
    "machine-rank": ("--node-rank",), "node-id": ("--node-rank",),
    "master-addr": ("--rdzv-endpoint",), "master-port": ("--rdzv-endpoint",),
    "main-process-ip": ("--rdzv-endpoint",), "main-process-port": ("--rdzv-endpoint",),
    "master": ("--rdzv-endpoint",),
    "output-dir": ("--run-dir", "--out"), "output": ("--run-dir", "--out"),
    "out-dir": ("--run-dir", "--out"), "save-dir": ("--run-dir", "--out"),
    "logdir": ("--run-dir",), "log-dir": ("--run-dir",),
    "resume-from": ("--resume",), "resume-from-checkpoint": ("--resume",),
    "max-retries": ("--max-restarts",), "restarts": ("--max-restarts",),
}
# torchrun's flags partrain has no flag for, and what it does instead (its nearest spelling
# meant something else: --tee suggested --resume, --rdzv_conf --rdzv-backend).
TORCHRUN_OWN = {
    **dict.fromkeys(("tee", "redirects", "local-ranks-filter"), (
        "each rank writes its output to RUN_DIR/logs/rank-N.log, and rank 0's progress is on the "
        "console; `partrain runs` and the launcher's summary of a failure name the rank")),
    "rdzv-conf": ("partrain sets the rendezvous itself; its timeout is the override "
                  "launcher.rdzv_timeout_s=SECONDS"),
    **dict.fromkeys(("no-python", "module", "m", "run-path"), (
        "partrain launch runs partrain's trainer, not a script: your model goes in "
        "model.target=pkg.module:build (docs/models.md)")),
    "monitor-interval": "partrain's launcher watches the ranks itself",
    "role": "every rank is a trainer",
}
# torchrun's flags for where the nodes meet, which `partrain slurm` takes from the job instead.
SLURM_SETS = ("master-addr", "master-port", "rdzv-endpoint", "node-rank", "standalone",
              "local-addr", "rdzv-id", "rdzv-backend")
# Hydra's own command-line flags: partrain takes the config as its first argument instead.
CONFIG_FLAGS = ("config", "config-name", "config-path", "config-dir", "config-file", "cfg")


def meant(e, ctx) -> str:
    """A usage error's message; for an unknown flag, the flag it most likely means."""
    # Typer carries its own copy of click: its NoSuchOption is known by what it holds.
    if not hasattr(e, "option_name") or not hasattr(e, "possibilities") or ctx is None:
        return e.format_message()
    name = e.option_name.split("=", 1)[0].lstrip("-").lower().replace("_", "-")
    flags = {opt for param in ctx.command.params
             for opt in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ()))}
    if name in CONFIG_FLAGS:
        return (f"{e.message} (the config is the first argument, not a flag: "
                f"{ctx.command_path} CONFIG [OVERRIDE...], CONFIG a recipe name or a YAML path)")
    likely = next((flag for flag in FLAG_SYNONYMS.get(name, ()) if flag in flags), None)
    if likely is not None:
        return f"{e.message} (did you mean {likely}?)"
    if name in TORCHRUN_OWN and ctx.command.name in ("launch", "slurm"):
        dashes = "-" if len(name) == 1 else "--"
        return f"{e.message} (torchrun's {dashes}{name}: {TORCHRUN_OWN[name]})"
    if ctx.command.name == "slurm" and name in SLURM_SETS:
        return (f"{e.message} (partrain slurm sets where the nodes meet itself: node ranks from "
                "SLURM, the rendezvous on the job's first node)")
    return e.format_message()


# Flags whose value is a path: an empty one ("$UNSET") would mean the current directory.
PATH_WORDS = ("dir", "out", "resume", "root", "path")


def missing_value(command, args: list[str]) -> str | None:
    """A flag that takes a value given none, as click would take it: the next word, even when
    that is another of the command's flags (`--run-dir --dry-run` trained into a folder named
    --dry-run; `--partition --dry-run` submitted the job), or an empty path (`--run-dir ""`, an
    unset variable: the current directory). The message, or None. `command` is the click
    command of the whole CLI (typer.main.get_command)."""
    name = []
    while hasattr(command, "commands"):  # a group: down to the subcommand named
        words = [i for i, word in enumerate(args) if not word.startswith("-")]
        if not words or args[words[0]] not in command.commands:
            return None
        name.append(args[words[0]])
        command, args = command.commands[args[words[0]]], args[words[0] + 1:]
    options = [p for p in command.params if getattr(p, "param_type_name", "") == "option"]
    flags = {opt for p in options for opt in (*p.opts, *getattr(p, "secondary_opts", ()))}
    takes = {opt for p in options if not p.is_flag and not p.count for opt in p.opts}
    for i, word in enumerate(args):
        if word == "--":
            break
        flag, given, value = word.partition("=")
        if flag not in takes:
            continue
        if not given:
            if i + 1 == len(args):
                return None  # click says "requires an argument"
            value = args[i + 1]
            if value.partition("=")[0] in flags | {"--help"}:
                return (f"{flag} takes a value and got none: the word after it, {value}, is a "
                        f"flag of `partrain {' '.join(name)}` (a value that starts with '-' is "
                        f"written {flag}=VALUE)")
            path = any(part in flag for part in PATH_WORDS)
            if path and re.fullmatch(r"[+~]{0,2}[A-Za-z_]\w*(\.\w+)+=.*", value):
                # `--run-dir train.max_steps=3`: the override became the run dir, lost
                return (f"{flag} takes a path and got none: the word after it, {value}, is a "
                        f"config override (a path with '=' in it is written {flag}=PATH)")
        if value == "" and any(part in flag for part in PATH_WORDS):
            return f"{flag} is empty; give it a path (for the current directory: {flag} .)"
    return None

"""What the `partrain` command says about a usage error: for an unknown flag, the partrain flag
another launcher's user most likely means (torchrun, DeepSpeed, Accelerate, Hydra)."""

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
    if ctx.command.name == "slurm" and name in SLURM_SETS:
        return (f"{e.message} (partrain slurm sets where the nodes meet itself: node ranks from "
                "SLURM, the rendezvous on the job's first node)")
    return e.format_message()

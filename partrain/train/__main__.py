"""`python -m partrain.train RUN_DIR`: one rank of a run, as the elastic agent starts it with
launcher.start_method=spawn (forked ranks enter through partrain.launch.forked instead)."""

# Before torch is imported (seconds): SLURM signals every process of the job step, and the
# default action of SIGUSR2 would end this rank. Noted here; PreemptionFlag takes it over.
import signal as _signal
import time as _time

_EARLY_SIGNAL: list[float] = []
_signal.signal(_signal.SIGUSR2, lambda signum, frame: _EARLY_SIGNAL.append(_time.time()))

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

# Started by hand or by torchrun (`torchrun -m partrain.train OVERRIDES`): one clear line, not an
# IndexError or a KeyError from deep inside (the agent gives a rank its run dir and RANK)
if len(sys.argv) != 2 or not os.path.isfile(os.path.join(sys.argv[1], "config.yaml")) or \
        "RANK" not in os.environ:
    sys.stderr.write(
        "error: python -m partrain.train is the worker that `partrain launch` starts, one per "
        "rank, with the run dir it wrote; it takes no config or overrides and is not started by "
        "hand or by torchrun. Run `partrain launch [CONFIG] [OVERRIDE...] --nproc-per-node N` "
        "instead: it starts the ranks itself (docs/coming-from.md, From torchrun)\n")
    sys.exit(2)


def _world_of(run_dir: str) -> int | None:
    """The ranks the run dir's config was resolved for (launcher.nnodes x nproc_per_node)."""
    import yaml

    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            launcher = (yaml.safe_load(f) or {}).get("launcher") or {}
        return int(launcher["nnodes"]) * int(launcher["nproc_per_node"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError):
        return None


# A run dir started under another world size than its config's (torchrun with another
# --nproc_per_node): the mesh was refused deep inside, with a traceback in every rank.
_WORLD = _world_of(sys.argv[1])
if _WORLD is not None and os.environ.get("WORLD_SIZE") != str(_WORLD):
    sys.stderr.write(
        f"error: {sys.argv[1]} was resolved for {_WORLD} rank(s) (launcher.nnodes x "
        f"nproc_per_node in its config.yaml), and this worker is one of "
        f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}: start it with `partrain launch --resume "
        f"{sys.argv[1]}` (which resolves the layout for the ranks it starts) or with as many "
        "ranks\n")
    sys.exit(2)

from partrain.launch.heap import imports_without_gc  # noqa: E402

with imports_without_gc():  # torch, DTensor, DCP and partrain, with less CPU (heap.py)
    from partrain.train.rank import run  # noqa: E402

run(sys.argv[1], _EARLY_SIGNAL)
# A clean end: main() closed every file of the run (checkpoints, metrics, curves) and ended the
# process group. Skip the interpreter's teardown too: unloading torch module by module costs about
# 0.5 s of CPU a rank, paid by every rank of a CPU node at once; only the log handlers and the
# standard streams are left to flush.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

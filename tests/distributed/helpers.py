"""Run a test body on N real gloo processes.

The processes meet through a FileStore in a fresh temp dir (no ports, so no port races), use a
short collective timeout so that a broken test fails fast, and end the group cleanly. A failing
rank's exception (assertion included) is re-raised in the test with its traceback.
"""

import gc
import os
import tempfile
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=60)


def _entry(rank: int, fn, world_size: int, store_path: str, args: tuple) -> None:
    # What came from the server stays out of every collection (partrain/launch/heap.py): the
    # gc.collect() below walks only what the body made.
    gc.freeze()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    fn(rank, world_size, *args)
    # The body has returned, so its modules and meshes are unreferenced; see partrain.parallel.dist.
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


# The ranks fork from one server process that imported torch and partrain once for the whole
# session (multiprocessing's forkserver), instead of each rank of each test importing them anew
# (spawn): about 2.5 s of CPU per rank on the 2-core CI machine. The server is started before any
# thread or process group exists, so every rank still begins from a clean, single-threaded state.
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo",
           "partrain.train.loop", "tests.distributed.helpers"]
mp.set_forkserver_preload(PRELOAD)


def run_distributed(fn, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) on world_size new processes; fn must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(fn, world_size, os.path.join(tmp, "store"), args),
                           nprocs=world_size, join=True, start_method=START_METHOD)


def run_script_json(name: str, *args: str, timeout: float = 300):
    """`python scripts/NAME ARGS... --json` in its own process group, killed at the end so its
    spawned ranks never outlive the test; its JSON output."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / name
    proc = subprocess.Popen([sys.executable, str(script), *args, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)

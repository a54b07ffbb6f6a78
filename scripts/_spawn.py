"""What the benchmarks share: run `worker(rank, args, store_path, out_path)` on N spawned gloo
processes that meet through a FileStore, and return the JSON that rank 0 wrote to out_path; inside
a worker, join that group and take the largest of a number over the ranks."""

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def join_group(rank: int, world: int, store_path: str) -> None:
    """One thread per rank (the benchmark's processes share the cores) and the gloo group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# The workers fork from one server process that imported torch, partrain and the benchmark script
# once (multiprocessing's forkserver), not each worker of each row anew (spawn: ~2.5 s of CPU a
# process). The server starts before any thread or process group exists.
mp.set_forkserver_preload(["__main__", "torch", "torch._dynamo", "partrain.train.loop"])


def run_workers(worker, args, nprocs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=nprocs,
                           join=True, start_method="forkserver")
        return json.loads(Path(out).read_text())

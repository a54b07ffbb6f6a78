"""What the benchmarks share: run `worker(rank, args, store_path, out_path)` on N spawned gloo
processes that meet through a FileStore, and return the JSON that rank 0 wrote to out_path."""

import json
import os
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def run_workers(worker, args, nprocs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=nprocs,
                           join=True, start_method="spawn")
        return json.loads(Path(out).read_text())

"""Process-group start and a clean end for one worker.

The clean end matters with gloo: `destroy_process_group()` alone lets a rank abort at exit with
"terminate called without an active exception" (a race in gloo's worker threads at interpreter
teardown). A barrier, dropping every reference to model/optimizer/mesh (the caller returns first),
`gc.collect()` and then destroy ends it cleanly.
"""

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: int) -> None:
    """The default process group from the elastic agent's environment: NCCL on CUDA, gloo on CPU."""
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def end_distributed() -> None:
    """Call after everything holding a process group (model, optimizer, mesh) is out of scope."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def env_rank() -> tuple[int, int, int]:
    """(global rank, local rank, world size) as the elastic agent sets them."""
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])

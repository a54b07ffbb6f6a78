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
    """The default process group from the elastic agent's environment: NCCL on CUDA, gloo on CPU.

    After a restart (launcher.max_restarts) the workers meet in the same store as the failed
    attempt's, whose keys (each rank's gloo address) are still there: a new rank read a dead
    one's and was refused. Each restart's group gets a store prefix of its own."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    options = {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        options["device_id"] = device
    if attempt():
        from torch.distributed.rendezvous import _create_c10d_store

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   rank, world, options["timeout"])
        options.update(store=dist.PrefixStore(f"partrain/attempt-{attempt()}", store), rank=rank,
                       world_size=world)
    dist.init_process_group(backend, **options)


def attempt() -> int:
    """This worker's attempt: 0 first, then one more at each in-job restart (launcher.max_restarts;
    the launcher numbers them the same on every node: launch/local.py's RunDirLogsSpecs)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def end_distributed() -> None:
    """Call after everything holding a process group (model, optimizer, mesh) is out of scope."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def env_rank() -> tuple[int, int, int]:
    """(global rank, local rank, world size) as the elastic agent sets them."""
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's parameters, gradients and optimizer state); a plain
    tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor

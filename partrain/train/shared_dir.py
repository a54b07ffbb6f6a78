"""Before any step: every node sees the same run dir, or nothing starts.

A job's checkpoints are written by every rank into one directory and committed by rank 0, so
node-local run dirs (each node's own disk, or a path that is not the same mount everywhere) lose
the other nodes' shards. Global rank 0 writes a token fresh for this start into its run dir and
sends it through the rendezvous's process group; the first rank of every node reads the file in
its own run dir and says what it found. If any node did not find this token, every rank raises
`RunDirNotShared` with one message naming what each node saw; the launcher turns that into exit 2
on every node (partrain.launch.local). Nothing is trained and no checkpoint is begun: this runs
before the start is looked for, which removes a previous save's leftovers.
"""

import os
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

TOKEN_FILE = ".partrain-node-check"
# A network file system may show another client's new file late (attribute and negative-lookup
# caches): a node that does not find the token looks again for this long before it says so.
LOOK_AGAIN_S = 10.0


class RunDirNotShared(Exception):
    """The nodes' run dirs are not one directory; raised on every rank, with the same message."""


def _read(path: Path, token: str) -> str:
    """What this node finds at `path`: the token, another token, or why nothing."""
    deadline = time.monotonic() + LOOK_AGAIN_S
    while True:
        try:
            found = path.read_text().strip()
        except FileNotFoundError:
            found = "no such file"
        except OSError as err:
            found = f"cannot read it ({err.strerror or err})"
        if found == token or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def check_shared_run_dir(run_dir: Path, rank: int, local_rank: int, node: int) -> None:
    """Raise RunDirNotShared (on every rank) unless every node's first rank reads global rank
    0's fresh token in its own run dir."""
    path = run_dir / TOKEN_FILE
    token = [uuid.uuid4().hex if rank == 0 else None]
    if rank == 0:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(token[0] + "\n")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    dist.broadcast_object_list(token, src=0)
    seen = None
    if local_rank == 0:
        seen = (node, socket.gethostname(), str(run_dir.resolve()), _read(path, token[0]))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    nodes = sorted(s for s in every if s is not None)
    dist.barrier()
    if rank == 0:
        path.unlink(missing_ok=True)
    if all(found == token[0] for *_, found in nodes):
        return
    saw = "; ".join(
        f"node {n} ({host}) at {where}: "
        + ("found it" if found == token[0] else
           "a token of another start" if len(found) == len(token[0]) and found.isalnum()
           else found)
        for n, host, where, found in nodes)
    raise RunDirNotShared(
        f"--run-dir: the nodes do not see one run dir. Rank 0 wrote a check file "
        f"({TOKEN_FILE}) into its run dir and each node looked for it in its own: {saw}. Every "
        "node must see the same run dir: a shared file system mounted at the same path on every "
        "node (`partrain slurm` runs too), given as --run-dir (or the default under runs/ on "
        "that shared file system). Nothing was trained and no checkpoint was begun")

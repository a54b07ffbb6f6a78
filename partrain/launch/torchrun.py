"""torchrun's launcher flags, read as partrain's own: a torchrun command line works as it is.

`partrain launch` takes torchrun's spellings beside its own (the CLI declares them as aliases:
`--nproc_per_node`, `--node_rank`, `--rdzv_endpoint`, ...). What needs more than a second name is
here: `--master-addr/--master-port` name the rendezvous endpoint as torchrun builds it for its
static rendezvous (HOST:PORT, 127.0.0.1 and 29500 when one is left out); `--standalone` is one
node on a free local port; `--nproc-per-node gpu|cpu|auto` counts this machine's devices as
torch/distributed/run.py's `determine_local_world_size` does; `--nnodes MIN:MAX` is accepted when
MIN = MAX (partrain's node count is fixed); `--rdzv-backend` names what partrain always runs.
"""

from dataclasses import dataclass

from partrain.errors import ConfigError

NPROC_WORDS = ("gpu", "cpu", "auto")
MASTER_ADDR, MASTER_PORT = "127.0.0.1", 29500  # torchrun's defaults for its static rendezvous
RDZV_BACKENDS = ("c10d", "static")  # partrain runs c10d; torchrun's default `static` reads as it


def read_nproc(text: str) -> int | str:
    """--nproc-per-node: a whole number, or gpu, cpu, auto (counted later, on this node)."""
    word = text.strip().lower()
    if word in NPROC_WORDS:
        return word
    if text.strip().lstrip("+").isdigit() and len(text.strip()) <= 40:
        return int(text)
    raise ValueError(f"--nproc-per-node={text!r} is not a whole number or one of "
                     f"{', '.join(NPROC_WORDS)}")


def read_nnodes(text: str) -> int:
    """--nnodes N, or torchrun's MIN:MAX with MIN = MAX: partrain waits for a fixed count."""
    low, sep, high = text.strip().partition(":")
    if not low.isdigit() or len(low) > 9 or (sep and (not high.isdigit() or len(high) > 9)):
        raise ValueError(f"--nnodes={text!r} is not a whole number (or MIN:MAX, torchrun's range)")
    if sep and int(low) != int(high):
        raise ValueError(f"--nnodes={text}: partrain runs a fixed number of nodes, not an elastic "
                         f"range; give --nnodes {high} (or {high}:{high})")
    if int(low) < 1:
        raise ValueError(f"--nnodes={text} must be at least 1")
    return int(low)


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes meet, as the flags say: the node count, this node's rank, the endpoint
    (None: one node on 127.0.0.1 and a free port) and which flag named it, for messages."""

    nnodes: int | None
    node_rank: int | None
    endpoint: str | None
    endpoint_from: str = "--rdzv-endpoint"
    run_id: str | None = None


def read_rendezvous(*, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None,
                    master_addr: str | None, master_port: int | None, standalone: bool,
                    rdzv_id: str | None, rdzv_backend: str | None) -> Rendezvous:
    """The rendezvous the flags ask for, in partrain's terms; contradictions refused (exit 2)."""
    if rdzv_backend is not None and rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(f"--rdzv-backend {rdzv_backend}: partrain's nodes always meet at a c10d "
                          "rendezvous (torch's TCP store on node 0, at --rdzv-endpoint); give "
                          "c10d, or leave the flag out")
    if rdzv_id is not None and not (0 < len(rdzv_id) <= 128 and rdzv_id.isprintable()
                                    and not any(c.isspace() for c in rdzv_id)):
        raise ConfigError(f"--rdzv-id {rdzv_id[:40]!r} must be 1 to 128 printable characters "
                          "without spaces, the same on every node")
    master = master_addr is not None or master_port is not None
    if standalone:
        given = [flag for flag, value in (("--rdzv-endpoint", rdzv_endpoint),
                                          ("--master-addr", master_addr),
                                          ("--master-port", master_port)) if value is not None]
        if nnodes not in (None, 1):
            given.append(f"--nnodes {nnodes}")
        if node_rank not in (None, 0):
            given.append(f"--node-rank {node_rank}")
        if given:
            raise ConfigError(f"--standalone runs one node on a free local port, and "
                              f"{', '.join(given)} name(s) a multi-node job; give one or the other")
        return Rendezvous(nnodes=1, node_rank=0, endpoint=None, run_id=rdzv_id)
    if master and rdzv_endpoint is not None:
        raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint} and --master-addr/--master-port both "
                          "name node 0's address; give one (--master-addr HOST --master-port PORT "
                          "is --rdzv-endpoint HOST:PORT)")
    if master:
        addr = master_addr if master_addr is not None else MASTER_ADDR
        if ":" in addr and not addr.startswith("["):
            addr = f"[{addr}]"  # an IPv6 address, as torchrun's help asks it to be written
        port = master_port if master_port is not None else MASTER_PORT
        return Rendezvous(nnodes, node_rank, f"{addr}:{port}", "--master-addr/--master-port",
                          rdzv_id)
    return Rendezvous(nnodes, node_rank, rdzv_endpoint, run_id=rdzv_id)


def count_nproc(word: str, gpus: int, cores: int, gpus_used: bool) -> tuple[int, str]:
    """--nproc-per-node gpu|cpu|auto as a number, and where it came from, for messages. `gpus`:
    the CUDA devices this node's workers may use (the scheduler's share); `cores`: the cores this
    process may run on; `gpus_used`: whether the workers run on CUDA (launcher.device)."""
    if word == "gpu":
        if gpus < 1:
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible on this node; give "
                              "a number, or cpu (one rank per core)")
        return gpus, f"--nproc-per-node gpu ({gpus} visible GPU(s))"
    if word == "auto" and gpus_used and gpus > 0:
        return gpus, f"--nproc-per-node auto ({gpus} visible GPU(s))"
    return cores, f"--nproc-per-node {word} ({cores} usable core(s))"

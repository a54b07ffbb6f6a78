"""DeepSpeed's JIT-built CPU ops for the offload tests, built once into the extension cache that
every run shares (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions): on a fresh machine
each takes 30-150 s on 2 cores, and ranks building the same op at once would only wait for each
other. (A ZeRO run that does not offload builds nothing: partrain skips DeepSpeed's shared-memory
all-reduce, parallel/zero.py.)

    python -m tests.integration.op_build cpu_adam  # ZeRO-Offload's CPU Adam
    python -m tests.integration.op_build aio       # async_io, offload to NVMe (libaio-dev installed first)

Exit 0: built, or already in the cache; 3 (aio): no libaio here and none to be installed, the
reason on stderr. The build runs in this process, so that a SIGTERM (conftest's, when a session
ends before the build does) reaches the build's own `finally`, which releases torch's lock on the
op's folder; a kill leaves that lock behind, and the next run waits on it for ever.

async_io is the suite's largest single build (about 150 s on 2 cores, 12 files against torch's
headers), and most tests leave a core idle at times (a launcher starting, a rank waiting on a
peer, SLURM scheduling): conftest starts its build in the background at the end of collection,
at the lowest CPU priority (nice 19, for its session's autogroup too: a core only when no
test wants it), when a collected test needs it.
"""

import fcntl
import os
import signal
import subprocess
import sys
import time

from partrain.launch.start import extension_root
from tests.integration import debian

NO_LIBAIO = 3


def load(builder) -> None:
    start = time.perf_counter()
    builder.load(verbose=False)
    print(f"{builder.name}: {time.perf_counter() - start:.1f} s")


def exclusive(what: str):
    """One build of `what` at a time across processes (two test sessions on one machine, or
    pytest-xdist's workers, each start one), held by this process until it exits, however it
    exits. torch's own lock on an op's folder is not enough: a process that waited on it only
    imports the op afterwards, and where the builder was stopped (its session ended: SIGTERM)
    that import fails, where it should build (seen under pytest-xdist)."""
    folder = extension_root()
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / f"partrain-op-build-{what}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def build_cpu_adam() -> int:
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    load(CPUAdamBuilder())
    return 0


def build_aio() -> int:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible():
        return NO_LIBAIO
    load(builder)
    return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["DS_ACCELERATOR"] = "cpu"
    # held until this process exits (the --installed child runs under its parent's)
    lock = None if "--installed" in argv else exclusive(argv[0])  # noqa: F841
    if argv[:1] == ["cpu_adam"]:
        return build_cpu_adam()
    if build_aio() != NO_LIBAIO:
        return 0
    if "--installed" in argv:
        print("libaio-dev is installed and DeepSpeed's async_io op still finds no libaio",
              file=sys.stderr)
        return 1
    try:
        debian.install(("libaio-dev",), "libaio")
    except debian.Unavailable as e:
        print(f"no offload to NVMe on this machine: {e}", file=sys.stderr)
        return NO_LIBAIO
    # a fresh process, whose DeepSpeed has not yet looked for libaio
    return subprocess.run([sys.executable, "-m", "tests.integration.op_build", "aio", "--installed"]
                          ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

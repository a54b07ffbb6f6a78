"""Where `partrain launch` runs: by hand, inside a SLURM allocation, or under torchrun.

Each environment is a small class with `detect()` and the few facts the launcher needs (node
count, this node's rank, the rendezvous endpoint, a job id that all nodes share), read from the
environment variables the scheduler sets; unit tests set those variables and check the answers.
Flags given on the command line always win over what an environment says.

- SLURM: `srun partrain launch ...` with one task per node. partrain's elastic agent then starts
  one worker per GPU itself, so one srun task per GPU would start every rank G times over: that
  double launch is refused before anything starts.
- torch elastic: `torchrun ... partrain launch` would put a launcher (and its workers) inside every
  torchrun worker; partrain is its own torchrun, so this is refused with the command to use.
"""

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from partrain.errors import ConfigError

# Rendezvous ports for SLURM jobs: 29500 + job id % 1000, below Linux's ephemeral range (32768+),
# so that two jobs sharing a node rarely collide and every node computes the same port.
SLURM_BASE_PORT = 29500
SLURM_PORT_SPAN = 1000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: `a[1-2,4],b` -> ['a[1-2,4]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


MAX_NODES = 1 << 20  # validation bounds a world at this many ranks, so nodes too


def _expand_ranges(body: str) -> list[str]:
    """`01-03,07` -> ['01', '02', '03', '07']; the width of the first number keeps zero padding."""
    out = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"'{part}' is not a number or a range LOW-HIGH")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {part} runs backwards")
        if int(high) - int(low) >= MAX_NODES:
            raise ValueError(f"range {part} names more than {MAX_NODES:,} nodes")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def _expand_host(pattern: str) -> list[str]:
    """One host pattern, brackets anywhere and possibly several: `r[1-2]n[1-2]` -> 4 names."""
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    head, body, rest = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    names, tails = _expand_ranges(body), _expand_host(rest)
    if len(names) * len(tails) > MAX_NODES:  # r[1-1000000]n[1-1000000]: each range is small
        raise ValueError(f"'{pattern}' names more than {MAX_NODES:,} nodes")
    return [head + n + tail for n in names for tail in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in order: `gpu[01-02,07],cpu3` -> gpu01, gpu02, gpu07, cpu3."""
    try:
        hosts = []
        for item in _split_top_level(nodelist.strip()):
            if item:
                hosts += _expand_host(item.strip())
            if len(hosts) > MAX_NODES:
                raise ValueError(f"it names more than {MAX_NODES:,} nodes")
    except ValueError as e:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a SLURM node list: {e}") \
            from None
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no node")
    return hosts


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: the same on every node, without talking to each other."""
    return SLURM_BASE_PORT + int(check_job_id(job_id)) % SLURM_PORT_SPAN


def check_job_id(job_id: str) -> str:
    """SLURM job ids are numbers; this one also names the default run dir, so nothing else."""
    if not re.fullmatch(r"\d{1,20}", job_id):
        raise ConfigError(f"SLURM_JOB_ID={job_id[:40]} is not a job number (digits only)")
    return job_id


def _int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of the variables that is set, as an int (`4(x2)` and `2,2` read as the first)."""
    for name in names:
        value = env.get(name)
        if value:
            match = re.match(r"\d{1,9}", value)
            if not match:
                raise ConfigError(f"{name}={value[:40]} is not a whole number >= 0")
            return int(match.group())
    return None


@dataclass(frozen=True)
class NodePlace:
    """What an environment tells the launcher; None = not known here (flags or defaults decide)."""

    source: str
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    job_id: str | None = None
    gpus_on_node: int | None = None


class TorchElasticEnvironment:
    """Started by torchrun (or another elastic agent): partrain must not start a second one."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env

    def place(self, nproc_per_node: int | None) -> NodePlace:
        raise ConfigError(
            "partrain launch was started by torchrun (TORCHELASTIC_RUN_ID="
            f"{self.env['TORCHELASTIC_RUN_ID']}, LOCAL_RANK={self.env.get('LOCAL_RANK', '?')}): "
            "partrain starts its own elastic agent and one worker per rank, so each torchrun "
            "worker would start a whole job. Run `partrain launch CONFIG --nnodes N "
            "--nproc-per-node G --node-rank R --rdzv-endpoint HOST:PORT` on each node instead "
            "of torchrun")


class SlurmEnvironment:
    """A task of `srun` inside an allocation: the node count, this node's rank, the head node."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        # SLURM_STEP_ID: an srun task, not the batch script or an salloc shell (there the user
        # gives the flags, or runs `srun partrain launch`).
        return all(name in env for name in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_STEP_ID"))

    @property
    def job_id(self) -> str:
        return self.env["SLURM_JOB_ID"]

    @property
    def nnodes(self) -> int:
        names = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        nnodes = _int(self.env, *names)
        if nnodes == 0:
            name = next(n for n in names if self.env.get(n))
            raise ConfigError(f"{name}={self.env[name]} must be at least 1 (the job's nodes)")
        return nnodes if nnodes is not None else len(self.nodes)

    @property
    def node_rank(self) -> int:
        return _int(self.env, "SLURM_NODEID")

    @property
    def nodes(self) -> list[str]:
        names = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        nodelist = next((self.env[n] for n in names if self.env.get(n)), None)
        if nodelist is None:
            raise ConfigError("inside SLURM but SLURM_JOB_NODELIST is not set; give "
                              "--rdzv-endpoint HOST:PORT")
        return expand_nodelist(nodelist)

    @property
    def tasks_per_node(self) -> int:
        per_node = _int(self.env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                        "SLURM_TASKS_PER_NODE")
        tasks = _int(self.env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if tasks is not None:
            per_node = max(per_node or 1, -(-tasks // self.nnodes))
        return per_node or 1

    def place(self, nproc_per_node: int | None) -> NodePlace:
        tasks = self.tasks_per_node
        if tasks > 1:
            workers = nproc_per_node if nproc_per_node is not None else "G"
            raise ConfigError(
                f"SLURM runs {tasks} tasks of `partrain launch` per node (SLURM_NTASKS="
                f"{self.env.get('SLURM_NTASKS', '?')}, SLURM_NNODES={self.nnodes}), and each "
                f"would start {workers} workers itself: a double launch. Run one task per node "
                "(sbatch/srun --ntasks-per-node=1, which `partrain slurm` writes for you); "
                "partrain starts one process per GPU itself")
        return NodePlace(source=f"SLURM job {self.job_id}", nnodes=self.nnodes,
                         node_rank=self.node_rank,
                         rdzv_endpoint=f"{self.nodes[0]}:{slurm_port(self.job_id)}",
                         job_id=self.job_id,
                         gpus_on_node=_int(self.env, "SLURM_GPUS_ON_NODE"))


ENVIRONMENTS = (TorchElasticEnvironment, SlurmEnvironment)
SCONTROL_TIMEOUT_S = 10


def slurm_node_address(endpoint: str, source: str) -> tuple[str, str]:
    """The head node's endpoint as the other nodes reach it: its name where the name resolves,
    else the NodeAddr that SLURM's configuration gives it (`scontrol show node`, as the script
    of `partrain slurm` asks; a site whose NodeName is no host name). Returns it and what it
    came from; the endpoint as it was where scontrol cannot say."""
    import socket
    import subprocess

    host, _, port = endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host, None)
        return endpoint, source
    except (socket.gaierror, UnicodeError):
        pass
    try:
        shown = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True,
                               text=True, timeout=SCONTROL_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return endpoint, source
    addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", shown)
    if addr is None or addr.group(1) == host:
        return endpoint, source
    return f"{addr.group(1)}:{port}", f"{source}, {host}'s NodeAddr in scontrol"


def usable_cores(env: Mapping[str, str] | None = None) -> int:
    """The cores this process may run on, to share out among its ranks: its CPU affinity (what
    srun's binding or a cgroup cpuset left it, fewer than os.cpu_count() shows), and inside a
    SLURM job no more than the step's CPUs on this node (SLURM_CPUS_ON_NODE; with one task per
    node, SLURM_CPUS_PER_TASK too), which hold where the site binds nothing (TaskPlugin=task/none)
    and the task could run on every core of the machine."""
    env = os.environ if env is None else env
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    if "SLURM_JOB_ID" in env:
        for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
            share = env.get(name, "")
            if share.isdigit() and int(share) > 0:
                cores = min(cores, int(share))
    return max(1, cores)


def detect_place(nproc_per_node: int | None, env: Mapping[str, str] | None = None) -> NodePlace:
    """The first environment that detects itself says where this node is; else a plain machine."""
    env = os.environ if env is None else env
    for environment in ENVIRONMENTS:
        if environment.detect(env):
            return environment(env).place(nproc_per_node)
    return NodePlace(source="this machine")

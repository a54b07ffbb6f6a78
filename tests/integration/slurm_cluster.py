"""A real SLURM cluster on this machine for the tests: munged, slurmctld and two slurmd daemons
that emulate the nodes n1 and n2 (Debian's slurmd runs several nodes on one host, each on its own
port), all in a private directory with a private munge key, socket and ports.

The Debian packages are installed when missing (`apt-get install slurmctld slurmd slurm-client
munge`, ~15 s, starts no daemon: there is no systemd), as tests.integration.debian does (the
tests skip only where that cannot work). Every daemon runs in its own session
and is stopped when the test session ends; jobs still queued are cancelled first.

Facts that shaped this: munged runs as the munge user and insists on a socket directory of mode
755 that it owns; a job asking more tasks than CPUs pends forever unless the node claims more
(`SlurmdParameters=config_overrides` lets a node claim CPUs it does not have, and the memory a
job's --mem asks for: RealMemory defaults to 1 MB); without accounting
there is no sacct, so the job's state is read with `scontrol show job`. A requeued job waits
AuthInfo's cred_expire + 1 s before it may start again (default 120 s; 5 is the least SLURM takes),
and then for the main scheduling loop (sched_interval, default 60 s): both are short here.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.integration import debian

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged")
NODES = ("n1", "n2")
NODE_MEMORY_MB = 1000  # what each node claims (config_overrides): a job may ask --mem up to this

SLURM_CONF = """\
ClusterName=partraintest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool-%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node_port}-{node_port_2}] CPUs=2 RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def install() -> None:
    """Install the Debian packages if a binary is missing; raise Unavailable where we cannot."""
    if not all(_which(b) for b in BINARIES):
        debian.install(PACKAGES, "SLURM")


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are free (slurmd's Port=[p-p+1] must be a range)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


class SlurmCluster:
    """The daemons, their directory and the environment that points sbatch/scontrol at them."""

    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="partrain-slurm-"))
        self.base.chmod(0o755)  # munged (user munge) must reach its directory inside
        self.conf = self.base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def _start(self, *command: str, user: str | None = None) -> subprocess.Popen:
        log = open(self.base / f"{Path(command[0]).name}-{len(self.daemons)}.out", "w")
        proc = subprocess.Popen(list(command), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, user=user, group=user)
        self.daemons.append(proc)
        return proc

    def _start_munge(self) -> Path:
        munge_dir = self.base / "munge"
        munge_dir.mkdir(mode=0o755)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for path in (munge_dir, key):
            shutil.chown(path, "munge", "munge")
        sock = munge_dir / "munge.socket"
        self._start(_which("munged"), "--foreground", f"--key-file={key}", f"--socket={sock}",
                    f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
                    f"--seed-file={munge_dir}/munged.seed", user="munge")
        self._wait(lambda: sock.exists(), "munged to create its socket", 20)
        return sock

    def start(self) -> "SlurmCluster":
        sock = self._start_munge()
        node_port = _free_port_pair()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ctld_port = s.getsockname()[1]
        (self.base / "state").mkdir()
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), ctld_port=ctld_port, munge_socket=sock, base=self.base,
            node_port=node_port, node_port_2=node_port + 1, memory_mb=NODE_MEMORY_MB))
        self._start(_which("slurmctld"), "-D", "-c", "-f", str(self.conf))
        for node in NODES:
            self._start(_which("slurmd"), "-D", "-N", node, "-f", str(self.conf))
        self._wait(self._nodes_idle, "both nodes to be idle", 60)
        return self

    def scontrol(self, *args: str) -> str:
        result = subprocess.run([_which("scontrol"), *args], env=self.env, capture_output=True,
                                text=True, timeout=30)
        return result.stdout

    def signal(self, job_id: str, name: str) -> None:
        """`scancel --signal=NAME JOBID`: to the job's steps (srun's tasks), as a site preempts."""
        result = subprocess.run([_which("scancel"), f"--signal={name}", job_id], env=self.env,
                                capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"scancel --signal={name} {job_id}: {result.stderr.strip()}")

    def _nodes_idle(self) -> bool:
        states = self.scontrol("show", "nodes", "-o")
        return states.count("State=IDLE") == len(NODES)

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) while waiting "
                                       f"for {what}; logs in {self.base}:\n{self.logs()}")
            time.sleep(0.3)
        raise RuntimeError(f"timed out waiting for {what}; logs in {self.base}:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.base.rglob("*.log")) + sorted(self.base.glob("*.out")))

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, ...)."""
        fields = {}
        for item in self.scontrol("show", "job", "-o", job_id).split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                        "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not finished in {timeout} s: {self.job(job_id)}")

    def stop(self) -> None:
        """Cancel what is left, stop slurmd before slurmctld and munged last; nothing outlives."""
        if self.conf.exists():
            subprocess.run([_which("scancel"), "--full", "--user=root"], env=self.env,
                           capture_output=True, timeout=30)
            time.sleep(1)
        for proc in reversed(self.daemons):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)

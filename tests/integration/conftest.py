"""Run the `partrain` CLI as a user does: a subprocess, in a process group of its own that is
killed when the test ends, so no launcher or worker outlives a test."""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ABORT_MESSAGE = "terminate called without an active exception"


class CLI:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict | None = None, prefix: tuple[str, ...] = (),
              cwd: Path | None = None) -> subprocess.Popen:
        """prefix: a command that runs partrain, e.g. ("ip", "netns", "exec", NS); cwd: the
        directory it is typed in (this checkout's code is imported from any)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if cwd is not None:
            full_env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(__file__).parents[2]), *filter(None, [full_env.get("PYTHONPATH")])])
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "partrain", *args], env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, cwd=cwd)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, env: dict | None = None, timeout: float = 240,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        proc = self.start(*args, env=env, cwd=cwd)
        stdout, stderr = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def kill_all(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture
def cli():
    runner = CLI()
    yield runner
    runner.kill_all()


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) from metrics.jsonl, strict JSON (no NaN token); a skipped
    step's null loss or grad_norm (not finite) read back as NaN, for the tests' finiteness checks."""
    def nan_token(token):
        raise AssertionError(f"metrics.jsonl holds {token}, which is not JSON")

    lines = [json.loads(line, parse_constant=nan_token)
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        for key in ("loss", "grad_norm"):
            if key in record and record[key] is None:
                record[key] = math.nan
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line or environment contains text (a run dir): what a run left behind.
    A spawned rank names its run dir in its command line, a forked one (the rank server's fork,
    launcher.start_method=forkserver) in its environment (PARTRAIN_RUN_DIR), as does the server."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = (entry / "environ").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, UnicodeDecodeError):
                continue
            if text in cmdline or f"PARTRAIN_RUN_DIR={text} " in environ + " ":
                pids.append(int(entry.name))
    return pids


def ranks_of(run_dir: Path) -> list[int]:
    """The running ranks of a run: spawned (`python -m partrain.train RUN_DIR`) or forked (a
    child of the rank server, multiprocessing's forkserver, with the run dir in its environment)."""
    found = []
    for pid in running(processes_mentioning(str(run_dir))):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            ppid = _parent(pid)
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
            grandparent = Path(f"/proc/{_parent(ppid)}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        # A forked rank's parent is the server (the same command line, forked) and the server's
        # is the launcher (another): a data loader worker of a forked rank is one fork deeper.
        forked = b"multiprocessing.forkserver" in cmdline and cmdline == parent != grandparent
        if forked or b"-m\0partrain.train\0" in cmdline:
            found.append(pid)
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def running(pids) -> set[int]:
    """Those of pids still running: a zombie has ended and only waits for its parent."""
    alive = set()
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" not in status:
            alive.add(pid)
    return alive


def survivors(find, within_s: float) -> set[int]:
    """The processes find() names that still run after within_s seconds (or none, as soon as
    none does). Those are then killed: a failed test must not leave them training."""
    deadline = time.monotonic() + within_s
    while (left := running(find())) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended since
            pass
    return left


def assert_no_abort(run_dir: Path, *outputs: str) -> None:
    """No rank ended with gloo's teardown abort (the clean-exit rule)."""
    for log in (run_dir / "logs").glob("rank-*.log"):
        assert ABORT_MESSAGE not in log.read_text(), log
    for text in outputs:
        assert ABORT_MESSAGE not in text


def _lowest_priority() -> None:
    """nice 19 for this process and for its session's autogroup: with the kernel's autogroups
    (sched_autogroup_enabled) CPU time is shared between sessions first and nice counts only
    inside one, and the build and each test's launches are sessions of their own. Measured: at
    nice 19 alone the build's compilers took 25% of a core each beside a test's ranks."""
    os.nice(19)
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass  # no autogroups here: nice alone does it


class OpBuild:
    """`python -m tests.integration.op_build WHAT` in a process group of its own, its output in a
    file; `stop()` asks it to end (SIGTERM: it releases torch's lock on the op's folder) and then
    kills what is left of its session, so that no compiler outlives the test session."""

    def __init__(self, what: str, background: bool = False):
        handle, log = tempfile.mkstemp(prefix=f"partrain-op-build-{what}-", suffix=".log")
        os.close(handle)
        self.log = Path(log)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.op_build", what],
                cwd=Path(__file__).parents[2], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_lowest_priority if background else None)

    def wait(self, timeout: float = 1200) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        except BaseException:  # a timeout, ^C: stop the build, then let it raise
            self.stop()
            raise
        output = self.log.read_text()
        self.log.unlink(missing_ok=True)
        return code, output

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        # ninja runs each compiler in a process group of its own: all of the session goes
        for pid in _session_members(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.unlink(missing_ok=True)


def _session_members(sid: int) -> list[int]:
    """The processes of session `sid` (start_new_session made one for the build)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


# The builds start in the background at the end of collection, at the lowest CPU priority, when
# the collected tests will want them (tests/integration/op_build.py says why): the fixtures wait.
_BUILDS: dict[str, OpBuild] = {}


def pytest_collection_finish(session):
    def wants(item, fixture):
        return fixture in getattr(item, "fixturenames", ())

    if any(wants(item, "deepspeed_cpu_adam") for item in session.items):
        _BUILDS["cpu_adam"] = OpBuild("cpu_adam", background=True)  # the offload rows
    if any(wants(item, "deepspeed_aio") for item in session.items):
        _BUILDS["aio"] = OpBuild("aio", background=True)


def pytest_sessionfinish(session, exitstatus):
    for build in _BUILDS.values():  # still running: a test failed first under -x, or ^C
        build.stop()


def _built(what: str, timeout: float) -> tuple[int, str]:
    if what not in _BUILDS:  # not started at collection: build now
        _BUILDS[what] = OpBuild(what)
    return _BUILDS[what].wait(timeout)


@pytest.fixture(scope="session")
def deepspeed_cpu_adam():
    """ZeRO-Offload's CPU Adam, DeepSpeed's one JIT-built op a run that offloads to the host
    needs, in the shared extension cache (tests/integration/op_build.py). Cached, this takes
    seconds. ZeRO without offload builds nothing and needs no fixture."""
    code, output = _built("cpu_adam", timeout=600)
    assert code == 0, output[-3000:]
    return output


@pytest.fixture(scope="session")
def deepspeed_aio(deepspeed_cpu_adam):
    """DeepSpeed's async_io op in the shared extension cache, libaio-dev installed first where it
    is missing (about 150 s on 2 cores from nothing, at full speed once the suite waits on it)."""
    from tests.integration.op_build import NO_LIBAIO

    code, output = _built("aio", timeout=1200)
    if code == NO_LIBAIO:
        pytest.skip(output.strip().splitlines()[-1])
    assert code == 0, f"DeepSpeed's async_io op did not build (exit {code}):\n{output[-3000:]}"
    return output


# Layout parity (docs/design.md) for the multi-node tests (test_multinode, test_slurm): the same rule
# and reference run as test_parity.py.
PARITY_STEPS = 10
PARITY_RTOL = 1e-4
# The evaluation at the last step reads one batch (of 4 by default): no parity check reads it.
# Rows of 64 tokens (the quickstart's are 256): every layout's split (cp4's ring takes 8 chunks of
# 8) still divides them, and a step costs a quarter of the compute (a dp2 x tp2 launch took 13 s of
# CPU instead of 19 s). The blend rows (test_parity.py) keep 256: several documents in a row.
PARITY_COMMON = ("launcher.device=cpu", f"train.max_steps={PARITY_STEPS}", "train.eval_every=0",
                 "train.eval_batches=1", "train.global_batch_size=16", "train.seq_len=64")
REFERENCE = ("parallel.dp=1", "--nproc-per-node", "1", "train.micro_batch_size=16")


def assert_parity(steps, reference, label):
    assert len(steps) == PARITY_STEPS, f"{label}: {len(steps)} steps"
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for got, ref in zip(steps, reference):
        for key in worst:
            rel = abs(got[key] - ref[key]) / abs(ref[key])
            assert rel <= PARITY_RTOL, (f"{label}: step {got['step']} {key} {got[key]} vs "
                                        f"{ref[key]} (rel {rel:.2e})")
            worst[key] = max(worst[key], rel)
    # Shown with `pytest -s`: the measured gap, for notes and for spotting drift before it fails.
    print(f"parity {label}: max relative gap loss {worst['loss']:.1e}, grad_norm {worst['grad_norm']:.1e}")
    # The run really trained: a parity test on a flat loss would prove nothing.
    assert steps[-1]["loss"] < steps[0]["loss"]


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
    """The single-process run, made once for the session: its steps and its run dir, which holds
    step 5's checkpoint (the source of a resume on another layout in test_parity.py)."""
    cli = CLI()
    run_dir = tmp_path_factory.mktemp("ref") / "dp1"
    try:
        res = cli.run("launch", *PARITY_COMMON, *REFERENCE, "checkpoint.every=5", "--run-dir",
                      str(run_dir))
    finally:
        cli.kill_all()
    assert res.returncode == 0, res.stderr
    steps, _ = read_metrics(run_dir)
    assert len(steps) == PARITY_STEPS
    return steps, run_dir


@pytest.fixture(scope="session")
def single_process_reference(single_process_run):
    """The single-process run's steps."""
    return single_process_run[0]


# The layout keys a resume on another layout sets (a resume keeps what it is not told): every
# degree, so nothing of the old layout lingers.
LAYOUT_RESET = ("parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1",
                "parallel.cp_method=ring", "parallel.ep=1", "parallel.zero_stage=0",
                "parallel.zero_backend=deepspeed", "parallel.offload_params=none",
                "parallel.dp_replicate=1",
                "parallel.sequence_parallel=false", "parallel.pp_schedule=1f1b",
                "parallel.pp_virtual_stages=1")


def resume_layout(flags) -> tuple[str, ...]:
    """Overrides for `launch --resume RUN_DIR` onto the layout `flags` (which win over the reset)."""
    keys = {f.split("=")[0] for f in flags if "=" in f}
    return (*[r for r in LAYOUT_RESET if r.split("=")[0] not in keys], *flags)

"""Run the `partrain` CLI as a user does: a subprocess, in a process group of its own that is
killed when the test ends, so no launcher or worker outlives a test."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ABORT_MESSAGE = "terminate called without an active exception"


class CLI:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "partrain", *args], env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
        proc = self.start(*args, env=env)
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
    """(step records, eval records) from metrics.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains text (a run dir): what a run left behind."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry.name))
    return pids


def assert_no_abort(run_dir: Path, *outputs: str) -> None:
    """No rank ended with gloo's teardown abort (the clean-exit rule)."""
    for log in (run_dir / "logs").glob("rank-*.log"):
        assert ABORT_MESSAGE not in log.read_text(), log
    for text in outputs:
        assert ABORT_MESSAGE not in text


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU ops (the shared-memory collective, ZeRO-Offload's CPU Adam), built once in
    the one extension cache that every run shares (TORCH_EXTENSIONS_DIR, default
    ~/.cache/torch_extensions): on a fresh machine each takes 20-100 s on 2 cores, and ranks
    building the same op at once would only wait for each other. Cached, this takes seconds."""
    code = ("from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder\n"
            "import time\n"
            "for b in (ShareMemCommBuilder(), CPUAdamBuilder()):\n"
            "    t = time.perf_counter(); b.load(verbose=False)\n"
            "    print(f'{b.name}: {time.perf_counter() - t:.1f} s')\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout

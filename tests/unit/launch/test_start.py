"""What a start says and freezes before any process starts (launch/start.py): a ZeRO run on CPU
that offloads names the DeepSpeed C++ ops it will build first (tens of seconds each on a fresh
machine, in silence before) and where they are cached, and says nothing once they are; one that
does not offload builds none (DeepSpeed's shared-memory all-reduce is not built:
parallel/zero.py); --max-restarts is frozen in the run dir as launcher.max_restarts; a Ctrl-C
during the launcher's torch import is held to its end."""

import os
import signal
import time
from pathlib import Path

import pytest

ZERO = ["launch", "--dry-run", "launcher.device=cpu", "parallel.dp=2", "parallel.zero_stage=1",
        "--run-dir", "run"]


def _cache(monkeypatch, tmp_path, given: bool) -> None:
    """The extension cache in tmp_path: named by TORCH_EXTENSIONS_DIR, or torch's default under
    XDG_CACHE_HOME."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    if given:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _as_torch_builds(op: str) -> Path:
    """Where torch's own JIT build puts op's library (its build directory, made here)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op, verbose=False)) / f"{op}.so"


@pytest.mark.parametrize("given", [True, False], ids=["TORCH_EXTENSIONS_DIR", "default"])
@pytest.mark.parametrize("offload, ops", [("cpu", ["cpu_adam"]),
                                          ("nvme", ["cpu_adam", "async_io"])])
def test_ops_to_build_are_said_and_cached_ones_are_not(run_main, tmp_path, monkeypatch, offload,
                                                       ops, given):
    monkeypatch.chdir(tmp_path)
    _cache(monkeypatch, tmp_path, given)
    argv = [*ZERO, f"parallel.offload_optimizer={offload}",
            *([f"parallel.offload_nvme_path={tmp_path}", "parallel.zero_stage=3"]
              if offload == "nvme" else [])]
    said = " ".join(run_main(*argv).stdout.split())
    assert "deepspeed: building its C++ ops on first use" in said, said
    for op in ops:
        assert op in said
    assert "shm_comm" not in said
    assert f"cached in {_as_torch_builds(ops[0]).parents[1]} " in said, said
    for op in ops:  # as torch's JIT build leaves them
        _as_torch_builds(op).write_bytes(b"\x7fELF")
    result = run_main(*argv)
    assert result.code == 0 and "building its C++ ops" not in result.stdout, result.stdout


@pytest.mark.parametrize("layout", [("parallel.dp=2",), ZERO[3:5]], ids=["ddp", "zero1"])
def test_no_offload_builds_nothing(run_main, tmp_path, monkeypatch, layout):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    result = run_main("launch", "--dry-run", "launcher.device=cpu", *layout, "--run-dir", "run")
    assert result.code == 0 and "deepspeed" not in result.stdout, result.stdout


def test_max_restarts_flag_is_frozen_in_the_run_dir(run_main, tmp_path, monkeypatch):
    """--max-restarts (launch and slurm) is launcher.max_restarts: the sbatch script's
    `partrain launch --run-dir` reads it from the frozen config, so the job restarts in-job."""
    monkeypatch.chdir(tmp_path)
    result = run_main("slurm", "--nodes", "1", "--nproc-per-node", "2", "--max-restarts", "3",
                      "launcher.device=cpu", "--dry-run", "--run-dir", "run")
    assert result.code == 0, result.stderr
    assert "  max_restarts: 3\n" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_ctrl_c_during_the_launchers_import_is_held_to_its_end():
    """The launcher's torch import runs in interrupts_held(): a Ctrl-C inside it is raised when it
    ends (a library's bare `except:` inside cannot take it), also with another thread running
    that does not block SIGINT (numpy's OpenBLAS starts one; a blocked mask let the signal
    through there)."""
    import threading

    from partrain.launch.start import interrupts_held

    other = threading.Thread(target=threading.Event().wait, args=(1,), daemon=True)
    other.start()
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # Python runs a pending handler between bytecodes: it ran
            except:  # noqa: E722 (the bare except a library may have)
                pytest.fail("the Ctrl-C was raised inside the block")
            reached_the_end = True
    assert reached_the_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_held():  # no Ctrl-C: nothing raised
        pass


def test_an_ignored_ctrl_c_stays_ignored_through_the_import():
    """A launcher started with SIGINT ignored (a background job: `partrain launch ... &`) keeps
    ignoring it through the block: nothing is held, and nothing raised at its end."""
    from partrain.launch.start import interrupts_held

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)

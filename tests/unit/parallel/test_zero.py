"""The DeepSpeed config partrain derives (partrain/config/deepspeed.py), raw keys over it, and the
ZeRO memory formulas that `plan` prints and scripts/bench_zero.py measures against."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from partrain.config.deepspeed import deepspeed_config
from partrain.errors import ConfigError
from partrain.plan.costs import zero_memory
from tests.unit.helpers import validated


def _ds(*overrides, on_cuda=False, nproc=None):
    cfg, _, _ = validated("parallel.zero_stage=1", *overrides, nproc=nproc)
    return deepspeed_config(cfg, on_cuda=on_cuda)


def test_derived_from_partrain_keys():
    ds = _ds("parallel.zero_stage=2", "train.global_batch_size=32", "train.micro_batch_size=4",
             "optim.lr=0.01", "optim.grad_clip=0.5", "optim.beta2=0.99", "optim.weight_decay=0.2")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"]) == (32, 4, 4)  # 32 = 4 * 4 micro-batches * dp 2
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["type"] == "AdamW"
    assert ds["optimizer"]["params"]["lr"] == 0.01
    assert ds["optimizer"]["params"]["betas"] == [0.9, 0.99]
    assert ds["optimizer"]["params"]["weight_decay"] == 0.2
    # partrain owns accumulation and the schedule.
    assert ds["managed_gradient_accumulation"] is False and "scheduler" not in ds


@pytest.mark.parametrize("dtype, on_cuda, bf16, fp16", [
    ("auto", False, False, False), ("auto", True, True, False), ("bf16", False, True, False),
    ("fp16", True, False, True), ("fp32", True, False, False)])
def test_dtype(dtype, on_cuda, bf16, fp16):
    ds = _ds(f"train.dtype={dtype}", on_cuda=on_cuda)
    assert (ds["bf16"]["enabled"], ds["fp16"]["enabled"]) == (bf16, fp16)
    assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling when fp16 is on


def test_offload_and_optimizer_choice():
    plain = _ds("parallel.zero_stage=2")
    assert plain["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert plain["optimizer"]["params"]["torch_adam"] is True  # no 30 s JIT build on a CPU run
    off = _ds("parallel.zero_stage=3", "parallel.offload_optimizer=cpu",
              "parallel.offload_params=nvme", "parallel.offload_nvme_path=/local/nvme")
    zero = off["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": False,
                                     "nvme_path": "/local/nvme"}
    assert off["optimizer"]["params"]["torch_adam"] is False  # ZeRO-Offload's CPU Adam
    # On CUDA: torch's fused AdamW (DeepSpeed's FusedAdam would need nvcc for a JIT build), and
    # offload through pinned host memory.
    cuda = _ds("parallel.zero_stage=2", on_cuda=True)["optimizer"]["params"]
    assert cuda["torch_adam"] is True and cuda["fused"] is True
    cuda_off = _ds("parallel.zero_stage=2", "parallel.offload_optimizer=cpu", on_cuda=True)
    assert cuda_off["optimizer"]["params"]["torch_adam"] is False
    assert "fused" not in cuda_off["optimizer"]["params"]
    assert cuda_off["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cuda_off["zero_optimization"]["offload_param"]["pin_memory"] is False  # device none


def test_buckets_follow_the_hidden_size():
    ds = _ds("parallel.zero_stage=3", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=2")
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 256 ** 2
    assert zero["stage3_param_persistence_threshold"] == 2560


def test_raw_keys_pass_through_and_override_defaults():
    ds = _ds("+parallel.deepspeed.zero_optimization.reduce_bucket_size=1000",
             "+parallel.deepspeed.optimizer.params.amsgrad=true",
             "+parallel.deepspeed.train_batch_size=16")  # equal to the derived: no conflict
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage"] == 1  # siblings kept
    assert ds["optimizer"]["params"]["amsgrad"] is True and ds["optimizer"]["params"]["lr"] == 0.003


def test_contradicting_raw_key_names_both():
    with pytest.raises(ConfigError) as info:
        _ds("+parallel.deepspeed.zero_optimization.stage=3")
    message = str(info.value)
    assert "parallel.deepspeed.zero_optimization.stage=3" in message
    assert "derived zero_optimization.stage=1" in message and "parallel.zero_stage" in message


GB = 1e9


@pytest.mark.parametrize("stage, total_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figures_in_mixed_precision(stage, total_gb):
    """ZeRO paper, Figure 1: a 7.5B model on 64 GPUs. Stage 0 is partrain's DDP (fp32 weights,
    AdamW moments: also 16 bytes per parameter)."""
    memory = zero_memory(stage, 7.5e9, 64, "bf16")
    assert round(memory["total"] / GB, 1) == total_gb


@pytest.mark.parametrize("stage, formula, per_param", [
    (0, "16Ψ", 16), (1, "8Ψ + 12Ψ/Nd", 8 + 12 / 4), (2, "4Ψ + 16Ψ/Nd", 4 + 16 / 4),
    (3, "20Ψ/Nd", 20 / 4)])
def test_fp32_constants(stage, formula, per_param):
    memory = zero_memory(stage, 1000, 4, "fp32")
    assert memory["formula"] == formula
    assert memory["total"] == pytest.approx(1000 * per_param)
    assert memory["total"] == memory["param_bytes"] + memory["grad_bytes"] + memory["optim_bytes"]


def test_plan_memory_json(run_main):
    result = run_main("plan", "parallel.zero_stage=2", "--json")
    assert result.code == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    psi = memory["params_per_rank"]
    assert memory["zero_stage"] == 2 and memory["dp"] == 2 and memory["formula"] == "4Ψ + 16Ψ/Nd"
    assert memory["grad_bytes"] == 4 * psi / 2 and memory["param_bytes"] == 4 * psi
    assert sorted(memory["total_by_stage"].values(), reverse=True) == list(
        memory["total_by_stage"].values())  # each stage saves more


def test_show_prints_the_deepspeed_json_and_stays_yaml(run_main):
    result = run_main("show", "parallel.zero_stage=3", "parallel.offload_optimizer=cpu")
    assert result.code == 0, result.stderr
    assert yaml.safe_load(result.stdout)["parallel"]["zero_stage"] == 3  # comments are ignored
    block = [line[2:] for line in result.stdout.splitlines() if line.startswith("# ")][1:]
    ds = json.loads("\n".join(block))
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "DeepSpeed" not in run_main("show").stdout  # stage 0 runs DDP: no DeepSpeed config


def test_nvme_problems_name_the_key_the_value_and_what_to_do(tmp_path, monkeypatch):
    """What a rank says before DeepSpeed starts when its node cannot offload to nvme. libaio's
    absence is mocked (AsyncIOBuilder.is_compatible, DeepSpeed's own compile-and-link test):
    this machine may have it, and tests/integration/test_nvme_offload.py runs the real op."""
    from partrain.parallel.nvme import nvme_problem

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    def cfg(path, **offload):
        return validated("parallel.zero_stage=3", f"parallel.offload_nvme_path={path}",
                         *(f"parallel.{k}={v}" for k, v in offload.items()))[0].parallel

    assert nvme_problem(cfg("/x", offload_optimizer="cpu"), tmp_path / "unused") is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    said = nvme_problem(cfg(blocker, offload_params="nvme"), blocker / "run-1234abcd")
    assert said.startswith(f"parallel.offload_params=nvme: parallel.offload_nvme_path={blocker} "
                           "(this run's folder in it, run-1234abcd) cannot be made or written on ")
    assert "(Not a directory); point it at a directory on a local NVMe drive" in said

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    swap = tmp_path / "new" / "swap"
    said = nvme_problem(cfg(swap.parent, offload_optimizer="nvme"), swap)
    assert swap.is_dir()  # made, and a file could be written in it
    assert said.startswith("parallel.offload_optimizer=nvme needs DeepSpeed's async_io op, "
                           "which needs libaio's headers and library")
    assert "apt-get install libaio-dev" in said and "(=cpu)" in said
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: True)
    assert nvme_problem(cfg(swap.parent, offload_optimizer="nvme"), swap) is None


def test_each_run_swaps_in_a_folder_of_its_own(tmp_path):
    """Two runs given one offload_nvme_path never share swap files (DeepSpeed names them by rank
    and tensor alone); the same run (a restart, a resume) finds its folder again."""
    from partrain.parallel.nvme import run_swap_dir

    a, b = tmp_path / "one" / "runs" / "llama", tmp_path / "two" / "runs" / "llama"
    folder = run_swap_dir("/nvme", a)
    assert folder.parent == Path("/nvme") and folder.name.startswith("llama-")
    assert run_swap_dir("/nvme", a) == folder == run_swap_dir("/nvme", a / ".." / "llama")
    assert run_swap_dir("/nvme", b) != folder  # the same name elsewhere: another folder


def test_a_filesystem_without_direct_io_is_refused(tmp_path):
    """DeepSpeed's async_io writes its swap files with O_DIRECT: a folder on a filesystem without
    it (ramfs here, mounted for the test; tmpfs before Linux 6.6) passed an ordinary write and
    then failed inside DeepSpeed. Needs root to mount."""
    import subprocess

    from partrain.parallel.nvme import nvme_problem

    ramfs = tmp_path / "ramfs"
    ramfs.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(ramfs)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.decode().strip()}")
    try:
        cfg = validated("parallel.zero_stage=3", "parallel.offload_optimizer=nvme",
                        f"parallel.offload_nvme_path={ramfs}")[0].parallel
        said = nvme_problem(cfg, ramfs / "run-1234abcd")
    finally:
        subprocess.run(["umount", str(ramfs)], check=True)
    assert said.startswith(f"parallel.offload_optimizer=nvme: parallel.offload_nvme_path={ramfs} "
                           "(this run's folder in it, run-1234abcd) is on a filesystem of ")
    assert "without direct I/O (O_DIRECT)" in said


@pytest.mark.parametrize("given, wanted", [
    ("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("10.0f+PTX", "10.0+PTX"), ("8.6 9.0a", "8.6;9.0"),
    ("9.0", "9.0"), ("8.0;9.0+PTX", "8.0;9.0+PTX")])
def test_arch_list_in_the_form_deepspeed_parses(given, wanted):
    from partrain.parallel.zero import ds_arch_list

    assert ds_arch_list(given) == wanted


def test_a_hopper_image_arch_list_builds_deepspeed_ops(monkeypatch):
    """The H200's PyTorch image sets TORCH_CUDA_ARCH_LIST=9.0a, and DeepSpeed 0.19's JIT builder
    (here its real async_io one, the nvme offload's op) stopped on it: `invalid literal for int()
    ... '0a'` (seen on the device, issue 33). After partrain's GPU-rank setup it reads the list.
    No GPU is needed: with the list given, the builder probes none."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    from partrain.parallel.zero import deepspeed_accelerator

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;8.0")
    builder = AsyncIOBuilder()
    builder.jit_mode = True
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    deepspeed_accelerator("cuda")
    assert builder.compute_capability_args() == []  # JIT: torch makes the flags from the list
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"


def test_zero_on_cpu_builds_no_shared_memory_collective(monkeypatch):
    """DeepSpeed's comm layer on CPU builds (JIT, about 20 s on 2 cores the first time) and sets up
    its shared-memory all-reduce at every start, for its inference path only. partrain marks it
    incompatible before deepspeed.initialize: DeepSpeed's own build_shm_op then builds nothing.
    (A whole ZeRO run with an empty extension cache: tests/integration/test_parity.py's rows.)"""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    from partrain.parallel.zero import SHM_COMM_OP, without_inference_collective

    compatible = deepspeed.ops.__compatible_ops__
    assert compatible.get(SHM_COMM_OP), compatible  # DeepSpeed would build it here
    monkeypatch.setitem(compatible, SHM_COMM_OP, True)  # put back after the test
    monkeypatch.setattr(ShareMemCommBuilder, "load", lambda *a, **k: pytest.fail("built"))
    without_inference_collective()
    assert build_shm_op() is None


def test_fp16_loss_scaler_state_goes_through_a_checkpoints_meta(monkeypatch):
    """DeepSpeed's real DynamicLossScaler, in a stand-in engine and ZeRO optimizer (DeepSpeed
    trains fp16 on CUDA only, not on this CPU): the scale a run reached, its iteration count and
    hysteresis survive meta.json (JSON) into a fresh scaler, which then moves as the saved one
    does. Without fp16 nothing is saved."""
    import json
    from types import SimpleNamespace

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    # update_scale asks deepspeed.comm for the rank only to log an overflow on rank 0.
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a: 0)

    from partrain.parallel.zero import ZeroBackend

    def backend(fp16=True):
        scaler = DynamicLossScaler(init_scale=2 ** 16, scale_window=4, min_scale=1,
                                   delayed_shift=2, consecutive_hysteresis=False)
        engine = SimpleNamespace(module=torch.nn.Linear(2, 2), fp16_enabled=lambda: fp16)
        optimizer = SimpleNamespace(optimizer=SimpleNamespace(step=lambda: None),
                                    loss_scaler=scaler)
        return ZeroBackend(engine, optimizer), scaler

    ran, scaler = backend()
    for overflow in (True, True, True, False, False):
        scaler.update_scale(overflow)
    meta = json.loads(json.dumps(ran.scaler_state()))
    assert meta["loss_scaler"]["cur_scale"] == 2.0 ** 14 and meta["loss_scaler"]["cur_iter"] == 5
    resumed, fresh = backend()
    resumed.restore_scaler(meta)
    for overflow in (False, False, False, True):
        scaler.update_scale(overflow)
        fresh.update_scale(overflow)
        assert (fresh.cur_scale, fresh.cur_hysteresis) == (scaler.cur_scale, scaler.cur_hysteresis)
    assert scaler.cur_scale == 2.0 ** 15  # it grew once after the window, in both
    assert backend(fp16=False)[0].scaler_state() == {}

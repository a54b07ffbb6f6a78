"""The time model prices a layout as partrain runs it (partrain/plan/time_model.py): the
compute dtype's peak, where each group's ranks land on the nodes, which ranks reduce which
gradients, and how the blocks are split over the pipeline."""

import dataclasses

import pytest

from partrain.plan.hardware import PRESETS, load_hardware
from partrain.plan.time_model import Layout, step_time
from tests.unit.helpers import compose

H100 = PRESETS["H100-SXM"]


def _time(model="llama-7b", gbs=64, seq=4096, hw=H100, low_precision=True, **layout):
    cfg = compose(f"model={model}", "launcher.device=cuda")
    return step_time(cfg.model, Layout(**layout), gbs, seq, hw, low_precision=low_precision)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fp32_gemms_run_at_the_fp32_peak_not_the_tensor_cores(name):
    # partrain never enables TF32: an fp32 GEMM runs on the CUDA cores, at the datasheet's fp32
    # peak; the GEMM efficiency (and its thin-GEMM factor) is the same fraction of it.
    hw = PRESETS[name]
    kw = {"gbs": 64, "dp": 8, "micro_batch_size": 1, "hw": hw}
    bf16, fp32 = _time(**kw), _time(low_precision=False, **kw)
    ratio = hw.peak_flops / hw.fp32_peak_flops
    assert ratio > 5  # the tensor cores' bf16 peak is many times the CUDA cores' fp32 one
    for part in ("gemm_s", "attention_s"):
        assert fp32["compute_parts"][part] == pytest.approx(ratio * bf16["compute_parts"][part])
    # fp32 elements are twice bf16's bytes through memory
    assert fp32["compute_parts"]["elementwise_s"] > bf16["compute_parts"]["elementwise_s"]
    # MFU stays against the bf16 peak, as a run reports it: it falls with the step
    assert fp32["mfu"] == pytest.approx(bf16["mfu"] * bf16["step_s"] / fp32["step_s"])
    assert fp32["step_s"] > 0.8 * ratio * bf16["compute_s"]


def test_a_hardware_file_gives_its_fp32_peak_or_gets_the_h100s_ratio(tmp_path):
    base = "gpus_per_node: 4\nmemory_gib: 48\npeak_tflops: 362\nintra_node_gbps: 32\n" \
           "inter_node_gbps: 12.5\n"
    given, absent = tmp_path / "given.yaml", tmp_path / "absent.yaml"
    given.write_text(base + "fp32_tflops: 91.6\n")
    absent.write_text(base)
    assert load_hardware(str(given)).fp32_peak_flops == 91.6e12
    h100 = PRESETS["H100-SXM"]
    assert load_hardware(str(absent)).fp32_peak_flops == pytest.approx(
        362e12 * h100.fp32_peak_flops / h100.peak_flops)
    assert dataclasses.replace(h100, fp32_tflops=0).fp32_peak_flops == \
        pytest.approx(h100.fp32_peak_flops)

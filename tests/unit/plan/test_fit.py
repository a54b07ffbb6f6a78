"""`partrain plan` tells the truth (issue 29): every stage's predicted peak against the GPU's
memory with the fixes that would fit (partrain/plan/fit.py), `launch`'s refusal on CUDA of a
layout the memory model says cannot fit, the shipped recipes on their hardware, and the price of
a given layout by the search's own time model."""

import json
import re

import pytest

from partrain.config.paths import recipes_dir
from partrain.launch import preflight
from partrain.plan.fit import FLOAT8_UNPRICED, check_fit, layout_of, price, stage_peaks, target
from partrain.plan.hardware import PRESETS, load_hardware
from partrain.plan.memory_model import MODEL_ERROR, USABLE_FRACTION
from partrain.plan.time_model import step_time
from tests.unit.helpers import one_line, resolved

H100 = PRESETS["H100-SXM"]
GIB = 2**30
RECIPES = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
# The recipe as it shipped before issue 29: 8 sequences of 4096 tokens per micro-batch.
UNFIT = ("llama-1b-dp8", "train.micro_batch_size=8")


def intended_hardware(name: str):
    """A recipe's GPUs: a `# hardware: NAME` line in it, else an H100-SXM (80 GB)."""
    text = (recipes_dir() / f"{name}.yaml").read_text()
    found = re.search(r"^# hardware: (\S+)", text, re.MULTILINE)
    return load_hardware(found.group(1)) if found else H100


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_fits_its_hardware(name):
    cfg, world, _ = resolved(config=name)
    if cfg.launcher.device == "cpu":
        pytest.skip(f"{name} is meant for CPU (launcher.device=cpu): no GPU memory to fit")
    hw = intended_hardware(name)
    fit = check_fit(cfg, world, hw.memory_bytes, hw.name)
    over = [f"pp rank {s['pp_rank']}: {s['peak_bytes'] / GIB:.1f} GiB" for s in fit["stages"]
            if not s["fits"]]
    assert fit["fits"], f"{name} on {hw.name}: {over} over {fit['usable_bytes'] / GIB:.1f} GiB"


def test_the_old_llama_1b_dp8_does_not_fit_and_the_fixes_do(run_main):
    result = run_main("plan", UNFIT[0], UNFIT[1], "--json")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    fit = plan["fit"]
    peak = plan["memory_per_stage"][0]["total"]
    assert [s["peak_bytes"] for s in fit["stages"]] == [peak]
    assert peak > USABLE_FRACTION * H100.memory_bytes == fit["usable_bytes"]
    assert not fit["fits"] and fit["certain_oom"] == (peak > (1 + MODEL_ERROR) * H100.memory_bytes)
    assert any(w.startswith("pp rank 0 (ranks 0-7): predicted peak") for w in plan["warnings"])
    fixes = fit["fixes"]
    assert fixes and all(f["peak_bytes"] <= fit["usable_bytes"] for f in fixes)
    speeds = [f["tokens_per_s_per_gpu"] for f in fixes]
    assert speeds == sorted(speeds, reverse=True)  # cheapest first
    # Each fix is priced by the memory model: the plan of the config with it says the same.
    for fix in fixes[:2]:
        keys = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in fix["overrides"].items()]
        cfg, _, _ = resolved(*keys, UNFIT[1], config=UNFIT[0]) if "train.micro_batch_size" \
            not in fix["overrides"] else resolved(*keys, config=UNFIT[0])
        assert max(s["total"] for s in stage_peaks(cfg)) == pytest.approx(fix["peak_bytes"])
        assert f"{fix['label']}: {fix['peak_bytes'] / GIB:,.1f} GiB" in " ".join(plan["warnings"])
    # The smaller micro-batch keeps the global batch.
    mb = [f for f in fixes if "train.micro_batch_size" in f["overrides"]]
    assert mb and "micro-batches" in mb[0]["label"]


def test_plan_hardware_prices_the_layout_by_the_time_model(run_main):
    result = run_main("plan", "llama-7b-tp4-pp2", "--hardware", "h200", "--json")
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    t = plan["time"]
    cfg, world, _ = resolved(config="llama-7b-tp4-pp2")
    hw = target(PRESETS["H200"], world)
    expected = step_time(cfg.model, layout_of(cfg), cfg.train.global_batch_size,
                         cfg.train.seq_len, hw)
    assert t["step_s"] == pytest.approx(expected["step_s"])
    assert t["tokens_per_s_per_job"] == pytest.approx(expected["tokens_per_s"])
    assert t["tokens_per_s_per_gpu"] * world.size == pytest.approx(t["tokens_per_s_per_job"])
    assert (t["hardware"], t["gpus"], t["hardware_source"]) == ("H200", 32, "--hardware")
    assert plan["fit"]["device_bytes"] == PRESETS["H200"].memory_bytes
    text = one_line(run_main("plan", "llama-7b-tp4-pp2", "--hardware", "h200").stdout)
    assert f"{t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU" in text
    assert f"{t['tokens_per_s_per_job']:,.0f} tokens/s per job" in text


def test_plan_on_cpu_without_hardware_has_no_gpu_sections(run_main):
    plan = json.loads(run_main("plan", "--json").stdout)
    assert "time" not in plan and "fit" not in plan
    priced = json.loads(run_main("plan", "--json", "--hardware", "A100-80GB").stdout)
    assert priced["time"]["hardware"] == "A100-80GB" and priced["fit"]["fits"]


def test_plan_says_float8_is_priced_as_bf16(run_main):
    """The time and memory models know no FP8: a plan of a train.float8 run says it prices bf16
    (and the same plan without FP8 says nothing of it), both on the same figures."""
    args = ("plan", "launcher.device=cuda", "train.dtype=bf16", "--hardware", "h200", "--json")
    fp8 = json.loads(run_main(*args, "train.float8=true").stdout)
    bf16 = json.loads(run_main(*args).stdout)
    assert FLOAT8_UNPRICED in fp8["warnings"] and FLOAT8_UNPRICED not in bf16["warnings"]
    assert fp8["time"]["step_s"] == bf16["time"]["step_s"]
    assert fp8["fit"]["stages"] == bf16["fit"]["stages"]


# ---- launch on CUDA, with a test double for the GPU -------------------------------------------

def mock_cuda_memory(total_bytes: float):
    """A stand-in for torch.cuda.get_device_properties on this CPU-only machine."""
    return lambda: (int(total_bytes), "mock GPU (test double)")


@pytest.fixture
def cuda_node(monkeypatch):
    """`launch` as on a node of 8 GPUs of `memory` bytes: visible_gpus and cuda_memory mocked."""
    def use(memory: float):
        monkeypatch.setattr(preflight, "visible_gpus", lambda cfg, share: 8)
        monkeypatch.setattr(preflight, "cuda_memory", mock_cuda_memory(memory))
    return use


def test_launch_refuses_a_predicted_oom_and_says_what_fits(run_main, cuda_node, tmp_path):
    cuda_node(H100.memory_bytes)  # the mocked GPU: 80 GiB
    cfg, _, _ = resolved(UNFIT[1], config=UNFIT[0])
    peak = max(s["total"] for s in stage_peaks(cfg))
    result = run_main("launch", *UNFIT, "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert result.code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    text = lines[0]
    assert "pp rank 0 (ranks 0-7)" in text and f"{peak / GIB:,.1f} GiB" in text
    assert "80.0 GiB" in text and "mock GPU (test double)" in text
    assert "train.micro_batch_size=4" in text and "launcher.allow_predicted_oom=true" in text
    assert not (tmp_path / "run").exists()
    # Insisting passes this check: the next refusal is the data's (no data.path given).
    insisted = run_main("launch", *UNFIT, "launcher.allow_predicted_oom=true", "--dry-run")
    assert insisted.code == 2 and "predicted out of memory" not in insisted.stderr
    assert "data" in insisted.stderr


def test_launch_warns_within_the_models_error(monkeypatch):
    cfg, world, _ = resolved(UNFIT[1], config=UNFIT[0])
    peak = max(s["total"] for s in stage_peaks(cfg))
    # Over the usable share but within the model's error of the device: a warning, no refusal.
    monkeypatch.setattr(preflight, "cuda_memory", mock_cuda_memory(peak / (1 + MODEL_ERROR / 2)))
    warnings = []
    preflight.check_memory(cfg, world, warnings)
    assert warnings and warnings[0].startswith("pp rank 0")
    monkeypatch.setattr(preflight, "cuda_memory", mock_cuda_memory(peak / (1 + 2 * MODEL_ERROR)))
    with pytest.raises(preflight.ConfigError, match="predicted out of memory"):
        preflight.check_memory(cfg, world, [])


def test_price_is_per_gpu_and_per_job():
    cfg, world, _ = resolved(config="llama-1b-dp8")
    p = price(cfg, H100)
    assert p["tokens_per_s_per_job"] == pytest.approx(
        cfg.train.global_batch_size * cfg.train.seq_len / p["step_s"])
    assert p["tokens_per_s_per_gpu"] == pytest.approx(p["tokens_per_s_per_job"] / world.size)


def test_a_cpu_configs_plan_on_a_gpu_is_the_gpus_throughout(run_main):
    """`plan --hardware` on a CPU config: the body was planned in fp32 (CPU) beside a fit line in
    bf16 (llama-7b: 102.4 GiB against 60.3). Both are the GPU's now."""
    res = run_main("plan", "model=llama-7b", "train.seq_len=4096", "train.global_batch_size=256",
                   "parallel.dp=8", "parallel.zero_stage=1", "train.micro_batch_size=1",
                   "--hardware", "H100")
    assert res.code == 0, res.stderr
    said = " ".join(res.stdout.split())
    assert "memory per rank (ZeRO-1, bf16," in said
    peak = said.split("peak memory, each rank: ")[1].split(" = ")[0]
    assert f"memory: pp rank 0 {peak}; fits" in said, said

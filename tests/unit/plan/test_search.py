"""The hardware presets and files, the time model (partrain/plan/time_model.py) against its own rules
(its published rows: test_time_model_terms.py), and `partrain plan
--search` (partrain/plan/search.py) against the decision guide of the source material."""

import dataclasses
import json
from pathlib import Path

import pytest

from partrain.plan.hardware import PRESETS, load_hardware
from partrain.plan.time_model import Layout, step_time
from tests.unit.helpers import compose

H100 = PRESETS["H100-SXM"]


def test_presets_by_name():
    assert load_hardware("h100-sxm") is H100
    assert load_hardware("A100-80GB").peak_flops == 312e12
    assert load_hardware("H200").memory_gib == 141
    assert all(hw.gpus_per_node == 8 and hw.inter_node_gbps < hw.intra_node_gbps
               for hw in PRESETS.values())


def test_a_hardware_file(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("gpus_per_node: 4\nmemory_gib: 48\npeak_tflops: 362\nintra_node_gbps: 32\n"
                    "inter_node_gbps: 12.5\n")
    hw = load_hardware(str(path))
    assert (hw.name, hw.gpus_per_node, hw.peak_flops, hw.matmul_efficiency) == \
        ("lab", 4, 362e12, 0.6)
    assert hw.bandwidth(crosses_nodes=True) == 12.5e9


@pytest.mark.parametrize("text,fragment", [
    ("gpus_per_node: 4\nmemory_gib: 48\npeak_tflops: 362\nintra_node_gbps: 32\n",
     "inter_node_gbps is required"),
    ("gpus_per_node: 4\nmemory_gib: -1\npeak_tflops: 362\nintra_node_gbps: 32\n"
     "inter_node_gbps: 1\n", "memory_gib=-1 must be a positive number"),
    ("gpus_per_node: 4\nmemory_gib: 8\npeak_tflops: 362\nintra_node_gbps: 32\n"
     "inter_node_gbps: 1\nnvlink: 3\n", "unknown key nvlink"),
    ("gpus_per_node: 2.5\nmemory_gib: 8\npeak_tflops: 362\nintra_node_gbps: 32\n"
     "inter_node_gbps: 1\n", "gpus_per_node=2.5 must be a whole number"),
    ("gpus_per_node: 4\nmemory_gib: 8\npeak_tflops: 362\nintra_node_gbps: 32\n"
     "inter_node_gbps: 1\nmatmul_efficiency: 1.5\n", "matmul_efficiency=1.5 must be at most 1"),
    ("[1, 2]\n", "must be a mapping"),
    ("gpus_per_node: [\n", "not YAML"),
])
def test_a_bad_hardware_file_is_refused(tmp_path, run_main, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    res = run_main("plan", "--search", "--gpus", "8", "--hardware", str(path))
    assert res.code == 2 and fragment in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("argv,fragment", [
    (["--search", "--hardware", "H100-SXM"], "--search needs --gpus N"),
    (["--search", "--gpus", "12"], "--gpus 12 must be a multiple of --gpus-per-node 8"),
    (["--search", "--gpus", "8", "--hardware", "TPUv9"], "neither a preset"),
    (["--gpus", "8"], "--gpus is a --search option"),
])
def test_bad_search_flags_are_refused(run_main, argv, fragment):
    res = run_main("plan", *argv)
    assert res.code == 2 and fragment in res.stderr, res.stderr


def _time(model="llama-7b", gbs=256, seq=4096, hw=H100, **layout):
    cfg = compose(f"model={model}", "launcher.device=cuda")
    return step_time(cfg.model, Layout(**layout), gbs, seq, hw)


def test_the_pipeline_bubble_is_the_schedules():
    for m, mb in ((4, 16), (32, 2)):
        t = _time(gbs=64, tp=8, pp=4, micro_batch_size=mb)
        assert t["micro_batches"] == m
        bubble = t["pp_bubble_s"] / (t["step_s"] - t["dp_s"] - t["optimizer_s"])
        assert bubble == pytest.approx(3 / (m + 3))
    interleaved = _time(gbs=64, tp=8, pp=4, micro_batch_size=2, pp_schedule="interleaved_1f1b",
                        pp_virtual_stages=2)
    assert interleaved["bubble"] == pytest.approx(3 / (2 * 32 + 3))


def test_tp_across_nodes_is_named_and_slower():
    inside = _time(model="llama-70b", gbs=64, dp=1, tp=8, pp=1, micro_batch_size=1,
                   sequence_parallel=True)
    # The same tp8 group on nodes of 4 GPUs: it spans two.
    across = _time(model="llama-70b", gbs=64, dp=1, tp=8, pp=1, micro_batch_size=1,
                   sequence_parallel=True, hw=dataclasses.replace(H100, gpus_per_node=4))
    # Its 4 ranks on each node drive 4 NICs (NCCL's one ring channel per NIC).
    assert across["tp_s"] == pytest.approx(inside["tp_s"] * H100.intra_node_gbps
                                           / min(4 * H100.inter_node_gbps, H100.intra_node_gbps))
    assert "tp collectives cross nodes" in across["limits"]
    assert "cross nodes" not in inside["limits"]


def test_zero3_gathers_grow_with_micro_batches():
    few = _time(gbs=64, dp=64, micro_batch_size=1, zero_stage=3)
    many = _time(gbs=256, dp=64, micro_batch_size=1, zero_stage=3)
    assert many["zero3_gather_s"] == pytest.approx(4 * few["zero3_gather_s"])
    assert "ZeRO-3 gathers on every micro-batch" in many["limits"]
    assert _time(gbs=64, dp=64, micro_batch_size=1, zero_stage=1)["zero3_gather_s"] == 0


def test_offload_puts_the_optimizer_on_the_host():
    off = _time(gbs=64, dp=8, micro_batch_size=1, zero_stage=2, offload_optimizer="cpu")
    on = _time(gbs=64, dp=8, micro_batch_size=1, zero_stage=2)
    assert off["offload_s"] > 0 and off["optimizer_s"] == 0 and on["offload_s"] == 0
    assert off["step_s"] > on["step_s"]


def _best(model, gpus, seq, gbs, hw=H100, *more):
    from partrain.plan.search import search

    cfg = compose(f"model={model}", f"train.seq_len={seq}", f"train.global_batch_size={gbs}",
                  f"model.max_seq_len={max(seq, 4096)}", *more)
    result = search(cfg, gpus, hw, top=5)
    assert result["best"], result["smallest_that_does_not_fit"]
    best = result["best"][0]
    assert best.memory_bytes <= hw.memory_bytes * 0.9
    return best.layout, result


NO_NVLINK = dataclasses.replace(H100, name="pcie", memory_gib=24, peak_tflops=165,
                                intra_node_gbps=12, inter_node_gbps=3)
SLOW_NETWORK = dataclasses.replace(H100, name="ethernet", inter_node_gbps=3)


def test_guide_one_gpu_model_fits():
    """One GPU and the model fits: no parallelism, no sharding, nothing recomputed."""
    layout, _ = _best("llama-1b", 1, 2048, 64)
    assert (layout.zero_stage, layout.offload_optimizer, layout.activation_checkpointing) == \
        (0, "none", "none")


def test_guide_one_gpu_model_does_not_fit():
    """One GPU and the model's state does not fit (7B: 16 bytes per parameter is 107 GB):
    ZeRO-Offload moves the optimizer to the host."""
    layout, _ = _best("llama-7b", 1, 4096, 64)
    assert layout.zero_stage >= 1 and layout.offload_optimizer == "cpu"


def test_guide_one_node_model_fits_on_a_gpu():
    """Several GPUs of one node and the model fits on one: plain data parallelism (DDP)."""
    layout, _ = _best("llama-1b", 8, 2048, 256)
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.zero_stage) == (8, 1, 1, 1, 0)


def test_guide_one_node_model_does_not_fit_on_a_gpu():
    """One node, and a replica does not fit on a GPU: the state is sharded (ZeRO, tp or pp)."""
    layout, _ = _best("llama-7b", 8, 4096, 256)
    assert layout.zero_stage >= 1 or layout.tp > 1 or layout.pp > 1
    assert layout.offload_optimizer == "none"  # the node's GPUs hold it without the host


def test_guide_one_node_without_nvlink():
    """Without fast links inside the node, tensor parallelism (two collectives per block) is
    avoided: ZeRO and pipeline parallelism instead."""
    layout, _ = _best("llama-7b", 8, 4096, 256, NO_NVLINK)
    assert layout.tp == 1


def test_guide_many_nodes_fast_network():
    """Many nodes on InfiniBand, a 70B model: tp stays inside a node, pp and dp across."""
    layout, _ = _best("llama-70b", 64, 4096, 512)
    assert layout.tp <= H100.gpus_per_node and layout.tp * layout.cp <= H100.gpus_per_node
    assert layout.pp > 1 and layout.zero_stage < 3


def test_guide_many_nodes_slow_network():
    """Many nodes on a slow network: no ZeRO-3 gathers and no tp across nodes; the gradient
    reduction's group is smaller than on the fast network."""
    slow, _ = _best("llama-70b", 64, 4096, 512, SLOW_NETWORK)
    fast, _ = _best("llama-70b", 64, 4096, 512)
    assert slow.zero_stage < 3 and slow.tp <= H100.gpus_per_node
    assert slow.dp <= fast.dp and slow.pp >= fast.pp


def test_guide_long_sequences_take_context_parallelism():
    """A 32k-token sequence on one node: its activations split over cp ranks."""
    layout, _ = _best("llama-7b", 8, 32768, 16)
    assert layout.cp > 1


PLANNER_PAGE = Path(__file__).resolve().parents[3] / "docs" / "planner.md"


@pytest.mark.parametrize("gpus, explain", [(1024, "tp=8 pp=8"), (8, "dp=8 zero_stage=1")])
def test_70b_searches_print_what_the_planner_page_shows(run_main, gpus, explain):
    """The largest search the suite runs (1024 GPUs: thousands of layouts priced; how long it
    takes is a figure for docs/performance.md, "The layout search", never asserted) and a small
    one, as docs/planner.md runs them: what they say of the layout asked for, and what was
    priced, are the page's lines to the character (a change of the models shows there)."""
    res = run_main("plan", "--search", "model=llama-70b", "train.seq_len=4096",
                   "--tokens-per-step", "4M", "--gpus", str(gpus), "--explain", explain)
    assert res.code == 0, res.stderr
    page = PLANNER_PAGE.read_text().splitlines()
    for start in (f"--explain {explain}:", "priced:"):
        [said] = [line for line in res.stdout.splitlines() if line.startswith(start)]
        if start == "priced:" and gpus != 1024:
            continue  # the page shows the first command's
        assert said in page, f"docs/planner.md does not show what is printed now:\n{said}"
    if gpus == 1024:
        assert "13,980 layouts of 1024 x H100-SXM" in res.stdout, res.stdout[:2000]


def test_write_recipe_runs_as_written(run_main, tmp_path):
    """--write-recipe: the winner as a recipe that `plan` (and so `launch`/`slurm`) takes as is,
    with the layout the search printed; a second write to the same path is refused."""
    path = tmp_path / "best.yaml"
    res = run_main("plan", "--search", "model=llama-1b", "train.seq_len=2048",
                   "train.global_batch_size=256", "--gpus", "16", "--json", "--write-recipe",
                   str(path))
    assert res.code == 0, res.stderr
    best = json.loads(res.stdout)["best"][0]
    assert path.read_text().startswith("# Written by `partrain plan --search")
    planned = run_main("plan", str(path), "--json")
    assert planned.code == 0, planned.stderr
    degrees = json.loads(planned.stdout)["degrees"]
    assert {k: degrees[k] for k in ("dp", "tp", "pp", "cp", "ep", "zero_stage")} == \
        {k: best["layout"][k] for k in ("dp", "tp", "pp", "cp", "ep", "zero_stage")}
    assert json.loads(planned.stdout)["nnodes"] == 2
    again = run_main("plan", "--search", "model=llama-1b", "--gpus", "16", "--write-recipe",
                     str(path))
    assert again.code == 2 and "exists" in again.stderr


def test_write_recipe_records_the_hardware_as_given(run_main, tmp_path, monkeypatch):
    """A --hardware YAML: the recipe's header recorded the `name:` inside it, a command that
    fails when run again ("neither a preset ... nor a YAML file")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hw.yaml").write_text("name: my-cluster\ngpus_per_node: 8\nmemory_gib: 80\n"
                                      "peak_tflops: 989\nintra_node_gbps: 450\n"
                                      "inter_node_gbps: 50\n")
    res = run_main("plan", "--search", "model=llama-1b", "--gpus", "8", "--hardware", "hw.yaml",
                   "--write-recipe", "best.yaml")
    assert res.code == 0, res.stderr
    header = (tmp_path / "best.yaml").read_text().splitlines()[0]
    assert "--hardware hw.yaml" in header and "my-cluster" not in header, header
    command = header.split("`")[1].removeprefix("partrain ").split()
    (tmp_path / "best.yaml").unlink()
    again = run_main(*command, "--write-recipe", "best.yaml")  # the recorded command, again
    assert again.code == 0, again.stderr


def test_world_size_is_not_a_search_option(run_main):
    """It was ignored: `--gpus 8 --world-size 4` planned for 8."""
    res = run_main("plan", "--search", "--gpus", "8", "--world-size", "4")
    assert res.code == 2 and "--world-size 4 is not a --search option" in res.stderr, res.stderr


def test_search_prints_a_table(run_main):
    res = run_main("plan", "--search", "model=llama-7b", "train.seq_len=4096",
                   "train.global_batch_size=256", "--gpus", "8")
    assert res.code == 0, res.stderr
    assert "best predicted layouts" in res.stdout and "tokens/s" in res.stdout and "MFU" in res.stdout
    # Not a terminal (captured, as a pipe or a file would be): no cell cut short to fit 80 columns.
    assert "…" not in res.stdout and "tokens/s per GPU" in res.stdout, res.stdout


def test_an_fp16_search_ranks_only_what_fp16_can_run(run_main):
    """fp16 needs DeepSpeed's loss scaler (ZeRO by DeepSpeed, no pp): the search priced every
    layout, validated its 40 best and found none, where such layouts fit."""
    args = ("plan", "--search", "model=llama-70b", "train.seq_len=4096",
            "train.global_batch_size=1024", "train.dtype=fp16", "--gpus", "64")
    res = run_main(*args)
    assert res.code == 0, res.stderr
    best = " ".join(res.stdout.split()).split("│ 1 │")[1].split("│")[0]
    assert "ZeRO-" in best and "FSDP" not in best and " pp" not in best, best
    res = run_main(*args, "--explain", "pp=2")
    assert "not enumerated: train.dtype=fp16 needs DeepSpeed's loss scaler" in res.stdout

"""A Qwen2 (q/k/v biases) through the CLI at tp2 x pp2: `model.init_from=hf:DIR` alone starts
the run (its keys read from config.json), whose first loss is transformers' loss on the same
batch and whose two steps (loss and grad_norm) are a one-process run's. The tp-split biases are
saved whole in the checkpoint, `export` writes a Qwen2 again, and transformers computes the
trained checkpoint's logits from it. The other families are checked in-process
(tests/unit/interop/test_hf_families.py)."""

import json

import pytest
import torch

from tests.integration.conftest import read_metrics
from tests.integration.test_hf import _first_batch_loss
from tests.unit.interop.test_hf_families import hf_family

pytestmark = pytest.mark.slow
COMMON = ("launcher.device=cpu", "train.max_steps=2", "train.eval_every=0",
          "train.global_batch_size=16")
LAYOUTS = {"one": ("parallel.dp=1", "train.micro_batch_size=16", "--nproc-per-node", "1"),
           "tp2-pp2": ("parallel.dp=1", "parallel.tp=2", "parallel.pp=2",
                       "train.micro_batch_size=4", "--nproc-per-node", "4")}


def test_qwen2_round_trip_through_tp2_pp2(cli, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from partrain.checkpoint import store
    from partrain.checkpoint.offline import checkpoint_model

    hf = hf_family("qwen2", tmp_path / "hf", num_hidden_layers=4)
    init = f"model.init_from=hf:{tmp_path / 'hf'}"
    runs = {}
    for name, layout in LAYOUTS.items():
        res = cli.run("launch", *COMMON, init, *layout, "--run-dir", str(tmp_path / name))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = read_metrics(tmp_path / name)[0]
    first = _first_batch_loss(hf, [init, *COMMON[1:]])
    for name, steps in runs.items():
        assert len(steps) == 2
        assert abs(steps[0]["loss"] - first) <= 1e-5 * first, (name, steps[0]["loss"], first)
        for got, ref in zip(steps, runs["one"]):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - ref[key]) <= 1e-4 * abs(ref[key]), (name, key, got, ref)

    (checkpoint,) = store.committed(tmp_path / "tp2-pp2" / store.CHECKPOINTS)
    saved = dcp.FileSystemReader(checkpoint.path).read_metadata().state_dict_metadata
    assert list(saved["model.layers.3.attention.wk.bias"].size) == [64]  # whole, not a tp half
    res = cli.run("export", str(tmp_path / "tp2-pp2"), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen2"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(again).__name__ == "Qwen2ForCausalLM"
    trained, _ = checkpoint_model(checkpoint)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        gap = (again(x).logits - trained.eval()(x)).abs().max().item()
        moved = (again.model.layers[0].self_attn.q_proj.bias
                 - hf.model.layers[0].self_attn.q_proj.bias).abs().max().item()
    assert gap <= 1e-5, gap
    assert moved > 0  # two steps trained the biases

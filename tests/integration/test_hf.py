"""model.init_from=hf:DIR through the CLI: a Llama that transformers wrote (save_pretrained, a
small random config; nothing downloaded) starts a run. Its first loss is transformers' loss on
the same batch, and the run keeps layout parity: one process against dp2 x tp2 x pp2, where each
rank reads only its slices of the safetensors file."""

import pytest
import torch

from tests.integration.conftest import PARITY_COMMON, assert_parity, read_metrics
from tests.unit.test_hf import LLAMA3, LLAMA3_KEYS, hf_llama

pytestmark = pytest.mark.slow
# The tiny model's shape has 4 layers (test_hf's has 2): pp2 takes 2 each.
FOUR_LAYERS = {"num_hidden_layers": 4}


def _first_batch_loss(hf, overrides) -> float:
    """transformers' mean loss on the global batch of step 1 of a run with these overrides."""
    from partrain.config import compose_config
    from partrain.data import load_tokens, rank_micro_batches

    cfg = compose_config(None, list(overrides))
    t = cfg.train
    (x, y), = rank_micro_batches(load_tokens(cfg.data).train, 1, global_batch_size=16,
                                 micro_batch_size=16, dp=1, dp_rank=0, seq_len=t.seq_len,
                                 seed=t.seed)
    with torch.no_grad():
        logits = hf(x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def test_hf_llama3_weights_start_a_run_at_any_layout(cli, tmp_path):
    hf = hf_llama(tmp_path / "hf", LLAMA3, **FOUR_LAYERS)
    model = [f"model.init_from=hf:{tmp_path / 'hf'}",
             *(f"model.{key}={value}" for key, value in LLAMA3_KEYS.items())]
    runs = {}
    for name, layout in (("one", ("parallel.dp=1", "--nproc-per-node", "1",
                                  "train.micro_batch_size=16")),
                         ("3d", ("parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                                 "train.micro_batch_size=4", "--nproc-per-node", "8"))):
        run_dir = tmp_path / name
        res = cli.run("launch", *PARITY_COMMON, *model, *layout, "--run-dir", str(run_dir))
        assert res.returncode == 0, res.stderr[-3000:]
        assert "weights from the Hugging Face model" in res.stdout
        runs[name] = read_metrics(run_dir)[0]
    assert_parity(runs["3d"], runs["one"], "hf import, dp2 x tp2 x pp2 vs 1 process")
    first = _first_batch_loss(hf, [*PARITY_COMMON[1:], *model[1:]])
    assert abs(runs["one"][0]["loss"] - first) <= 1e-5 * first, (runs["one"][0]["loss"], first)
    assert abs(runs["3d"][0]["loss"] - first) <= 1e-5 * first


def test_hf_shape_mismatch_is_refused_before_the_start(cli, tmp_path):
    hf_llama(tmp_path / "hf", **FOUR_LAYERS)
    res = cli.run("launch", f"model.init_from=hf:{tmp_path / 'hf'}", "model.dim=64",
                  "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2, res.stderr
    assert "model.dim=64 but config.json says 128" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()

"""model.init_from=hf:DIR through the CLI: a Llama that transformers wrote (save_pretrained, a
small random config; nothing downloaded) starts a run. Its first loss is transformers' loss on
the same batch, and the run keeps layout parity: one process against tp2 (untied, Llama-3 rope:
each rank reads its vocabulary rows of lm_head.weight) and, for a tied model, against
dp2 x tp2 x pp2, where each rank reads only its slices of the safetensors file.

The one-process run also draws its curves (train.tensorboard, train.wandb=offline), which
test_curves_through_the_cli reads back: one run serves both, to keep the suite short.

A tied Llama (tie_word_embeddings, no lm_head.weight) runs one process and dp2 x tp2 x pp2 with
model.tie_embeddings=true; the 3-D run's step-5 checkpoint holds the tied weight once."""

import pytest
import torch

from tests.integration.conftest import (
    PARITY_COMMON,
    REFERENCE,
    assert_parity,
    read_metrics,
)
from tests.unit.interop.hf_models import LLAMA3, LLAMA3_KEYS, hf_llama

pytestmark = pytest.mark.slow
# The tiny model's shape has 4 layers (test_hf's has 2): pp2 takes 2 each.
FOUR_LAYERS = {"num_hidden_layers": 4}


def _first_batch_loss(hf, overrides) -> float:
    """transformers' mean loss on the global batch of step 1 of a run with these overrides."""
    from partrain.config.compose import compose_config
    from partrain.data.batches import rank_micro_batches
    from partrain.data.tokens import load_tokens

    cfg = compose_config(None, list(overrides))
    t = cfg.train
    (x, y), = rank_micro_batches(load_tokens(cfg.data).train, 1, global_batch_size=16,
                                 micro_batch_size=16, dp=1, dp_rank=0, seq_len=t.seq_len,
                                 seed=t.seed)
    with torch.no_grad():
        logits = hf(x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


THREE_D = ("parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=4",
           "--nproc-per-node", "8")
LAYOUTS = {"one": ("parallel.dp=1", "--nproc-per-node", "1", "train.micro_batch_size=16",
                   "train.eval_every=5", "train.tensorboard=true", "train.wandb=offline"),
           "tp2": ("parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=16",
                   "--nproc-per-node", "2")}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The transformers model, the init_from overrides and each layout's run dir and steps."""
    from tests.integration.conftest import CLI

    tmp_path, cli = tmp_path_factory.mktemp("hf-import"), CLI()
    hf = hf_llama(tmp_path / "hf", LLAMA3, **FOUR_LAYERS)
    model = [f"model.init_from=hf:{tmp_path / 'hf'}",
             *(f"model.{key}={value}" for key, value in LLAMA3_KEYS.items())]
    try:
        runs = _launch(cli, tmp_path, model, LAYOUTS, env={"WANDB_SILENT": "true"})
    finally:
        cli.kill_all()
    return hf, model, runs


def _launch(cli, tmp_path, model, layouts, *more, env=None) -> dict:
    """Each layout's run of the imported model (10 parity steps); run dirs by label."""
    runs = {}
    for name, layout in layouts.items():
        res = cli.run("launch", *PARITY_COMMON, *model, *layout, *more,
                      "--run-dir", str(tmp_path / name), env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "weights from the Hugging Face model" in res.stdout
        runs[name] = tmp_path / name
    return runs


def test_hf_llama3_weights_start_a_run_at_any_layout(imported):
    hf, model, run_dirs = imported
    runs = {name: read_metrics(run_dir)[0] for name, run_dir in run_dirs.items()}
    assert_parity(runs["tp2"], runs["one"], "hf import, tp2 vs 1 process")
    first = _first_batch_loss(hf, [*PARITY_COMMON[1:], *model[1:]])
    assert abs(runs["one"][0]["loss"] - first) <= 1e-5 * first, (runs["one"][0]["loss"], first)
    assert abs(runs["tp2"][0]["loss"] - first) <= 1e-5 * first


def test_hf_shape_mismatch_is_refused_before_the_start(cli, tmp_path):
    hf_llama(tmp_path / "hf", **FOUR_LAYERS)
    res = cli.run("launch", f"model.init_from=hf:{tmp_path / 'hf'}", "model.dim=64",
                  "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2, res.stderr
    assert "model.dim=64 but config.json says 128" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_curves_through_the_cli(imported):
    """train.tensorboard and train.wandb=offline: the curves hold what metrics.jsonl holds, read
    back with tensorboard's reader and from W&B's offline files."""
    from tests.integration.conftest import processes_mentioning
    from tests.unit.observe.test_curves import tensorboard_scalars, wandb_history

    run_dir = imported[2]["one"]
    steps, evals = read_metrics(run_dir)
    scalars = tensorboard_scalars(run_dir)
    assert scalars["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in steps}, rel=1e-6)
    assert scalars["val/loss"] == pytest.approx({r["step"]: r["val_loss"] for r in evals}, rel=1e-6)
    assert sorted(scalars["val/loss"]) == [5, 10]
    assert sorted(scalars["train/grad_norm"]) == list(range(1, 11))
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(wandb_file)
    assert {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r} == \
        pytest.approx({r["step"]: r["loss"] for r in steps})
    assert not (imported[2]["tp2"] / "tensorboard").exists()
    assert processes_mentioning(str(run_dir)) == []


TIED = {"tie_word_embeddings": True, **FOUR_LAYERS}
TIED_LAYOUTS = {"one": REFERENCE, "3d": THREE_D}


@pytest.fixture(scope="module")
def imported_tied(tmp_path_factory):
    """The tied transformers model, the overrides, and the two layouts' run dirs by label."""
    from tests.integration.conftest import CLI

    tmp_path, cli = tmp_path_factory.mktemp("hf-tied"), CLI()
    hf = hf_llama(tmp_path / "hf", **TIED)
    model = [f"model.init_from=hf:{tmp_path / 'hf'}", "model.tie_embeddings=true"]
    try:
        runs = _launch(cli, tmp_path, model, TIED_LAYOUTS, "checkpoint.every=5")
    finally:
        cli.kill_all()
    return hf, model, runs


def test_tied_hf_weights_start_a_run_at_any_layout(imported_tied):
    import torch.distributed.checkpoint as dcp

    hf, model, run_dirs = imported_tied
    runs = {name: read_metrics(run_dir)[0] for name, run_dir in run_dirs.items()}
    for name, steps in runs.items():
        if name != "one":
            assert_parity(steps, runs["one"], f"tied hf import, {name} vs 1 process")
    first = _first_batch_loss(hf, [*PARITY_COMMON[1:], *model[1:]])
    for name in ("one", "3d"):
        gap = abs(runs[name][0]["loss"] - first) / first
        print(f"tied hf import, {name}: first loss {runs[name][0]['loss']} vs transformers "
              f"{first} (rel {gap:.1e})")
        assert gap <= 1e-5, (name, runs[name][0]["loss"], first)
    # The tied weight is saved once, under the embedding's name, by every layout.
    keys = dcp.FileSystemReader(run_dirs["3d"] / "checkpoints" / "step-00000005") \
        .read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "optim.tok_embeddings.weight.exp_avg" in keys
    assert not [k for k in keys if ".output." in k]

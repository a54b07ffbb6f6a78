"""Weights out (`partrain export --format hf`) and `partrain sample`, in-process on a checkpoint
made here: the export is loaded by the real transformers and must compute partrain's logits.
Weights in (model.init_from=hf:DIR) are test_hf_import.py's."""

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.offline import checkpoint_model
from partrain.config.schema import Config
from partrain.data.tokenizer import BYTE_VOCAB as BYTES
from partrain.models.llama_hf import from_rotate_half, hf_name, to_rotate_half
from partrain.models.llama import build_model
from tests.unit.helpers import one_line, save_checkpoint
from tests.unit.interop.hf_models import batch, hf_llama, import_keys, rel_l2, saved_run

STEP = 7


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("hf") / "run", STEP)


def test_names_cover_the_model_once():
    cfg = OmegaConf.structured(Config)
    names = [hf_name(n) for n, _ in build_model(cfg.model, 0).named_parameters()]
    assert len(set(names)) == len(names) == 2 + 9 * cfg.model.n_layers + 1
    assert "model.layers.3.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    with pytest.raises(ValueError, match="layers.0.attention.wz.weight"):
        hf_name("layers.0.attention.wz.weight")


def test_rotate_half_moves_the_pairs_per_head():
    n_heads, head_dim, cols = 3, 8, 5
    w = torch.arange(n_heads * head_dim * cols, dtype=torch.float64).view(-1, cols)
    hf = to_rotate_half(w, n_heads)
    for h in range(n_heads):
        for i in range(head_dim // 2):
            for j in range(2):  # pair member j of pair i -> half j, position i
                assert torch.equal(hf[h * head_dim + j * head_dim // 2 + i], w[h * head_dim + 2 * i + j])
    assert torch.equal(from_rotate_half(hf, n_heads), w)
    assert not torch.equal(hf, w)


def test_checkpoint_model_is_the_saved_model(saved):
    run_dir, model = saved
    loaded, cfg = checkpoint_model(store.find(run_dir, "test"))
    assert cfg.model.n_layers == 2
    x = batch()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("max_shard_mb, sharded", [(5000, False), (1, True)])
def test_export_loads_in_transformers_with_partrains_logits(run_main, saved, tmp_path,
                                                            max_shard_mb, sharded):
    from transformers import AutoModelForCausalLM

    run_dir, model = saved
    out = tmp_path / "hf"
    res = run_main("export", str(run_dir), "--out", str(out), "--max-shard-mb", str(max_shard_mb))
    assert res.code == 0, res.stderr
    assert f"(step {STEP})" in res.stdout
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(weights) > 1) == sharded  # 1 MB shards of a 1.7 MB model
    index = out / "model.safetensors.index.json"
    assert index.exists() == sharded
    if sharded:
        assert sorted(set(json.loads(index.read_text())["weight_map"].values())) == weights
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (2, False)

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    x = batch()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert rel_l2(theirs, ours) <= 1e-5
    # The comparison sees the rotary layout: one q_proj without the permutation changes them.
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.weight.copy_(model.layers["0"].attention.wq.weight)
        assert rel_l2(hf(x).logits, ours) > 1e-3


def test_export_bf16(run_main, saved, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run_dir, model = saved
    out = tmp_path / "bf16"
    assert run_main("export", str(run_dir), "--out", str(out), "--dtype", "bf16").code == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = batch()
    with torch.no_grad():
        assert rel_l2(hf(x).logits, model(x)) < 2e-2  # bf16 weights: rounding, not a bug


@pytest.mark.parametrize("args, fragments", [
    (["--format", "gguf"], ["--format gguf", "formats: hf"]),
    (["--dtype", "fp8"], ["--dtype fp8", "fp32, bf16"]),
    (["--max-shard-mb", "0"], ["--max-shard-mb=0", "at least 1"]),
])
def test_export_refuses_options(run_main, saved, tmp_path, args, fragments):
    out = tmp_path / "out"
    res = run_main("export", str(saved[0]), "--out", str(out), *args)
    assert res.code == 2 and res.stderr.startswith("error:"), res.stderr
    assert all(f in res.stderr for f in fragments), res.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_export_refuses_a_used_out_dir_and_a_missing_checkpoint(run_main, saved, tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    res = run_main("export", str(saved[0]), "--out", str(used))
    assert res.code == 2 and "exists and is not empty" in res.stderr
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]
    res = run_main("export", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert res.code == 2 and "RUN_DIR_OR_CHECKPOINT=" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("full_fs", [0, 8192], indirect=True)
def test_export_on_a_full_disk_leaves_nothing(run_main, saved, full_fs):
    """The 1.7 MB model's weights do not fit: safetensors' own error, one message, no traces."""
    out = full_fs / "a" / "hf"
    res = run_main("export", str(saved[0]), "--out", str(out))
    assert res.code == 2 and "Traceback" not in res.stderr, res.stderr
    message = one_line(res.stderr)
    assert f"--out {out} cannot be written:" in message
    assert "(writing the safetensors files); nothing was left behind" in message
    assert list(full_fs.iterdir()) == []


def _sample(run_main, run_dir, *args):
    res = run_main("sample", str(run_dir), "--prompt", "def f(", "--max-new-tokens", "24", *args)
    assert res.code == 0, res.stderr
    assert res.stdout.startswith("def f(") and res.stdout.endswith("\n")
    return res.stdout


def test_sample_is_fixed_by_the_seed(run_main, saved):
    first = _sample(run_main, saved[0], "--seed", "1")
    assert _sample(run_main, saved[0], "--seed", "1") == first
    assert _sample(run_main, saved[0], "--seed", "2") != first


def test_greedy_sample_follows_the_models_argmax(run_main, saved):
    """temperature 0: each new byte is the argmax of the model's next-token logits."""
    run_dir, model = saved
    text = _sample(run_main, run_dir, "--temperature", "0")
    ids = list(b"def f(")
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids]))[0, -1, :BYTES].argmax()))
    expected = bytes(ids).decode("utf-8", errors="replace")
    assert text == expected + "\n"


@pytest.mark.parametrize("args, fragments", [
    (["--prompt", ""], ["--prompt ''", "no tokens"]),
    (["--prompt", "x", "--temperature", "-1"], ["--temperature=-1.0", ">= 0"]),
    (["--prompt", "x", "--temperature", "inf"], ["--temperature=inf", "finite"]),
    (["--prompt", "x", "--top-k", "-3"], ["--top-k=-3", "at least 0"]),
    (["--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens=0", "at least 1"]),
    (["--prompt", "x", "--device", "tpu"], ["--device tpu", "auto, cpu, cuda"]),
])
def test_sample_refuses(run_main, saved, args, fragments):
    res = run_main("sample", str(saved[0]), *args)
    assert res.code == 2 and res.stderr.startswith("error:") and res.stdout == "", res.stderr
    assert all(f in res.stderr for f in fragments), res.stderr


def test_sample_without_a_checkpoint(run_main, tmp_path):
    (tmp_path / "run").mkdir()
    res = run_main("sample", str(tmp_path / "run"), "--prompt", "x")
    assert res.code == 2 and "holds no committed checkpoint" in res.stderr


def test_a_checkpoint_from_before_the_rope_and_curve_keys(saved, tmp_path, run_main):
    """A config.yaml saved before keys were added (model.rope_*, train.tensorboard, ...) is read
    with their defaults: it resumes (nothing 'changed the math') and exports."""
    import shutil

    import yaml

    from partrain.checkpoint.resume import check_resumable

    run_dir = tmp_path / "old"
    shutil.copytree(saved[0], run_dir)
    (checkpoint,) = store.committed(run_dir / store.CHECKPOINTS)
    old = yaml.safe_load((checkpoint.path / store.SAVED_CONFIG).read_text())
    for key in [k for k in old["model"] if k.startswith("rope_") and k != "rope_theta"]:
        del old["model"][key]
    for key in ("tensorboard", "wandb", "wandb_project"):
        del old["train"][key]
    (checkpoint.path / store.SAVED_CONFIG).write_text(yaml.safe_dump(old))
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(old))
    check_resumable(checkpoint, cfg)
    res = run_main("export", str(run_dir), "--out", str(tmp_path / "out"))
    assert res.code == 0, res.stderr


def test_sample_edges(run_main, saved, tmp_path):
    import shutil

    res = run_main("sample", str(saved[0]), "--prompt", "x", "--seed", str(2**64))
    assert res.code == 2 and "--seed=18446744073709551616 does not fit in 64 bits" in res.stderr
    # A tiny temperature is (nearly) greedy, not a nan.
    assert _sample(run_main, saved[0], "--temperature", "1e-45") == \
        _sample(run_main, saved[0], "--temperature", "0")
    # A checkpoint whose weights are nan: refused, not a traceback from torch.multinomial.
    broken = tmp_path / "nan"
    shutil.copytree(saved[0], broken)
    (checkpoint,) = store.committed(broken / store.CHECKPOINTS)
    model, _ = checkpoint_model(checkpoint)
    with torch.no_grad():
        model.output.weight.fill_(float("nan"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        warnings.filterwarnings("ignore", "Detected an existing checkpoint", UserWarning)
        dcp.save({f"model.{n}": p.detach() for n, p in model.named_parameters()},
                 checkpoint_id=checkpoint.path)
    res = run_main("sample", str(broken), "--prompt", "x")
    assert res.code == 2 and "non-finite logits" in res.stderr, res.stderr


def test_a_checkpoint_damaged_with_its_sizes_intact_is_named_not_a_traceback(run_main, tmp_path):
    """A .distcp file zeroed in place (a power cut: the size checks pass): export and sample
    printed DCP's traceback (exit 1); a launch's failure said to resume from the same checkpoint
    again. Now exit 2 naming it, and the launch says to move it aside."""
    from partrain.checkpoint import store
    from partrain.launch.failures import where_to_resume
    from partrain.models.llama import Transformer

    cfg = OmegaConf.structured(Config)
    hf_llama(tmp_path / "hf")
    cfg.model = import_keys(tmp_path / "hf")
    model = Transformer(cfg.model).eval()
    for step in (1, 2):
        save_checkpoint(model, cfg, tmp_path / "run", step)
    newest = store.newest(tmp_path / "run" / store.CHECKPOINTS)
    for file in newest.path.glob("*.distcp"):
        file.write_bytes(bytes(file.stat().st_size))
    for argv in (["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")],
                 ["sample", str(tmp_path / "run"), "--prompt", "x", "--max-new-tokens", "1"]):
        res = run_main(*argv)
        said = one_line(res.stderr)
        assert res.code == 2 and "Traceback" not in said, said
        assert f"{newest.path} could not be read: its files are damaged" in said, said
    advice = where_to_resume(tmp_path / "run", f"RuntimeError: reading the weights of "
                                               f"{newest.path} failed: UnpicklingError: x")
    assert (f"Move it aside (mv {newest.path} {newest.path.parent.parent}/step-00000002"
            f".unreadable) and relaunch with partrain launch --resume {tmp_path / 'run'}: it "
            "goes on from step 1") in advice, advice
    assert "go on from it" in where_to_resume(tmp_path / "run", "RuntimeError: x")

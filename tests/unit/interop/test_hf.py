"""Weights out (`partrain export --format hf`) and `partrain sample`, in-process on a checkpoint
made here: the export is loaded by the real transformers and must compute partrain's logits."""

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from partrain.checkpoint import store
from partrain.checkpoint.offline import checkpoint_model
from partrain.checkpoint.state import build_state
from partrain.config.schema import Config
from partrain.data.tokenizer import BYTE_VOCAB as BYTES
from partrain.models.llama_hf import from_rotate_half, hf_name, to_rotate_half
from partrain.models.llama import build_model
from tests.unit.helpers import one_line, save_checkpoint

STEP = 7


def saved_run(run_dir, step: int, **model_keys):
    """A run dir holding one committed checkpoint (at `step`) of a small GQA model (4 heads, 2 kv
    heads, 2 layers; `model_keys` override more) and the model itself. The weights are perturbed
    so that no two rows or heads are alike, and the optimizer has a step, as a trained
    checkpoint has."""
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len = 2, 64
    for key, value in model_keys.items():
        cfg.model[key] = value
    model = build_model(cfg.model, seed=3)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    root = run_dir / store.CHECKPOINTS
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(build_state(model, optimizer, None, zero=False),
                 checkpoint_id=store.tmp_dir(root, step))
    store.commit(root, step, {"reason": "test"}, OmegaConf.to_yaml(cfg))
    return run_dir, model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("hf") / "run", STEP)


def _batch(vocab=BYTES, seq=48):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(11))


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


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
    x = _batch()
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
    x = _batch()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert _rel_l2(theirs, ours) <= 1e-5
    # The comparison sees the rotary layout: one q_proj without the permutation changes them.
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.weight.copy_(model.layers["0"].attention.wq.weight)
        assert _rel_l2(hf(x).logits, ours) > 1e-3


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
    x = _batch()
    with torch.no_grad():
        assert _rel_l2(hf(x).logits, model(x)) < 2e-2  # bf16 weights: rounding, not a bug


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


# Weights in: model.init_from=hf:DIR, from checkpoints that transformers itself writes.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# The same model as partrain's keys say it (the tiny defaults, 2 layers).
LLAMA3_KEYS = {"rope_type": "llama3", "rope_theta": 500000.0, "rope_original_max_seq_len": 64}


def hf_llama(path, rope=None, **overrides):
    """A random transformers Llama of partrain's tiny shape (2 layers), saved with
    save_pretrained into `path`; the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kwargs = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if rope:
        kwargs["rope_parameters"] = dict(rope)
    model = LlamaForCausalLM(LlamaConfig(**{**kwargs, **overrides})).eval()
    model.save_pretrained(path)
    return model


def _model_cfg(path, **keys):
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.init_from = 2, f"hf:{path}"
    for key, value in keys.items():
        cfg.model[key] = value
    return cfg.model


@pytest.mark.parametrize("rope, keys", [(None, {}), (LLAMA3, LLAMA3_KEYS)], ids=["rope", "llama3"])
def test_import_computes_transformers_logits(tmp_path, rope, keys):
    from partrain.interop.hf import check_hf_init, load_hf_weights
    from partrain.models.llama import Transformer

    hf = hf_llama(tmp_path / "hf", rope)
    model_cfg = _model_cfg(tmp_path / "hf", **keys)
    assert check_hf_init(model_cfg) == tmp_path / "hf"
    model = Transformer(model_cfg).eval()
    load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    x = _batch(seq=200)  # past original_max_position_embeddings: llama3's scaling matters
    with torch.no_grad():
        assert _rel_l2(model(x), hf(x).logits) <= 1e-5


def test_llama3_rope_scaling_changes_the_frequencies():
    from partrain.models.layers import rope_scaling, rope_tables

    cfg = OmegaConf.structured(Config).model
    plain = rope_tables(32, 128, 500000.0)
    cfg.rope_type, cfg.rope_original_max_seq_len = "llama3", 64
    scaled = rope_tables(32, 128, 500000.0, rope_scaling(cfg))
    sin_plain, sin_scaled = plain[1], scaled[1]
    assert torch.equal(sin_scaled[:, 0], sin_plain[:, 0])  # the fastest rotation is kept
    # The slowest is slowed by the factor (its angles are small: sin is the angle).
    assert torch.allclose(sin_scaled[:, -1] * 8, sin_plain[:, -1], rtol=1e-4)


def test_export_of_a_llama3_model_round_trips(run_main, tmp_path):
    """Import a llama3 checkpoint, save it as partrain's, export it: transformers computes the
    same logits from the export (rope_parameters written as read)."""
    from transformers import AutoModelForCausalLM

    from partrain.interop.hf import load_hf_weights
    from partrain.models.llama import Transformer

    hf = hf_llama(tmp_path / "hf", LLAMA3)
    model_cfg = _model_cfg(tmp_path / "hf", **LLAMA3_KEYS)
    model = Transformer(model_cfg).eval()
    load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    cfg = OmegaConf.structured(Config)
    cfg.model = model_cfg
    save_checkpoint(model, cfg, tmp_path / "run")
    assert run_main("export", str(tmp_path / "run"), "--out", str(tmp_path / "out")).code == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"] == LLAMA3
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    x = _batch(seq=200)
    with torch.no_grad():
        assert _rel_l2(again(x).logits, hf(x).logits) <= 1e-5


@pytest.mark.parametrize("overrides, keys, fragments", [
    ({}, {"dim": 64}, ["model.dim=64 but config.json says 128", "add model.dim=128"]),
    ({}, {"n_layers": 3, "vocab_size": 512},
     ["model.n_layers=3", "model.vocab_size=512", "add model.n_layers=2 model.vocab_size=256"]),
    ({"rope_parameters": LLAMA3}, {}, ["model.rope_type=default but config.json says llama3",
                                       "model.rope_theta=500000.0"]),
    ({"tie_word_embeddings": True}, {}, ["model.tie_embeddings=false but config.json says true",
                                         "add model.tie_embeddings=true"]),
    ({}, {"tie_embeddings": True}, ["model.tie_embeddings=true but config.json says false",
                                    "add model.tie_embeddings=false"]),
    ({"hidden_act": "gelu"}, {}, ["hidden_act='gelu'", "silu"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, {},
     ["rope_type='yarn'", "default and llama3"]),
])
def test_import_refuses_what_does_not_fit(tmp_path, overrides, keys, fragments):
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf", **overrides)
    with pytest.raises(ConfigError) as e:
        check_hf_init(_model_cfg(tmp_path / "hf", **keys))
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert f"model.init_from=hf:{tmp_path / 'hf'}" in str(e.value)


def test_import_refuses_a_dir_without_weights(tmp_path):
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        check_hf_init(_model_cfg(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="is not a directory"):
        check_hf_init(_model_cfg(tmp_path / "nothing"))


def _rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, fragments", [
    ({"num_attention_heads": 0}, ["num_attention_heads=0", "whole number >= 1"]),
    ({"hidden_size": "128"}, ["hidden_size='128'", "whole number"]),
    ({"rope_parameters": "x"}, ["rope_parameters='x'", "object"]),
    ({"rms_norm_eps": None}, ["rms_norm_eps=None", "finite number"]),
    ({"num_hidden_layers": True}, ["num_hidden_layers=True"]),
    ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings='yes'", "true or false"]),
])
def test_import_refuses_a_malformed_config_json(tmp_path, changes, fragments):
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf")
    _rewrite_config(tmp_path / "hf", **changes)
    with pytest.raises(ConfigError) as e:
        check_hf_init(_model_cfg(tmp_path / "hf"))
    assert all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 64},
                                     {"type": "linear", "factor": 4.0}])
def test_a_rope_scaling_beside_a_default_rope_parameters_is_read_first(tmp_path, scaling):
    """transformers 5 takes rope_scaling over rope_parameters: a model card's YaRN (or a linear
    scaling) written beside a v5 config's default rope_parameters imported as default rope and
    trained silently off transformers' model (logits 1.4e-2 apart). Now it is read, and refused
    as a rope partrain does not have."""
    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    hf_llama(tmp_path / "hf")
    _rewrite_config(tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                    rope_scaling=scaling)
    with pytest.raises(ConfigError, match="rope_type='(yarn|linear)'; partrain has default and "
                                          "llama3"):
        check_hf_init(_model_cfg(tmp_path / "hf"))


def test_a_null_num_key_value_heads_is_as_many_as_the_heads(tmp_path):
    """transformers reads null as absent: one kv head per query head. It was refused."""
    from partrain.models.llama_hf import model_keys

    hf_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_key_value_heads"] = None
    assert model_keys(config, "here")["n_kv_heads"] == config["num_attention_heads"]


def test_import_refuses_weights_that_do_not_fit(tmp_path):
    """Checked in the launcher, from the files' headers: a truncated file, a missing tensor and
    a tensor of the wrong shape (which a slice under tp would silently crop)."""
    from safetensors.torch import load_file, save_file

    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init

    path = tmp_path / "hf"
    hf_llama(path)
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    tensors = {k: v.clone() for k, v in load_file(weights).items()}  # not views of the file

    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        check_hf_init(_model_cfg(path))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="no tensor lm_head.weight"):
        check_hf_init(_model_cfg(path))
    save_file({**tensors, "lm_head.weight": torch.zeros(512, 128)}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lm_head.weight .* \[512, 128\].*\[256, 128\]"):
        check_hf_init(_model_cfg(path))
    weights.write_bytes(good)
    assert check_hf_init(_model_cfg(path)) == path


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
    cfg.model = _model_cfg(tmp_path / "hf")
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

"""Hostile input, round three: what comes from outside a run. Hugging Face weights holding nan or
inf (`model.init_from=hf:DIR`), checkpoints that do (`export`, `sample`), a run dir whose
tokenizer files are gone or are another tokenizer's, and `sample`'s numbers at float32's edges
(the round's `slurm --sbatch-arg` rows: test_hostile_round3_sbatch.py).

The contract and the checks are test_hostile.py's (tests/unit/cli/hostile.py): exit 2, one
`error:` line naming the file or flag, the value and the rule, no traceback, nothing written and
nothing started. The inputs are real files: Hugging Face dirs that transformers' save_pretrained
wrote (their tensors rewritten with safetensors), run dirs holding DCP checkpoints of a real
model, a BPE tokenizer trained with the tokenizers library. Paths are relative to the cwd (the
test's directory), so that messages can be matched exactly.
"""

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.unit.cli.hostile import (
    Ctx,
    assert_untouched,
    check_row,
    isolated,  # noqa: F401 (isolated: an autouse fixture)
    row,
    tree,
)
from tests.unit.helpers import save_checkpoint


# ------------------------------------------------------------------------------------------------
# Inputs


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file()}


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


@functools.cache
def _hf_files(tied: bool) -> dict[str, bytes]:
    """The files of a transformers Llama of the tiny model's shape with 2 layers, as
    save_pretrained writes them (written once)."""
    from tests.unit.interop.hf_models import hf_llama

    with tempfile.TemporaryDirectory() as tmp:
        hf_llama(Path(tmp), tie_word_embeddings=tied)
        return _files(Path(tmp))


def _hf(edit=None, *, tied=False, shards=1):
    """A row's argv part: that dir at ./hf, its tensors passed through `edit` and written back
    with safetensors (in `shards` files with an index past one); returns model.init_from."""
    from safetensors.torch import load_file, save_file

    def build(c: Ctx) -> str:
        path = c.root / "hf"
        _write(path, _hf_files(tied))
        tensors = {k: v.clone() for k, v in load_file(path / "model.safetensors").items()}
        if edit is None and shards == 1:
            return "model.init_from=hf:hf"
        tensors = edit(tensors) if edit else tensors
        (path / "model.safetensors").unlink()
        names = sorted(tensors)
        files = {n: f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors"
                 for i, n in enumerate(names)}
        for file in sorted(set(files.values())):
            save_file({n: tensors[n] for n in names if files[n] == file}, path / file,
                      metadata={"format": "pt"})
        if shards == 1:
            (path / files[names[0]]).rename(path / "model.safetensors")
        else:
            (path / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": files}))
        return "model.init_from=hf:hf"
    return build


def _poke(name: str, index: tuple, value: float, dtype=None):
    """An edit: every tensor in `dtype` (if given), then tensor `name` at `index` set to `value`."""
    def edit(tensors: dict) -> dict:
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        tensors[name][index] = value
        return tensors
    return edit


DOWN = "model.layers.1.mlp.down_proj.weight"
EMBED = "model.embed_tokens.weight"


def _launch_hf(build, *args: str):
    return lambda c: ["launch", "--dry-run", "model.n_layers=2", build(c), *args]


def _saved_run(run_dir: Path, *, vocab_size: int = 256, poke=None, data: dict | None = None):
    """A run dir with one committed DCP checkpoint (step 5) of a 2-layer model, its weight
    layers.1.feed_forward.w2 set at [3, 5] to `poke` if given; `data`: data.* of its config."""
    from omegaconf import OmegaConf

    from partrain.config.schema import Config
    from partrain.models.llama import build_model

    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len, cfg.model.vocab_size = 2, 64, vocab_size
    for key, value in (data or {}).items():
        cfg.data[key] = value
    model = build_model(cfg.model, seed=3)
    if poke is not None:
        with torch.no_grad():
            model.layers["1"].feed_forward.w2.weight[3, 5] = poke
    save_checkpoint(model, cfg, run_dir, step=5)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run_dir


@functools.cache
def _run_files(poke: float | None = None) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        return _files(_saved_run(Path(tmp) / "run", poke=poke))


def _run(poke: float | None = None):
    """A row's argv part: a byte-level run dir at ./run (weights poked as _saved_run says)."""
    def build(c: Ctx) -> str:
        _write(c.root / "run", _run_files(poke))
        return "run"
    return build


@functools.cache
def _bpe_json(vocab_size: int = 300) -> bytes:
    from tests.unit.data.corpus import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        train_bpe(Path(tmp) / "tokenizer.json", vocab_size=vocab_size)
        return (Path(tmp) / "tokenizer.json").read_bytes()


@functools.cache
def _bpe_run_files(data_path: str | None) -> dict[str, bytes]:
    """A run dir as a launch on a `data prepare --tokenizer` dir leaves it: RUN_DIR/tokenizer/
    (tokenizer.json, tokenizer_config.json) and a checkpoint of a model whose vocabulary is the
    tokenizer's 300 tokens padded to 384; its config trains on data.path=`data_path` if given."""
    from partrain.data.tokenizer import RUN_TOKENIZER, write_files

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        source = Path(tmp) / "tokenizer.json"
        source.write_bytes(_bpe_json())
        (run_dir / RUN_TOKENIZER).mkdir(parents=True)
        write_files(source, "<|endoftext|>", run_dir / RUN_TOKENIZER)
        data = {"source": "tokens", "path": data_path} if data_path else None
        return _files(_saved_run(run_dir, vocab_size=384, data=data))


def _bpe_run(damage=None, data_path: str | None = None):
    """A row's argv part: that run dir at ./run, then `damage(run_dir)`."""
    def build(c: Ctx) -> str:
        _write(c.root / "run", _bpe_run_files(data_path))
        if damage is not None:
            damage(c.root / "run")
        return "run"
    return build


def _unlink(*names: str):
    return lambda run_dir: [(run_dir / "tokenizer" / n).unlink() for n in names]


def _tokenizer_dir_is_a_file(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "tokenizer")
    (run_dir / "tokenizer").write_text("not a directory\n")


def _bigger_tokenizer(run_dir: Path) -> None:
    (run_dir / "tokenizer" / "tokenizer.json").write_bytes(_bpe_json(600))


def _garbage_tokenizer(run_dir: Path) -> None:
    (run_dir / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')


def _sample(build, *args: str):
    return lambda c: ["sample", build(c), "--prompt", "the quick", "--max-new-tokens", "4", *args]


def _export(build, *args: str):
    return lambda c: ["export", build(c), "--out", "out", *args]


# ------------------------------------------------------------------------------------------------
# 1. Weights that are not finite numbers: refused where they are read, naming file and tensor.

NOT_FINITE = "not finite numbers"

ROWS_HF_WEIGHTS = [
    row("init_from hf: nan in a down_proj", _launch_hf(_hf(_poke(DOWN, (3, 5), float("nan")))),
        "model.init_from=hf:hf", "hf/model.safetensors", DOWN, NOT_FINITE, "first nan at [3, 5]",
        "finite weights only"),
    row("init_from hf: +inf in the embedding",
        _launch_hf(_hf(_poke(EMBED, (255, 127), float("inf")))),
        "hf/model.safetensors", EMBED, "first inf at [255, 127]"),
    row("init_from hf: -inf in a norm weight",
        _launch_hf(_hf(_poke("model.norm.weight", (7,), float("-inf")))),
        "model.norm.weight", "first -inf at [7]"),
    row("init_from hf: nan in lm_head, F16 file",
        _launch_hf(_hf(_poke("lm_head.weight", (0, 0), float("nan"), torch.float16))),
        "lm_head.weight", "first nan at [0, 0]"),
    row("init_from hf: inf in q_proj, BF16 file",
        _launch_hf(_hf(_poke("model.layers.0.self_attn.q_proj.weight", (1, 2), float("inf"),
                             torch.bfloat16))),
        "model.layers.0.self_attn.q_proj.weight", "first inf at [1, 2]"),
    row("init_from hf: F64 value beyond float32's range",
        _launch_hf(_hf(_poke(DOWN, (0, 1), 1e300, torch.float64))),
        DOWN, "first 1e+300 at [0, 1]", "beyond float32's range"),
    row("init_from hf: every value of a tensor nan",
        _launch_hf(_hf(lambda t: {**t, DOWN: torch.full_like(t[DOWN], float("nan"))})),
        DOWN, "45,056 value(s)"),
    row("init_from hf: nan in the second of two shards",
        _launch_hf(_hf(_poke(DOWN, (3, 5), float("nan")), shards=2)),
        "hf/model-0000", "-of-00002.safetensors", DOWN, NOT_FINITE),
    row("init_from hf: nan in a tied embedding",
        lambda c: ["launch", "--dry-run", "model.n_layers=2", "model.tie_embeddings=true",
                   _hf(_poke(EMBED, (9, 9), float("nan")), tied=True)(c)],
        EMBED, "first nan at [9, 9]"),
    row("init_from hf: nan, a real launch (refused before any process starts)",
        lambda c: ["launch", "model.n_layers=2", _hf(_poke(DOWN, (3, 5), float("nan")))(c),
                   "--run-dir", "new"],
        "model.init_from=hf:hf", DOWN, NOT_FINITE),
    row("init_from hf: nan, slurm --dry-run",
        lambda c: ["slurm", "--nodes", "1", "--dry-run", "model.n_layers=2",
                   _hf(_poke(DOWN, (3, 5), float("nan")))(c), "--run-dir", "new"],
        "model.init_from=hf:hf", DOWN, NOT_FINITE),
]

ROWS_CHECKPOINT_WEIGHTS = [
    row("export of a checkpoint holding nan", _export(_run(float("nan"))),
        "run/checkpoints/step-00000005", "layers.1.feed_forward.w2.weight", NOT_FINITE,
        "first nan at [3, 5]", "finite weights only"),
    row("export of a checkpoint holding -inf", _export(_run(float("-inf"))),
        "layers.1.feed_forward.w2.weight", "first -inf at [3, 5]"),
    row("export --dtype bf16 of a weight beyond bf16's range",
        _export(_run(3.4e38), "--dtype", "bf16"),
        "--dtype bf16", "layers.1.feed_forward.w2.weight", "beyond bf16's range",
        "--dtype fp32"),
    row("sample of a checkpoint holding nan", _sample(_run(float("nan"))),
        "run/checkpoints/step-00000005", "layers.1.feed_forward.w2.weight", NOT_FINITE,
        "nothing to sample from"),
]


# ------------------------------------------------------------------------------------------------
# 2. A run dir whose tokenizer is gone, or is not the one it trained with.

GONE = "run/tokenizer/tokenizer.json is missing"

ROWS_TOKENIZER = [
    row("sample: tokenizer files deleted", _sample(_bpe_run(_unlink("tokenizer.json",
                                                                     "tokenizer_config.json"))),
        GONE, "trained with a tokenizer.json", "put that tokenizer.json back"),
    row("export: tokenizer files deleted", _export(_bpe_run(_unlink("tokenizer.json",
                                                                     "tokenizer_config.json"))),
        GONE, "trained with a tokenizer.json"),
    row("sample: tokenizer.json deleted, its config left", _sample(_bpe_run(_unlink(
        "tokenizer.json"))),
        GONE, "end-of-text token '<|endoftext|>'"),
    row("export: tokenizer.json deleted, token dir gone too",
        _export(_bpe_run(_unlink("tokenizer.json"), data_path="tok")),
        GONE, "the tokenizer.json of data.path=tok"),
    row("sample: RUN_DIR/tokenizer is a file", _sample(_bpe_run(_tokenizer_dir_is_a_file)),
        GONE),
    # The whole folder gone, and the token dir not readable from here (moved, or a relative
    # data.path run from another directory): a vocabulary of 384 is not the byte-level one.
    *[row(f"{command}: RUN_DIR/tokenizer removed, token dir unreadable",
          how(_bpe_run(lambda run_dir: shutil.rmtree(run_dir / "tokenizer"), data_path="tok")),
          "data.path=tok cannot be read from here", "no tokenizer/tokenizer.json",
          "model.vocab_size=384 is not the byte-level 256", "run/tokenizer")
      for command, how in (("sample", _sample), ("export", _export))],
    row("sample: tokenizer.json of another, bigger tokenizer", _sample(_bpe_run(
        _bigger_tokenizer)),
        "run/tokenizer/tokenizer.json", "tokens, more than the model's model.vocab_size=384",
        "not the tokenizer the run trained with"),
    row("export: tokenizer.json of another, bigger tokenizer", _export(_bpe_run(
        _bigger_tokenizer)),
        "run/tokenizer/tokenizer.json", "model.vocab_size=384", "not the tokenizer"),
    row("sample: tokenizer.json that the library cannot read", _sample(_bpe_run(
        _garbage_tokenizer)),
        "run/tokenizer/tokenizer.json", "not a tokenizer.json the tokenizers library reads"),
    row("sample: prompt bytes that are not UTF-8, BPE run",
        lambda c: ["sample", _bpe_run()(c), "--prompt", "ab\udcff"],
        "--prompt", "not UTF-8", "run/tokenizer/tokenizer.json"),
]


# ------------------------------------------------------------------------------------------------
# 3. sample's numbers: temperature within float32's normal numbers, and the other flags.

TEMPERATURE_RULE = ("finite number >= 0", "from 1e-45 to 3.4028235e+38", "float32's range")


def _flag(*args: str):
    return lambda c: ["sample", _run()(c), "--prompt", "def f(", *args]


ROWS_SAMPLE_FLAGS = [
    *[row(f"--temperature {given}", _flag("--temperature", given), f"--temperature={shown}",
          *TEMPERATURE_RULE)
      for given, shown in (("1e-60", "1e-60"), ("5e-324", "5e-324"), ("7e-46", "7e-46"),
                           ("1e39", "1e+39"), ("1e308", "1e+308"),
                           ("3.5e38", "3.5e+38"), ("-1e-60", "-1e-60"), ("nan", "nan"),
                           ("-inf", "-inf"), ("-0.5", "-0.5"))],
    row("--temperature abc", _flag("--temperature", "abc"), "--temperature", "'abc'",
        "not a number"),
    row("--temperature ''", _flag("--temperature", ""), "--temperature", "''", "not a number"),
    row("--top-k -1", _flag("--top-k", "-1"), "--top-k=-1", "at least 0"),
    row("--top-k nan", _flag("--top-k", "nan"), "--top-k", "'nan'", "whole number"),
    row("--top-k 2.5", _flag("--top-k", "2.5"), "--top-k", "'2.5'", "whole number"),
    row("--max-new-tokens 0", _flag("--max-new-tokens", "0"), "--max-new-tokens=0", "at least 1"),
    row("--max-new-tokens -7", _flag("--max-new-tokens", "-7"), "--max-new-tokens=-7",
        "at least 1"),
    row("--max-new-tokens nan", _flag("--max-new-tokens", "nan"), "--max-new-tokens", "'nan'",
        "whole number"),
    row("--max-new-tokens 1e9", _flag("--max-new-tokens", "1e9"), "--max-new-tokens", "'1e9'",
        "whole number"),
    row("--seed 2**64", _flag("--seed", str(2**64)), f"--seed={2**64}", "64 bits"),
    row("--seed -1", _flag("--seed", "-1"), "--seed=-1", "at least 0"),
]


TABLE = [*ROWS_HF_WEIGHTS, *ROWS_CHECKPOINT_WEIGHTS, *ROWS_TOKENIZER, *ROWS_SAMPLE_FLAGS]


@pytest.mark.parametrize("argv, fragments, absent", TABLE)
def test_refused(argv, fragments, absent, run_main, tmp_path, monkeypatch):
    check_row(argv, fragments, absent, run_main, tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------------
# Allowed (controls: the refusals above are not refusals of everything)


def _allowed(run_main, tmp_path, monkeypatch, argv, untouched=True):
    args = argv(Ctx(tmp_path, monkeypatch))
    before = tree(tmp_path)
    result = run_main(*args)
    assert result.code == 0, f"exit {result.code}\n{result.stdout}\n{result.stderr}"
    assert "error:" not in result.stderr, result.stderr
    if untouched:
        assert_untouched(tmp_path, before)
    return result


@pytest.mark.parametrize("build", [_hf(), _hf(_poke(DOWN, (3, 5), 3.0e38, torch.float64)),
                                   _hf(_poke(DOWN, (3, 5), 0.5), shards=2)],
                         ids=["as saved", "F64 within float32's range", "two shards"])
def test_finite_hf_weights_are_accepted(build, run_main, tmp_path, monkeypatch):
    result = _allowed(run_main, tmp_path, monkeypatch, _launch_hf(build))
    assert "dry run: would write" in result.stdout


def test_a_file_changed_after_the_check_is_refused_at_load(tmp_path, monkeypatch):
    """The ranks read their slices without the launcher's checks: a nan that appeared since
    (the file rewritten between the check and the start) is refused there, naming it."""
    from safetensors.torch import load_file, save_file

    from partrain.errors import ConfigError
    from partrain.interop.hf import check_hf_init, load_hf_weights
    from partrain.models.llama import Transformer
    from tests.unit.interop.hf_models import import_keys

    _hf()(Ctx(tmp_path, monkeypatch))
    model_cfg = import_keys(tmp_path / "hf")
    assert check_hf_init(model_cfg) == tmp_path / "hf"
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(weights).items()}
    save_file(_poke(DOWN, (3, 5), float("nan"))(tensors), weights, metadata={"format": "pt"})
    model = Transformer(model_cfg)
    with pytest.raises(ConfigError) as e:
        load_hf_weights(model, tmp_path / "hf", model_cfg, None)
    assert f"tensor {DOWN} in {weights} holds 1 value(s) that are not finite" in str(e.value)


def test_non_finite_counts_and_places_across_chunks():
    from partrain.interop.finite import chunks, non_finite

    values = torch.zeros(10, 3)
    assert non_finite(values) is None
    values[7, 2], values[9, 0] = float("nan"), float("inf")
    assert non_finite(values) == "2 value(s) that are not finite numbers (first nan at [7, 2])"
    assert list(chunks(10, 3, most=12)) == [(0, 4), (4, 8), (8, 10)]
    found = [non_finite(values[a:b], offset=a) for a, b in chunks(10, 3, most=12)]
    assert found == [None, "1 value(s) that are not finite numbers (first nan at [7, 2])",
                     "1 value(s) that are not finite numbers (first inf at [9, 0])"]
    assert list(chunks(3, 10**9)) == [(0, 1), (1, 2), (2, 3)]  # a row too big still goes whole


@pytest.mark.parametrize("temperature", ["1e-45", "1e-40", "1.1754944e-38"],
                         ids=["the smallest allowed", "a float32 subnormal", "float32's tiny"])
def test_a_tiny_temperature_is_greedy(temperature, run_main, tmp_path, monkeypatch):
    """The tiniest temperatures allowed compute: every token but the most likely one is sent
    to probability 0, so the draw is the greedy one, not nan (which multinomial refused)."""
    build = _flag("--max-new-tokens", "12", "--temperature")
    greedy = _allowed(run_main, tmp_path, monkeypatch, lambda c: [*build(c), "0"]).stdout
    coldest = run_main(*build(Ctx(tmp_path, monkeypatch)), temperature)
    assert coldest.code == 0, coldest.stderr
    assert coldest.stdout == greedy


@pytest.mark.parametrize("args", [["--temperature", "3.4e38"], ["--temperature", "-0.0"],
                                  ["--top-k", str(10**30)], ["--top-k", "0"],
                                  ["--seed", str(2**64 - 1)]],
                         ids=["temperature near float32's largest", "temperature -0.0",
                              "top-k above the vocabulary", "top-k 0 (all)", "the largest seed"])
def test_sample_flags_at_their_edges(args, run_main, tmp_path, monkeypatch):
    result = _allowed(run_main, tmp_path, monkeypatch, _flag("--max-new-tokens", "3", *args))
    assert result.stdout.startswith("def f(")


def test_a_tokenizer_run_with_its_files_samples_with_them(run_main, tmp_path, monkeypatch):
    result = _allowed(run_main, tmp_path, monkeypatch, _sample(_bpe_run(), "--temperature", "0"))
    assert result.stdout.startswith("the quick")

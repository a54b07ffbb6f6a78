"""What transformers does with an export next to what `partrain sample` does with the run: the
exported tokenizer gives the ids the run was trained on (no BOS that the data never had), and
greedy `generate` of the export gives `sample`'s tokens."""

import json
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from partrain.config.schema import Config
from partrain.data.tokenizer import RUN_TOKENIZER, TextTokenizer, write_files
from partrain.interop.sample import generate
from partrain.models.llama import build_model
from tests.unit.data.corpus import train_bpe
from tests.unit.helpers import save_checkpoint

BOS, EOT = "<|begin_of_text|>", "<|endoftext|>"
PROMPTS = ("def main(", "def f", "the quick brown fox")  # the first: greedy text of 8 tokens


def llama3_tokenizer(directory):
    """A byte-level BPE (300 ids, <|endoftext|> among them) with a BOS token at id 300 that its
    post-processor prepends, in Llama 3's form: Sequence[ByteLevel, TemplateProcessing]; its
    tokenizer_config.json asks for the BOS too (add_bos_token), as Llama 2's do."""
    from tokenizers import processors

    directory.mkdir(parents=True)
    tok = train_bpe(directory / "tokenizer.json")
    tok.add_special_tokens([BOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, bos)])])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
         "add_bos_token": True}))
    return directory / "tokenizer.json"


def tokenizer_run(root, tokenizer_file, vocab_size: int, loud_from: int | None = None):
    """A run dir with a checkpoint of a 2-layer model of `vocab_size` rows and, when
    `tokenizer_file` is given, RUN_DIR/tokenizer/ as a launch on a `data prepare --tokenizer`
    dir leaves it; the run dir and the model. The weights are perturbed far from their init, so
    that greedy text does not settle on one token; the head's rows from `loud_from` on are
    scaled up, so that their ids win the argmax where nothing masks them."""
    cfg = OmegaConf.structured(Config)
    cfg.model.n_layers, cfg.model.max_seq_len, cfg.model.vocab_size = 2, 64, vocab_size
    model = build_model(cfg.model, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.3)
        if loud_from is not None:
            model.output.weight[loud_from:] *= 4
    run_dir = root / "run"
    save_checkpoint(model, cfg, run_dir, step=3)
    if tokenizer_file is not None:
        (run_dir / RUN_TOKENIZER).mkdir()
        write_files(tokenizer_file, EOT, run_dir / RUN_TOKENIZER)
    return run_dir, model.eval()


@pytest.fixture(scope="module")
def llama3_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3-tok")
    return tokenizer_run(root, llama3_tokenizer(root / "tok"), 301)


def greedy_pair(model, out, tokenizer, hf_ids: list[int], our_ids: list[int], new: int):
    """(transformers' greedy continuation of `hf_ids` by the export, partrain's of `our_ids` by
    the model, as `sample --temperature 0` draws it)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([hf_ids])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # no pad token: transformers says so for each call
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, pad_token_id=0)[0, ids.shape[1]:].tolist()
    ours = generate(model, tokenizer, our_ids, new, 0.0, 0, 0, model.cfg.max_seq_len,
                    lambda text: None)
    return theirs, ours


def test_the_exported_tokenizer_encodes_as_the_run_did(run_main, llama3_run, tmp_path):
    from transformers import AutoTokenizer

    run_dir, model = llama3_run
    out = tmp_path / "hf"
    res = run_main("export", str(run_dir), "--out", str(out))
    assert res.code == 0, res.stderr
    loaded, ours = AutoTokenizer.from_pretrained(out), TextTokenizer(run_dir / RUN_TOKENIZER)
    bos = loaded.convert_tokens_to_ids(BOS)
    for text in PROMPTS:
        assert loaded(text)["input_ids"] == ours.encode(text)
        assert bos not in ours.encode(text)
    # The ByteLevel part stays (offsets as the run's tokenizer gives them); the BOS template goes.
    post = json.loads((out / "tokenizer.json").read_text())["post_processor"]
    assert [p["type"] for p in post["processors"]] == ["ByteLevel"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"], config["bos_token"]) == \
        (False, False, BOS)
    assert json.loads((out / "config.json").read_text())["bos_token_id"] is None
    # The run's own files are as they were.
    run_tokenizer = json.loads((run_dir / RUN_TOKENIZER / "tokenizer.json").read_text())
    assert run_tokenizer["post_processor"]["processors"][1]["type"] == "TemplateProcessing"

    # A user's generation from the text, and `sample`'s.
    theirs, ours_ids = greedy_pair(model, out, ours, loaded(PROMPTS[0])["input_ids"],
                                   ours.encode(PROMPTS[0]), 8)
    assert theirs == ours_ids and len(set(ours_ids)) > 2, (theirs, ours_ids)


@pytest.mark.parametrize("processor, kept", [
    (None, None),
    ({"type": "ByteLevel", "trim_offsets": False}, {"type": "ByteLevel", "trim_offsets": False}),
    ({"type": "TemplateProcessing", "single": []}, None),
    ({"type": "BertProcessing", "sep": ["[SEP]", 1], "cls": ["[CLS]", 0]}, None),
    ({"type": "Sequence", "processors": [{"type": "RobertaProcessing"}]}, None),
])
def test_post_processors_that_add_tokens_are_dropped(processor, kept):
    from partrain.data.tokenizer import without_added_tokens

    assert without_added_tokens(processor) == kept


@pytest.mark.parametrize("kind, span", [("bpe", 300), ("bytes", 256)])
def test_padding_ids_are_suppressed_in_generation(run_main, tmp_path, kind, span):
    """A vocabulary padded past the tokenizer's ids (for tp: 300 -> 384): `sample` never draws
    the padding ids, and the export's generation_config.json suppresses them, so greedy
    `generate` gives `sample`'s tokens, none of them padding."""
    from transformers import GenerationConfig

    tokenizer_file = None
    if kind == "bpe":
        (tmp_path / "tok").mkdir()
        train_bpe(tmp_path / "tok" / "tokenizer.json")
        tokenizer_file = tmp_path / "tok" / "tokenizer.json"
    run_dir, model = tokenizer_run(tmp_path, tokenizer_file, 384, loud_from=span)
    out = tmp_path / "hf"
    res = run_main("export", str(run_dir), "--out", str(out))
    assert res.code == 0, res.stderr
    assert GenerationConfig.from_pretrained(out).suppress_tokens == list(range(span, 384))

    tokenizer = TextTokenizer(run_dir / RUN_TOKENIZER if kind == "bpe" else None)
    prompt = tokenizer.encode(PROMPTS[0])
    with torch.no_grad():  # unmasked, the padding would win: the test can fail
        assert int(model(torch.tensor([prompt]))[0, -1].argmax()) >= span
    theirs, ours = greedy_pair(model, out, tokenizer, prompt, prompt, 12)
    assert theirs == ours and max(ours) < span and len(set(ours)) > 2, (theirs, ours)


def test_a_malformed_tokenizer_config_is_refused_naming_it(run_main, llama3_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(llama3_run[0], run_dir)
    (run_dir / RUN_TOKENIZER / "tokenizer_config.json").write_text("[1, 2]")
    res = run_main("export", str(run_dir), "--out", str(tmp_path / "hf"))
    assert res.code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "tokenizer_config.json is not a JSON object" in res.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("decoder", ["metaspace", "llama2"])
def test_the_streamed_continuation_is_the_decode_of_every_id(decoder):
    """sample prints the prompt, then streams the continuation's text. A fresh stream took the
    continuation's first token for the text's start: SentencePiece's Metaspace decoder and
    Llama-2's Strip dropped its space ("Hello" then "\u2581world" printed "Helloworld"), at 7 of
    15 cuts of a reviewer's sentence. The stream now reads the prompt's ids first."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    text = "Hello world, the world says hello to the whole wide world of words. " * 20
    if decoder == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:  # Llama-2's tokenizer.json: spaces replaced by the marker, a leading one added
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
        # SentencePiece's words begin with the marker (the tokenizer.json has no pre-tokenizer;
        # here one, so that the trainer learns such words)
        tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False))
    tokenizer = TextTokenizer.__new__(TextTokenizer)
    tokenizer._tok = tok
    ids = tok.encode("Hello world, the world says hello").ids
    assert len(ids) > 4
    wrong = 0
    for cut in range(1, len(ids)):
        step, flush = tokenizer.decoder(ids[:cut])
        streamed = "".join(step(token) for token in ids[cut:]) + flush()
        assert tok.decode(ids[:cut]) + streamed == tok.decode(ids), (cut, streamed)
        fresh, _ = TextTokenizer.decoder(tokenizer)
        wrong += "".join(fresh(token) for token in ids[cut:]) != streamed
    assert wrong  # the cuts where a fresh stream printed something else

"""Tokenizers: the byte-level default and Hugging Face `tokenizers` files (tokenizer.json).

A tokenizer travels as files: `tokenizer.json` (the `tokenizers` library's format) and
`tokenizer_config.json`, whose `eos_token` names the end-of-text token that separates documents.
`partrain data prepare --tokenizer` copies them into the token dir, a launch copies them into
`RUN_DIR/tokenizer/`, and `partrain export` into the Hugging Face directory, where transformers'
`AutoTokenizer` loads them (less any BOS/EOS the post-processor would add: `write_as_trained`).
`partrain sample` encodes and decodes with them; it and `data prepare` add no special token but
the end-of-text after each document.

This module imports neither torch nor the rest of partrain: data preparation starts its worker
processes on it, and each one imports only what it needs.
"""

import json
import os
import signal
from pathlib import Path

from partrain.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTES = "bytes"  # the byte-level tokenizer: a token per byte, vocabulary 256, no special tokens
BYTE_VOCAB = 256
# End-of-text tokens of the common tokenizer families, tried in order when tokenizer_config.json
# names none: GPT-2 and most BPE models, Llama 3, Llama 2 and T5-style, Gemma.
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def tokenizer_file(path: Path, flag: str = "--tokenizer") -> Path:
    """The tokenizer.json that `path` names: the file itself or a directory holding one."""
    # Imported here, not at the top: the worker processes import this module and need only it.
    from partrain.config.paths import what_is

    found = what_is(path)
    if found == "is a directory":
        inside = what_is(path / TOKENIZER_FILE)
        if inside == "does not exist":
            raise ConfigError(f"{flag} {path}: the directory holds no {TOKENIZER_FILE}")
        if inside != "is a regular file":
            raise ConfigError(f"{flag} {path}: its {TOKENIZER_FILE} {inside}")
        return path / TOKENIZER_FILE
    if found != "is a regular file":
        raise ConfigError(f"{flag} {path} {found}")
    return path


def load(file: Path, flag: str = "--tokenizer"):
    """A `tokenizers.Tokenizer` from a tokenizer.json, or one clear error."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises a bare Exception for a malformed file
        reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ConfigError(f"{flag} {file} is not a tokenizer.json the tokenizers library reads "
                     f"({reason})") from None


def id_span(tok) -> int:
    """How many ids the tokenizer's ids need: its highest id + 1 (at least its token count). Not
    `get_vocab_size`, a count: a vocabulary with a gap (65,000 words and <|endoftext|> at id
    70000) has ids past it, and an id dtype or a model sized by the count would not hold them."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def id_dtype(span: int) -> str:
    """The smallest unsigned dtype that holds ids 0 .. span - 1 (uint16, else uint32)."""
    return "uint16" if span <= 1 << 16 else "uint32"


def _configured_eot(config_file: Path) -> str | None:
    """tokenizer_config.json's eos_token: a string, or an added-token object with `content`."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def end_of_text(tok, file: Path, eot: str | None = None, flag: str = "--tokenizer") -> tuple[str, int]:
    """The token that ends each document and its id: `eot` when given, else tokenizer_config.json's
    eos_token beside the tokenizer.json, else the first of EOT_NAMES the vocabulary has."""
    if eot is not None:
        token_id = tok.token_to_id(eot)
        if token_id is None:
            raise ConfigError(f"--eot {eot!r} is not a token of {flag} {file}")
        return eot, token_id
    configured = _configured_eot(file.parent / TOKENIZER_CONFIG)
    for name in ((configured,) if configured else ()) + EOT_NAMES:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return name, token_id
    raise ConfigError(f"{flag} {file}: no end-of-text token found (no eos_token in a "
                 f"{TOKENIZER_CONFIG} beside it, none of {', '.join(EOT_NAMES)} in the "
                 "vocabulary); name the token that separates documents with --eot TOKEN")


def write_files(file: Path, eot: str, out: Path, max_len: int | None = None) -> list[str]:
    """Copy tokenizer.json into directory `out` and write its tokenizer_config.json: the source's
    own when it has one beside it (chat templates and all), else a minimal one that makes
    transformers' AutoTokenizer load tokenizer.json with this end-of-text token."""
    import shutil

    shutil.copyfile(file, out / TOKENIZER_FILE)
    source_config = file.parent / TOKENIZER_CONFIG
    if source_config.is_file() and _configured_eot(source_config) == eot:
        shutil.copyfile(source_config, out / TOKENIZER_CONFIG)
    else:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot,
                  "clean_up_tokenization_spaces": False}
        if max_len:
            config["model_max_length"] = max_len
        (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG]


RUN_TOKENIZER = "tokenizer"  # RUN_DIR/tokenizer/: the run's copy of its data's tokenizer files


def data_tokenizer_dir(data_cfg) -> Path | None:
    """The token dir whose tokenizer.json the data was made with; None for byte-level data."""
    if data_cfg.source != "tokens" or not data_cfg.path:
        return None
    try:
        meta = json.loads((Path(data_cfg.path) / "meta.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None  # gone or unreadable: a launch has refused it before; sample says it below
    return Path(data_cfg.path) if isinstance(meta, dict) and meta.get("tokenizer") == TOKENIZER_FILE else None


def copy_files(source: Path, out: Path) -> None:
    """Copy a tokenizer's files from directory `source` into `out`, each written whole under a
    temporary name and renamed, so that nodes copying at once never see half a file."""
    import shutil

    out.mkdir(exist_ok=True)
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG):
        if (source / name).is_file():
            tmp = out / f".{name}.{os.getpid()}.tmp"
            shutil.copyfile(source / name, tmp)
            tmp.rename(out / name)


# Post-processor kinds that add no token (ByteLevel only trims offsets): an export keeps them.
# Every other kind (TemplateProcessing, BertProcessing, RobertaProcessing) adds special tokens.
NO_TOKENS_ADDED = ("ByteLevel",)


def without_added_tokens(post_processor):
    """tokenizer.json's `post_processor` less the parts that add special tokens (Llama 3's BOS
    template, BERT's CLS/SEP), a Sequence's ByteLevel part kept: what `encode` then gives by
    default is what add_special_tokens=False gave (the data's ids, the prompt's in `sample`)."""
    if not isinstance(post_processor, dict):
        return None
    if post_processor.get("type") == "Sequence":
        kept = [p for p in post_processor.get("processors") or []
                if isinstance(p, dict) and p.get("type") in NO_TOKENS_ADDED]
        return {**post_processor, "processors": kept} if kept else None
    return post_processor if post_processor.get("type") in NO_TOKENS_ADDED else None


def write_as_trained(source: Path, out: Path) -> None:
    """Write the tokenizer files of directory `source` into `out` (an export) set to encode as
    the run's data and `sample` did, with no special token added: the model never saw a BOS, and
    transformers' tokenizers (so `pipeline` and a user's `tokenizer(text)`) add the
    post-processor's by default. tokenizer_config.json gets add_bos_token/add_eos_token false,
    from which transformers' Llama tokenizer classes rebuild a BOS template otherwise (their
    default is true)."""
    import shutil

    tokenizer = json.loads((source / TOKENIZER_FILE).read_text(encoding="utf-8"))
    post_processor = without_added_tokens(tokenizer.get("post_processor"))
    if post_processor == tokenizer.get("post_processor"):
        shutil.copyfile(source / TOKENIZER_FILE, out / TOKENIZER_FILE)
    else:
        tokenizer["post_processor"] = post_processor
        (out / TOKENIZER_FILE).write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False)
                                          + "\n", encoding="utf-8")
    if (source / TOKENIZER_CONFIG).is_file():
        try:
            config = json.loads((source / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        except ValueError as e:
            config = e
        if not isinstance(config, dict):
            raise ConfigError(f"{source / TOKENIZER_CONFIG} is not a JSON object ({config}); "
                              "the export writes it with add_bos_token false: fix or remove it")
        config.update(add_bos_token=False, add_eos_token=False)
        (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False)
                                            + "\n", encoding="utf-8")


def run_tokenizer_dir(run_dir: Path | None, data_cfg, vocab_size: int | None = None) -> Path | None:
    """Where a run's tokenizer files are: its own copy, else its token dir; None: byte-level.
    A launch makes RUN_DIR/tokenizer/ only to copy a tokenizer.json into it: what is left of it
    without that file is a run that trained with a tokenizer whose files went missing, refused
    rather than read as bytes (unless its token dir still holds the tokenizer.json). With
    neither that folder nor a readable token dir, only a model of the byte-level vocabulary
    (`vocab_size`) is taken for byte-level: any other is refused, as it may not be."""
    own = run_dir / RUN_TOKENIZER if run_dir is not None else None
    if own is not None and (own / TOKENIZER_FILE).is_file():
        return own
    source = data_tokenizer_dir(data_cfg)
    if own is not None and (own.exists() or own.is_symlink()) and \
            (source is None or not (source / TOKENIZER_FILE).is_file()):
        eot = _configured_eot(own / TOKENIZER_CONFIG) if own.is_dir() else None
        trained = (f"the tokenizer.json of data.path={data_cfg.path}"
                   if data_cfg.source == "tokens" and data_cfg.path else "a tokenizer.json")
        raise ConfigError(
            f"{own / TOKENIZER_FILE} is missing: the run trained with {trained}"
            + (f" (end-of-text token {eot!r}, as the {TOKENIZER_CONFIG} left there says)"
               if eot else "")
            + f", which its launch copied into {own}; put that tokenizer.json back there "
            "(partrain will not read the run's tokens as bytes)")
    if source is not None and not (source / TOKENIZER_FILE).is_file():
        raise ConfigError(f"the run's tokenizer is gone: no {RUN_TOKENIZER}/{TOKENIZER_FILE} in "
                          f"the run dir and none in its data.path={data_cfg.path}")
    if source is None and data_cfg.source == "tokens" and data_cfg.path:
        try:
            meta = json.loads((Path(data_cfg.path) / "meta.json").read_text(encoding="utf-8-sig"))
            named = meta.get("tokenizer", BYTES) if isinstance(meta, dict) else BYTES
        except (OSError, ValueError) as err:
            if vocab_size not in (None, BYTE_VOCAB) and not (own is not None and own.exists()):
                where = getattr(err, "strerror", None) or "its meta.json cannot be read"
                raise ConfigError(
                    f"the run's data.path={data_cfg.path} cannot be read from here ({where}; a "
                    f"relative path is read from the directory you run in, {Path.cwd()}) and "
                    f"the run dir holds no {RUN_TOKENIZER}/{TOKENIZER_FILE}: partrain cannot "
                    "tell whether its tokens are bytes or a tokenizer's (its model.vocab_size="
                    f"{vocab_size} is not the byte-level {BYTE_VOCAB}). Run it where data.path "
                    f"can be read, or put the run's tokenizer.json in {own or 'RUN_DIR/tokenizer'}")
            named = BYTES  # the token dir is gone: partrain's own dirs without a tokenizer are bytes
        if named != BYTES:
            raise ConfigError(f"the run trained on data.path={data_cfg.path}, whose meta.json "
                              f"tokenizer={named!r} is neither {BYTES!r} nor {TOKENIZER_FILE!r}: "
                              "partrain cannot decode its tokens")
    return source


class TextTokenizer:
    """Encode a prompt and decode generated ids as a stream of text, for either kind."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        if directory is None:
            self.name, self.vocab_size, self.eot_id, self._tok = BYTES, BYTE_VOCAB, None, None
            return
        file = directory / TOKENIZER_FILE
        self._tok = load(file, "the run's tokenizer")
        self.name = str(file)
        self.vocab_size = id_span(self._tok)  # every id is below it, the highest one too
        self.eot_id = end_of_text(self._tok, file, flag="the run's tokenizer")[1]

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            # surrogateescape: bytes of the command line that are not UTF-8 come back as themselves.
            return list(text.encode("utf-8", "surrogateescape"))
        return self._tok.encode(text, add_special_tokens=False).ids

    def decoder(self, prompt: list[int] = ()):
        """A function from each new id to the text it completes ('' while a character or a
        merged word is still partial), and a final flush. The stream first reads `prompt`'s ids
        (their text is printed already): a decoder that strips the first token's leading space
        (SentencePiece's Metaspace, Llama-2's Strip) took the continuation's first token for the
        text's start and dropped its space ("Hello" + "▁world" printed "Helloworld")."""
        if self._tok is None:
            import codecs

            stream = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return (lambda token: stream.decode(bytes([token]))), (lambda: stream.decode(b"", final=True))
        from tokenizers.decoders import DecodeStream

        stream, tok = DecodeStream(skip_special_tokens=False), self._tok
        for token in prompt:
            stream.step(tok, token)
        return (lambda token: stream.step(tok, token) or ""), (lambda: "")


# ---- data preparation's worker processes ------------------------------------------------------
_worker = {}


def init_worker(file: str, eot_id: int, dtype: str) -> None:
    """A worker process of `data prepare`: one single-threaded tokenizer, as many processes as
    cores. Ctrl-C is the parent's to handle: it stops the pool and removes what was written."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    from tokenizers import Tokenizer

    _worker.update(tok=for_documents(Tokenizer.from_file(file)), eot_id=eot_id, dtype=dtype)


def for_documents(tok):
    """`tok`, set to read special tokens' text in a document as ordinary text (nanoGPT's
    encode_ordinary, tiktoken's disallowed_special): a document that holds the text
    "<|endoftext|>" would otherwise get the separator's id inside it, a document boundary the
    document index does not have. The end-of-text id that `encode` appends is unaffected."""
    tok.encode_special_tokens = True
    return tok


def encode_documents(documents: list[str], ends: list[bool] | None = None):
    """In a worker: `encode` of `documents` with the worker's tokenizer."""
    return encode(_worker["tok"], _worker["eot_id"], _worker["dtype"], documents, ends)


def encode(tok, eot_id: int, dtype: str, documents: list[str], ends: list[bool] | None = None):
    """The ids of `documents`, each followed by the end-of-text token, as one numpy array, and
    the ids of each document (its end-of-text token included), for the document index. With
    `ends`, a piece whose flag is False continues into the next one: no end-of-text after it.
    `tok` is `for_documents`'s: special tokens' text in a document is text."""
    import numpy as np

    ends = [True] * len(documents) if ends is None else ends
    encodings = tok.encode_batch_fast(documents, add_special_tokens=False)
    sizes = np.fromiter((len(e.ids) + end for e, end in zip(encodings, ends)), dtype=np.int64,
                        count=len(encodings))
    # Filled as int64 and narrowed after a check: numpy 1.x wraps an id too big for `dtype`
    # silently (and numpy 2 raises a bare OverflowError); a wrapped id is another token.
    wide = np.empty(int(sizes.sum()), dtype=np.int64)
    at = 0
    for encoding, size, end in zip(encodings, sizes.tolist(), ends):
        wide[at:at + len(encoding.ids)] = encoding.ids
        if end:
            wide[at + size - 1] = eot_id
        at += size
    top = np.iinfo(dtype).max
    if len(wide) and int(wide.max()) > top:
        raise ConfigError(f"the tokenizer gave id {int(wide.max())}, which the token dir's "
                          f"dtype={dtype} (ids up to {top}) cannot hold; its tokenizer.json "
                          "changed while data prepare ran? Run data prepare again")
    return wide.astype(dtype), sizes

"""Benchmark: `partrain data prepare --tokenizer` against a bare `tokenizers` encode_batch.

The same text both ways, in one run: Python's stdlib source files (real text every install has),
repeated until --mb megabytes, written as text files into a directory (one document each).
The tokenizer is a byte-level BPE of --vocab tokens trained here on the first 2 MB of it with the
`tokenizers` library (or --tokenizer PATH).

  bare     `Tokenizer.encode_batch(documents)` on the documents already in memory, with the
           library's own thread pool over every core: tokenization and nothing else
  prepare  partrain's `prepare_token_dir` end to end: reading the directory, --workers processes
           (default: one per core), writing train.bin/val.bin and meta.json

Both are the best of --reps runs; the ids are checked equal (the documents in the same order,
each followed by the end-of-text token). Ratio: prepare MB/s / bare MB/s, goal >= 0.8.

    python scripts/bench_prepare.py            # 32 MB, a table
    python scripts/bench_prepare.py --json     # {"bare_mb_s", "prepare_mb_s", "ratio", ..}
    python scripts/bench_prepare.py --mb 4 --reps 1
"""

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def corpus(directory: Path, megabytes: float) -> list[str]:
    """Stdlib files copied into `directory` (as 00000.txt, ...) until `megabytes`; their texts."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts, size = [], 0
    while size < megabytes * 1e6:
        for source in sources:
            text = source.read_text(encoding="utf-8", errors="replace")
            (directory / f"{len(texts):05d}.txt").write_text(text, encoding="utf-8")
            texts.append(text)
            size += len(text.encode())
            if size >= megabytes * 1e6:
                break
    return texts


def train_tokenizer(texts: list[str], vocab: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size > 2e6:
            break
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0, help="megabytes of text")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json to use instead of training one")
    parser.add_argument("--workers", type=int, help="prepare's processes (default: one per core)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from partrain.data.prepare import default_workers, prepare_token_dir

    workers = args.workers or default_workers()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        (tmp / "text").mkdir()
        texts = corpus(tmp / "text", args.mb)
        nbytes = sum(len(t.encode()) for t in texts)
        path = args.tokenizer or tmp / "tokenizer.json"
        if args.tokenizer is None:
            train_tokenizer(texts, args.vocab, path)
        tok = Tokenizer.from_file(str(path))
        eot = "<|endoftext|>"

        bare, prep = [], []
        for rep in range(args.reps):
            start = time.perf_counter()
            encodings = tok.encode_batch(texts, add_special_tokens=False)
            bare.append(time.perf_counter() - start)
            out = tmp / f"tokens-{rep}"
            start = time.perf_counter()
            meta = prepare_token_dir([tmp / "text"], out, 0.05, tokenizer=path, eot=eot,
                                     workers=workers)
            prep.append(time.perf_counter() - start)
            ids = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=meta["dtype"])
                                  for s in ("train", "val")])
            eot_id = tok.token_to_id(eot)
            expected = np.fromiter((i for e in encodings for i in (*e.ids, eot_id)), dtype=np.int64)
            if not np.array_equal(ids.astype(np.int64), expected):
                sys.exit("prepare's ids differ from encode_batch's")
            shutil.rmtree(out)
            del encodings
        tokens = meta["train_tokens"] + meta["val_tokens"]

    result = {"megabytes": nbytes / 1e6, "documents": len(texts), "tokens": tokens,
              "vocab": tok.get_vocab_size(), "cores": os.cpu_count(), "workers": workers,
              "bare_s": min(bare), "prepare_s": min(prep),
              "bare_mb_s": nbytes / 1e6 / min(bare), "prepare_mb_s": nbytes / 1e6 / min(prep)}
    result["ratio"] = result["prepare_mb_s"] / result["bare_mb_s"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['megabytes']:.1f} MB of text, {len(texts)} documents, {tokens:,} tokens, "
          f"vocab {result['vocab']}, {result['cores']} cores, best of {args.reps}")
    print(f"  bare encode_batch (all cores)      {result['bare_s']:7.2f} s  "
          f"{result['bare_mb_s']:6.2f} MB/s")
    print(f"  partrain data prepare ({workers} workers)  {result['prepare_s']:7.2f} s  "
          f"{result['prepare_mb_s']:6.2f} MB/s")
    print(f"  ratio prepare/bare {result['ratio']:.2f} (goal >= 0.8)")


if __name__ == "__main__":
    main()

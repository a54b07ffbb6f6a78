"""Benchmark: `partrain data prepare --tokenizer` against a bare `tokenizers` encode_batch, and
prepare's peak memory.

The same text both ways, in one run: Python's stdlib source files (real text every install has),
repeated until --mb megabytes, written as text files into a directory (one document each), or
with --kind jsonl as one JSON Lines file (a document per line). The tokenizer is a byte-level BPE
of --vocab tokens trained here on the first 2 MB of it with the `tokenizers` library (or
--tokenizer PATH).

  bare     `Tokenizer.encode_batch` over the documents, ~1 MiB of text per call (as prepare sends
           its workers), with the library's own thread pool over every core: the time inside
           encode_batch only, the documents already in memory
  prepare  partrain's `prepare_token_dir` end to end, in a fresh process: reading the inputs,
           --workers processes (default: one per core), writing the shard files (--shard-mb), the
           document indexes and meta.json

Each is the best of --reps runs; the ids are checked equal (a hash of the documents' ids in
order, each followed by the end-of-text token). Ratio: prepare MB/s / bare MB/s, goal >= 0.8.
Memory: the prepare process's peak resident set (VmHWM) and its largest worker's (ru_maxrss of
its children), both high-water marks; the process after its imports, before any text, is
`rss_base_mb`. Goal: bounded whatever --mb is (a 5 GB input under 2 GB in all).

    python scripts/bench_prepare.py                       # 32 MB, a table
    python scripts/bench_prepare.py --mb 200 --reps 1     # the memory bound on more text
    python scripts/bench_prepare.py --json                # {"bare_mb_s", "prepare_mb_s", ...}
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Run in a fresh process, so that its peak memory is prepare's own and not this script's.
CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from partrain.data.prepare import prepare_token_dir

def peak_kib():
    # VmHWM: this process's own high-water mark. ru_maxrss would also count the bench process's
    # resident set before exec, which Linux carries over.
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

a = json.loads(sys.argv[1])
base = peak_kib()
start = time.perf_counter()
meta = prepare_token_dir([Path(p) for p in a["inputs"]], Path(a["out"]), a["val_fraction"],
                         tokenizer=Path(a["tokenizer"]) if a["tokenizer"] else None,
                         eot=a["eot"], workers=a["workers"],
                         shard_bytes=a["shard_bytes"])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "meta": meta, "base_kib": base, "self_kib": peak_kib(),
                  "children_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def corpus(directory: Path, megabytes: float, kind: str) -> tuple[Path, list[str]]:
    """Stdlib files until `megabytes`, as text files (00000.txt, ...) or one JSON Lines file in
    `directory`: the input to give prepare, and the documents."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts, size = [], 0
    while size < megabytes * 1e6:
        for source in sources:
            text = source.read_text(encoding="utf-8", errors="replace")
            if text:
                texts.append(text)
                size += len(text.encode())
            if size >= megabytes * 1e6:
                break
    if kind == "jsonl":
        path = directory / "corpus.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
        return path, texts
    path = directory / "text"
    path.mkdir()
    for i, text in enumerate(texts):
        (path / f"{i:06d}.txt").write_text(text, encoding="utf-8")
    return path, texts


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


def bare(tok, texts: list[str], eot_id: int) -> tuple[float, str]:
    """Seconds inside encode_batch over ~1 MiB batches, and the hash of the ids (not timed)."""
    digest, seconds, batch, chars = hashlib.blake2b(), 0.0, [], 0
    for i, text in enumerate(texts):
        batch.append(text)
        chars += len(text)
        if chars < 1 << 20 and i < len(texts) - 1:
            continue
        start = time.perf_counter()
        encodings = tok.encode_batch(batch, add_special_tokens=False)
        seconds += time.perf_counter() - start
        ids = np.fromiter((t for e in encodings for t in (*e.ids, eot_id)), dtype=np.int64)
        digest.update(ids.tobytes())
        batch, chars = [], 0
    return seconds, digest.hexdigest()


def prepared_digest(out: Path, meta: dict) -> str:
    """The hash of a token dir's ids, train then val, read shard by shard."""
    digest = hashlib.blake2b()
    for split in ("train", "val"):
        for number in range(len(meta[f"{split}_shards"])):
            ids = np.memmap(out / f"{split}-{number:05d}.bin", dtype=meta["dtype"], mode="r")
            for at in range(0, len(ids), 1 << 24):
                digest.update(np.asarray(ids[at:at + (1 << 24)], dtype=np.int64).tobytes())
    return digest.hexdigest()


def prepare(inputs: Path, out: Path, tokenizer: Path | None, workers: int, shard_mb: float,
            val_fraction: float = 0.05) -> dict:
    """prepare_token_dir in a fresh process (tokenizer None: bytes): its seconds, meta.json and
    peak memory (CHILD)."""
    args = {"inputs": [str(inputs)], "out": str(out),
            "tokenizer": str(tokenizer) if tokenizer else None,
            "eot": "<|endoftext|>" if tokenizer else None, "workers": workers,
            "shard_bytes": int(shard_mb * (1 << 20)), "val_fraction": val_fraction}
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"prepare failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0, help="megabytes of text")
    parser.add_argument("--kind", choices=("text", "jsonl"), default="text",
                        help="text files (one document each) or one JSON Lines file")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json to use instead of training one")
    parser.add_argument("--workers", type=int, help="prepare's processes (default: one per core)")
    parser.add_argument("--shard-mb", type=float, default=1024.0, help="prepare's --shard-mb")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from partrain.data.prepare import default_workers

    workers = args.workers or default_workers()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        inputs, texts = corpus(tmp, args.mb, args.kind)
        nbytes = sum(len(t.encode()) for t in texts)
        path = args.tokenizer or tmp / "tokenizer.json"
        if args.tokenizer is None:
            train_tokenizer(texts, args.vocab, path)
        tok = Tokenizer.from_file(str(path))
        eot_id = tok.token_to_id("<|endoftext|>")

        bare_s, runs = [], []
        for rep in range(args.reps):
            seconds, expected = bare(tok, texts, eot_id)
            bare_s.append(seconds)
            out = tmp / f"tokens-{rep}"
            runs.append(prepare(inputs, out, path, workers, args.shard_mb))
            if prepared_digest(out, runs[-1]["meta"]) != expected:
                sys.exit("prepare's ids differ from encode_batch's")
            for file in out.iterdir():
                file.unlink()
            out.rmdir()
    best = min(runs, key=lambda r: r["seconds"])
    meta = best["meta"]
    mib = 1024  # ru_maxrss is in KiB on Linux
    result = {"megabytes": nbytes / 1e6, "kind": args.kind, "documents": len(texts),
              "tokens": meta["train_tokens"] + meta["val_tokens"],
              "shards": len(meta["train_shards"]) + len(meta["val_shards"]),
              "vocab": tok.get_vocab_size(), "cores": os.cpu_count(), "workers": workers,
              "bare_s": min(bare_s), "prepare_s": best["seconds"],
              "bare_mb_s": nbytes / 1e6 / min(bare_s), "prepare_mb_s": nbytes / 1e6 / best["seconds"],
              "rss_base_mb": best["base_kib"] / mib,
              "rss_prepare_mb": max(r["self_kib"] for r in runs) / mib,
              "rss_worker_mb": max(r["children_kib"] for r in runs) / mib}
    result["ratio"] = result["prepare_mb_s"] / result["bare_mb_s"]
    result["rss_total_bound_mb"] = result["rss_prepare_mb"] + workers * result["rss_worker_mb"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['megabytes']:.1f} MB of text ({args.kind}), {len(texts)} documents, "
          f"{result['tokens']:,} tokens in {result['shards']} shard files, vocab "
          f"{result['vocab']}, {result['cores']} cores, best of {args.reps}")
    print(f"  bare encode_batch (all cores)      {result['bare_s']:7.2f} s  "
          f"{result['bare_mb_s']:6.2f} MB/s")
    print(f"  partrain data prepare ({workers} workers)  {result['prepare_s']:7.2f} s  "
          f"{result['prepare_mb_s']:6.2f} MB/s")
    print(f"  ratio prepare/bare {result['ratio']:.2f} (goal >= 0.8)")
    print(f"  peak RSS: prepare process {result['rss_prepare_mb']:.0f} MB (after imports "
          f"{result['rss_base_mb']:.0f} MB), largest worker {result['rss_worker_mb']:.0f} MB; "
          f"at most {result['rss_total_bound_mb']:.0f} MB together")


if __name__ == "__main__":
    main()

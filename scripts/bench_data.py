"""Benchmark: the data path against its peers in the same run.

1. The loader's time per step as a share of a quickstart step (goal: at most 1%). The peer: the
   README's default job (`partrain launch quickstart`, dp=2 on CPU), run here for --steps steps;
   its median `step_time_s` after the first five. The loader: what one of its ranks does each
   step to get its micro-batches (`train.step.micro_batches`: the sampler's rows, the windows
   read and cut, document ids when masking), timed in this process over the same steps, for
   each way of drawing batches: random windows (the quickstart's), epochs, a blend of two token
   dirs in epochs, and that blend with document masking.
2. `data prepare` on a synthetic corpus of --prepare-gb GB (one JSON Lines file of stdlib source
   documents, written here in a stream; --input parquet: one Parquet file of them; --input text:
   one text file, a single document read in pieces), in a fresh process: MB/s, and the peak resident memory of the prepare process
   (VmHWM) and of its largest tokenizer worker (ru_maxrss of its children), with their sum as
   the bound (goal: under 2 GB for a 5 GB input). With --tokenizer bpe (a byte-level BPE trained
   here, as scripts/bench_prepare.py does) also against a bare `tokenizers` encode_batch over the
   same documents read from the same file in ~1 MiB batches, all cores (goal: ratio >= 0.8), the
   ids checked equal.

    python scripts/bench_data.py                                  # the loader share
    python scripts/bench_data.py --prepare-gb 5 --tokenizer bytes --skip-loader
    python scripts/bench_data.py --prepare-gb 2 --tokenizer bpe --skip-loader
    python scripts/bench_data.py --json
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_prepare import prepare, prepared_digest, train_tokenizer  # noqa: E402

def _stdlib_texts() -> list[str]:
    return [t for t in (p.read_text(encoding="utf-8", errors="replace") for p in
                        sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))) if t]


def _token_dir(directory: Path, name: str, texts: list[str]) -> Path:
    """A byte token dir of `texts` split into short documents (40 lines each)."""
    from partrain.data.prepare import prepare_token_dir

    jsonl = directory / f"{name}.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for text in texts:
            lines = text.split("\n")
            for at in range(0, len(lines), 40):
                f.write(json.dumps({"text": "\n".join(lines[at:at + 40])}) + "\n")
    prepare_token_dir([jsonl], directory / name, workers=1)
    return directory / name


def quickstart_step_s(steps: int, tmp: Path) -> float:
    """The median step time of the quickstart run, after its first five steps."""
    run_dir = tmp / "quickstart"
    done = subprocess.run([sys.executable, "-m", "partrain", "launch", "quickstart",
                           f"train.max_steps={steps}", "train.eval_every=0", "--run-dir",
                           str(run_dir)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"the quickstart run failed:\n{done.stderr[-3000:]}")
    times = [json.loads(line)["step_time_s"] for line in (run_dir / "metrics.jsonl").open()
             if '"step_time_s"' in line]
    return statistics.median(times[5:])


def loader_s(overrides: list[str], steps: int) -> float:
    """Seconds per step of one rank's micro_batches, rank 0 of the quickstart's dp=2."""
    from partrain.config.compose import compose_config
    from partrain.config.resolve import resolve_world
    from partrain.config.validate import resolve_and_validate
    from partrain.data.sampler import build_batches
    from partrain.parallel.mesh import ParallelDims
    from partrain.train.step import micro_batches

    cfg = compose_config(None, overrides)  # the quickstart recipe
    resolve_and_validate(cfg, resolve_world(cfg, None, None, 0))
    p = cfg.parallel
    dims = ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, cp=p.cp)
    batches = build_batches(cfg.data, cfg.train)
    coords = {"dp": 0, "cp": 0, "tp": 0, "pp": 0}
    micro_batches(batches.train, 1, cfg, dims, coords)  # warm: the files' first pages
    start = time.perf_counter()
    for step in range(1, steps + 1):
        micro_batches(batches.train, step, cfg, dims, coords)
    return (time.perf_counter() - start) / steps


def loader(steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        texts = _stdlib_texts()
        web, code = (_token_dir(tmp, "web", texts[::2]), _token_dir(tmp, "code", texts[1::2]))
        blend = f"data.blend=[{{path: {web}, weight: 0.7}}, {{path: {code}, weight: 0.3}}]"
        ways = {"random windows (quickstart)": [],
                "epochs": [f"data.path={web}", "data.source=tokens", "data.sampling=epochs"],
                "blend of 2, epochs": [blend, "data.sampling=epochs"],
                "blend of 2, epochs, document masking": [blend, "data.sampling=epochs",
                                                         "train.document_masking=true"]}
        step = quickstart_step_s(steps, tmp)
        rows = {name: loader_s(overrides, max(steps, 200)) for name, overrides in ways.items()}
    return {"quickstart_step_s": step,
            "loader": {name: {"s": s, "share": s / step} for name, s in rows.items()}}


def write_corpus(path: Path, gigabytes: float, kind: str) -> int:
    """Stdlib source until `gigabytes`, streamed to one JSON Lines or Parquet file (a document
    per source file; Parquet in row groups of 2,000) or one text file; its bytes of text."""
    texts, size, target = _stdlib_texts(), 0, gigabytes * 1e9
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("text", pa.string())])
        with pq.ParquetWriter(path, schema) as writer:
            group = []
            while size < target:
                for text in texts:
                    group.append(text)
                    size += len(text.encode())
                    if len(group) == 2000 or size >= target:
                        writer.write_table(pa.table({"text": group}, schema=schema))
                        group = []
                    if size >= target:
                        break
        return size
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n" if kind == "jsonl" else text)
                size += len(text.encode())
                if size >= target:
                    break
    return size


def _documents(path: Path, kind: str):
    """The corpus's documents again, from the file, in ~1 MiB batches (a text file: its lines)."""
    batch, chars = [], 0
    if kind == "parquet":
        import pyarrow.parquet as pq

        lines = (text for batch in pq.ParquetFile(path).iter_batches(columns=["text"])
                 for text in batch.column(0).to_pylist())
    else:
        lines = (json.loads(line)["text"] if kind == "jsonl" else line
                 for line in open(path, encoding="utf-8"))
    for text in lines:
        batch.append(text)
        chars += len(text)
        if chars >= 1 << 20:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def bare(tok, path: Path, kind: str, eot_id: int) -> tuple[float, str | None]:
    """Seconds inside encode_batch (all cores) over the corpus's documents, and the hash of their
    ids each followed by the end-of-text token (a text file: None, one document in lines)."""
    digest, seconds = hashlib.blake2b(), 0.0
    for batch in _documents(path, kind):
        start = time.perf_counter()
        encodings = tok.encode_batch(batch, add_special_tokens=False)
        seconds += time.perf_counter() - start
        if kind != "text":
            digest.update(np.fromiter((t for e in encodings for t in (*e.ids, eot_id)),
                                      dtype=np.int64).tobytes())
    return seconds, digest.hexdigest() if kind != "text" else None


def prepare_bench(gigabytes: float, kind: str, tokenizer: str, workers: int | None) -> dict:
    from partrain.data.prepare import default_workers

    workers = workers or default_workers()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        corpus = tmp / {"jsonl": "corpus.jsonl", "parquet": "corpus.parquet", "text": "corpus.txt"}[kind]
        nbytes = write_corpus(corpus, gigabytes, kind)
        tok_path, result = None, {}
        if tokenizer == "bpe":
            from tokenizers import Tokenizer

            tok_path = tmp / "tokenizer.json"
            train_tokenizer(_stdlib_texts(), 16384, tok_path)
            tok = Tokenizer.from_file(str(tok_path))
            seconds, expected = bare(tok, corpus, kind, tok.token_to_id("<|endoftext|>"))
            result.update(bare_s=seconds, bare_mb_s=nbytes / 1e6 / seconds)
        run = prepare(corpus, tmp / "tokens", tok_path, workers, 1024.0, val_fraction=0.01)
        if tokenizer == "bpe" and expected is not None and \
                prepared_digest(tmp / "tokens", run["meta"]) != expected:
            sys.exit("prepare's ids differ from encode_batch's")
    meta = run["meta"]
    result.update(
        gigabytes=nbytes / 1e9, input=kind, tokenizer=tokenizer, workers=workers,
        cores=os.cpu_count(), tokens=meta["train_tokens"] + meta["val_tokens"],
        documents=meta["train_documents"] + meta["val_documents"],
        shards=len(meta["train_shards"]) + len(meta["val_shards"]),
        prepare_s=run["seconds"], prepare_mb_s=nbytes / 1e6 / run["seconds"],
        rss_base_mb=run["base_kib"] / 1024, rss_prepare_mb=run["self_kib"] / 1024,
        rss_worker_mb=run["children_kib"] / 1024)
    # A byte dir has no workers: the prepare process is the whole of it.
    result["rss_total_bound_mb"] = result["rss_prepare_mb"] + (
        workers * result["rss_worker_mb"] if tokenizer == "bpe" and workers > 1 else 0)
    if "bare_mb_s" in result:
        result["ratio"] = result["prepare_mb_s"] / result["bare_mb_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="quickstart steps to time")
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument("--prepare-gb", type=float, default=0.0,
                        help="GB of synthetic text to prepare (0: skip)")
    parser.add_argument("--input", choices=("jsonl", "parquet", "text"), default="jsonl")
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bpe")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {}
    if not args.skip_loader:
        result.update(loader(args.steps))
    if args.prepare_gb:
        result["prepare"] = prepare_bench(args.prepare_gb, args.input, args.tokenizer,
                                          args.workers)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if "loader" in result:
        print(f"quickstart step (dp=2 on CPU, median after the first 5 of {args.steps}): "
              f"{result['quickstart_step_s'] * 1e3:.1f} ms")
        for name, row in result["loader"].items():
            print(f"  loader, {name:<40} {row['s'] * 1e3:7.3f} ms/step  "
                  f"{row['share']:7.3%} of a step (goal <= 1%)")
    if "prepare" in result:
        r = result["prepare"]
        print(f"prepare: {r['gigabytes']:.2f} GB of text ({r['input']}, {r['tokenizer']}), "
              f"{r['documents']:,} documents, {r['tokens']:,} tokens in {r['shards']} shard "
              f"files, {r['workers']} workers on {r['cores']} cores")
        print(f"  prepare {r['prepare_s']:8.1f} s  {r['prepare_mb_s']:7.2f} MB/s")
        if "ratio" in r:
            print(f"  bare encode_batch {r['bare_s']:8.1f} s  {r['bare_mb_s']:7.2f} MB/s; ratio "
                  f"prepare/bare {r['ratio']:.2f} (goal >= 0.8)")
        print(f"  peak RSS: prepare process {r['rss_prepare_mb']:.0f} MB (after imports "
              f"{r['rss_base_mb']:.0f} MB), largest worker {r['rss_worker_mb']:.0f} MB; at most "
              f"{r['rss_total_bound_mb']:.0f} MB together (goal < 2048 MB for 5 GB)")


if __name__ == "__main__":
    main()

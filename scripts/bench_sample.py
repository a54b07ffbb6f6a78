"""Benchmark: `partrain sample`'s generation with the KV cache against the full forward per token.

The quickstart model (the default config, as `partrain show` prints it; overrides after the
options, e.g. `model=tiny-moe`), random weights from the seed, one process: `generate` of
partrain.interop.sample with `kv_cache=False` (every token runs the forward over the whole text so
far) and with the cache (the prompt once, then one token at a time), with `partrain sample`'s
defaults (temperature 0.8, top-k 50, seed 0) and its byte-level tokenizer. The two are timed in
turn, --reps times each (the median is kept), after a short warm-up of each; the tokens must be
the same. tokens/s counts the new tokens.

    python scripts/bench_sample.py                         # 200 new tokens on the CPU
    python scripts/bench_sample.py --device cuda model=tiny-moe
    python scripts/bench_sample.py --json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partrain.config.compose import compose_config
from partrain.data.tokenizer import TextTokenizer
from partrain.interop.sample import generate
from partrain.models.llama import build_model


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides, as `partrain show` takes them")
    ap.add_argument("--prompt", default="def main(")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def timed(model, tokenizer, ids, a, new_tokens: int, kv_cache: bool) -> tuple[float, list[int]]:
    """(seconds, new tokens) of one generation."""
    if a.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, tokenizer, ids, new_tokens, a.temperature, a.top_k, a.seed,
                   model.cfg.max_seq_len, lambda text: None, kv_cache=kv_cache)
    if a.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main(argv=None):
    a = parse_args(argv)
    cfg = compose_config(None, a.overrides)
    model = build_model(cfg.model, cfg.train.seed).to(a.device).eval()
    tokenizer = TextTokenizer(None)
    ids = tokenizer.encode(a.prompt)
    for kv_cache in (False, True):  # warm-up: kernels, allocator, the first calls' set-up
        timed(model, tokenizer, ids, a, 8, kv_cache)
    times, tokens = {False: [], True: []}, {}
    for _ in range(a.reps):
        for kv_cache in (False, True):  # in turn, so that a busy machine slows both alike
            seconds, tokens[kv_cache] = timed(model, tokenizer, ids, a, a.max_new_tokens, kv_cache)
            times[kv_cache].append(seconds)
    rate = {k: len(tokens[k]) / statistics.median(v) for k, v in times.items()}
    result = {
        "config": cfg.name, "model": cfg.model.name, "device": a.device,
        "threads": torch.get_num_threads(), "prompt_tokens": len(ids),
        "new_tokens": len(tokens[True]), "max_seq_len": cfg.model.max_seq_len,
        "tokens_per_s_recompute": rate[False], "tokens_per_s_cache": rate[True],
        "ratio": rate[True] / rate[False], "same_tokens": tokens[True] == tokens[False],
    }
    if a.json:
        print(json.dumps(result))
        return
    print(f"{cfg.name} ({cfg.model.name}: {cfg.model.n_layers} layers, dim {cfg.model.dim}, "
          f"{cfg.model.n_heads} heads / {cfg.model.n_kv_heads} kv), {a.device} "
          f"({result['threads']} threads), prompt {len(ids)} tokens, {result['new_tokens']} new, "
          f"median of {a.reps}")
    print(f"  without the cache  {rate[False]:8.1f} tokens/s")
    print(f"  with the cache     {rate[True]:8.1f} tokens/s")
    print(f"  ratio              {result['ratio']:8.2f}x   same tokens: {result['same_tokens']}")


if __name__ == "__main__":
    main()

"""Benchmark: what activation checkpointing saves and what it costs, on one process.

The same Llama-style model (same seed, same batch) with train.activation_checkpointing none,
selective and full:

  activations  the bytes autograd keeps at the end of the forward for the backward, measured by
               tensor accounting (partrain.observe.memory.measure_step: torch's MemTracker), and their
               ratio to none
  peak         the step's highest total (parameters, gradients, activations, temporaries)
  speed        tokens/s of forward + backward (median of --reps, untracked) and its ratio to none:
               full runs each block's forward twice (about 4/3 of the FLOPs), selective only its
               element-wise ops

    python scripts/bench_recompute.py            # a table
    python scripts/bench_recompute.py --json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partrain.config.schema import Config  # noqa: E402
from partrain.models.arith import RECOMPUTE_MODES as MODES
from partrain.models.llama import build_model  # noqa: E402
from partrain.observe.memory import measure_step  # noqa: E402
from partrain.parallel.parallelize import apply_activation_checkpointing  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def model_config(a):
    cfg = OmegaConf.structured(Config).model
    cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads = a.layers, a.dim, a.heads, a.heads // 2
    cfg.vocab_size, cfg.max_seq_len = a.vocab, a.seq
    return cfg


def measure(a, mode: str) -> dict:
    cfg = model_config(a)
    model = build_model(cfg, 0)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq),
                           generator=torch.Generator().manual_seed(0))

    def forward():
        return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    measured = measure_step(model, forward)
    times = []
    for _ in range(a.reps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        forward().backward()
        times.append(time.perf_counter() - start)
    return {"mode": mode, "loss": measured["loss"].item(), "activations": measured["activations"],
            "peak": measured["peak"]["Total"],
            "tokens_per_s": a.batch * a.seq / statistics.median(times)}


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(0)
    rows = [measure(a, mode) for mode in MODES]
    base = rows[0]
    for r in rows:
        r["activations_ratio"] = r["activations"] / base["activations"]
        r["peak_ratio"] = r["peak"] / base["peak"]
        r["speed_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["same_loss"] = r["loss"] == base["loss"]
    if a.json:
        print(json.dumps({"args": vars(a), "modes": rows}))
        return
    print(f"{a.layers} layers, dim {a.dim}, {a.batch} x {a.seq} tokens, fp32 on CPU "
          f"({torch.get_num_threads()} threads)")
    print(f"{'mode':<10} {'activations':>14} {'ratio':>6} {'peak':>14} {'ratio':>6} "
          f"{'tokens/s':>9} {'ratio':>6}  same loss")
    for r in rows:
        print(f"{r['mode']:<10} {r['activations'] / 2**20:>10.1f} MiB {r['activations_ratio']:>6.3f} "
              f"{r['peak'] / 2**20:>10.1f} MiB {r['peak_ratio']:>6.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['speed_ratio']:>6.3f}  {r['same_loss']}")


if __name__ == "__main__":
    main()

"""Benchmark: what context parallelism buys and what it costs, on gloo/CPU.

The same Llama-style model (same seed) on cp = 1, 2 and 4 processes, one sequence per step:

  memory   the activations a rank keeps for the backward of one --seq-token sequence,
           measured by accounting every tensor autograd saves (torch.autograd.graph's
           saved_tensors_hooks; each tensor once), at cp 1, 2, 4: the ratio to cp=1 against the
           1/cp that cp promises (goal: within 15%)
  longest  the longest sequence whose activations fit the budget of cp=1 at --budget-seq
           tokens, found by measuring (bisection over multiples of 2 * cp), at cp 1, 2, 4
           (goal: grows in proportion to cp)
  speed    tokens/s of forward + backward with the ring against the all-to-all at cp=--cp
           (median of --reps), and the bytes each rank sent over its cp group per step,
           counted at the sends, against partrain's formula (`cp_traffic`, as `partrain plan`
           prints it)

    python scripts/bench_cp.py                 # a table
    python scripts/bench_cp.py --json          # {"memory": [...], "longest": [...], "speed": [...]}
    python scripts/bench_cp.py --seq 1024 --budget-seq 256 --reps 2     # quicker
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spawn import join_group, max_over_ranks, run_workers  # noqa: E402

from partrain.config.schema import Config  # noqa: E402
from partrain.models.llama import build_model  # noqa: E402
from partrain.parallel.context import (
    apply_context_parallel,
    count_traffic,
    shard_sequence,
)
from partrain.parallel.dist import end_distributed  # noqa: E402
from partrain.parallel.mesh import ParallelDims  # noqa: E402
from partrain.plan.costs import cp_traffic

GRAIN = 1  # sequence lengths searched are multiples of 2 * cp * GRAIN (the zigzag needs 2 * cp)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096, help="tokens of the measured sequence")
    ap.add_argument("--budget-seq", type=int, default=1024,
                    help="cp=1's sequence length whose activations are the budget")
    ap.add_argument("--cp", type=int, default=2, help="the cp of the ring/all-to-all comparison")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def model_config(args):
    cfg = OmegaConf.structured(Config).model
    cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads = args.layers, args.dim, args.heads, args.kv_heads
    cfg.max_seq_len = max(args.seq, args.budget_seq) * 8
    return cfg


def saved_bytes(model, tokens: torch.Tensor) -> int:
    """Bytes of the activations autograd keeps for the backward of one forward, each tensor
    counted once; the weights it also keeps (a linear layer saves its weight) are the model's,
    not activations, and are left out."""
    seen, weights = {}, {p.data_ptr() for p in model.parameters()}

    def pack(t):
        if t.data_ptr() not in weights:
            seen[(t.data_ptr(), t.shape, t.stride(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).float().sum()
    return sum(seen.values())


def build(args, mesh, cp: int, method: str, seq: int):
    model = build_model(model_config(args), seed=0)
    if cp > 1:
        apply_context_parallel(model, mesh["cp"], OmegaConf.create({"cp_method": method}), seq)
    return model


def sequence(seq: int, cp: int, rank: int) -> torch.Tensor:
    tokens = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    return shard_sequence(tokens, cp, rank) if cp > 1 else tokens


def worker(rank, args, store_path, out_path):
    cp = args.world
    join_group(rank, cp, store_path)
    mesh = ParallelDims(pp=1, dp=1, tp=1, cp=cp).build_mesh("cpu")
    result = {"cp": cp}

    def measure(seq):
        model = build(args, mesh, cp, "ring", seq)
        return max_over_ranks(saved_bytes(model, sequence(seq, cp, rank)))

    result["bytes"] = measure(args.seq)
    # The budget: cp=1's activations at --budget-seq, measured in this process group with cp=1's
    # model (the ranks compute it alike); then the longest seq that fits at this cp.
    one = build_model(model_config(args), seed=0)
    budget = saved_bytes(one, sequence(args.budget_seq, 1, 0))
    step = 2 * cp * GRAIN
    lo, hi = 1, 2 * cp * args.budget_seq // step + 2  # in steps: lo fits, hi does not
    while measure(hi * step) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if measure(mid * step) <= budget else (lo, mid)
    result.update(budget=budget, longest=lo * step)

    if cp == args.cp:
        speed = []
        for method in ("ring", "all_to_all"):
            model = build(args, mesh, cp, method, args.seq)
            tokens = sequence(args.seq, cp, rank)
            times = []
            for rep in range(args.reps + 1):  # the first is a warm-up
                dist.barrier()
                start = time.perf_counter()
                with count_traffic() as sent:
                    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
                elapsed = max_over_ranks(time.perf_counter() - start)
                if rep:
                    times.append(elapsed)
            rows = cp_traffic(model_config(args), 1, args.seq, cp, 1, method, args.layers)
            speed.append({"method": method, "tokens_per_s": args.seq / statistics.median(times),
                          "sent_bytes": max_over_ranks(sum(sent)),
                          "formula_bytes": sum(r["bytes"] for r in rows)})
        result["speed"] = speed
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    del mesh
    end_distributed()  # barrier, gc, destroy: gloo can abort at exit otherwise


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = {}
    for cp in (1, 2, 4):
        args.world = cp
        runs[cp] = run_workers(worker, args, cp)
    base = runs[1]["bytes"]
    memory = [{"cp": cp, "bytes": r["bytes"], "ratio": r["bytes"] / base, "ideal": 1 / cp,
               "off_by": r["bytes"] / base * cp - 1} for cp, r in runs.items()]
    longest = [{"cp": cp, "longest_seq": r["longest"], "growth": r["longest"] / runs[1]["longest"],
                "budget_bytes": r["budget"]} for cp, r in runs.items()]
    speed = runs[args.cp]["speed"]
    result = {"seq": args.seq, "memory": memory, "longest": longest, "speed": speed,
              "ring_over_all_to_all": speed[0]["tokens_per_s"] / speed[1]["tokens_per_s"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"model: {args.layers} layers, dim {args.dim}, {args.heads} heads ({args.kv_heads} kv); "
          f"gloo on CPU, one sequence per step")
    print(f"activations kept for the backward of one {args.seq}-token sequence, per rank:")
    for m in memory:
        print(f"  cp={m['cp']}: {m['bytes'] / 2**20:8.1f} MiB = {m['ratio']:.3f} of cp=1 "
              f"(1/cp = {m['ideal']:.3f}; off by {m['off_by']:+.1%}, goal within 15%)")
    print(f"longest sequence within cp=1's activations at {args.budget_seq} tokens "
          f"({longest[0]['budget_bytes'] / 2**20:.1f} MiB):")
    for x in longest:
        print(f"  cp={x['cp']}: {x['longest_seq']:6d} tokens ({x['growth']:.2f} x cp=1's; goal: "
              f"{x['cp']} x)")
    print(f"cp={args.cp}, {args.seq} tokens, forward + backward, median of {args.reps}:")
    for s in speed:
        print(f"  {s['method']:10s} {s['tokens_per_s']:9.0f} tokens/s; sent {s['sent_bytes']:,.0f} "
              f"bytes per rank (formula {s['formula_bytes']:,}; "
              f"{s['sent_bytes'] / s['formula_bytes']:.3f})")
    print(f"  ring / all-to-all tokens/s: {result['ring_over_all_to_all']:.2f}")


if __name__ == "__main__":
    main()

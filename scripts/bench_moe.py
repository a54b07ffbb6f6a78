"""Benchmark: what expert parallelism costs and saves, on gloo/CPU.

The same mixture-of-experts model (same seed) on --world processes, every one a dp rank with its
own tokens, at ep = 1, 2 and 4 (ep = 1: every rank holds every expert):

  bytes    rows and bytes each rank sent to other ranks in the expert all-to-alls of one
           forward + backward, counted at the sends, against partrain's formula (`moe_traffic`,
           as `partrain plan` prints it, which assumes uniform routing)
  speed    tokens/s of forward, backward and the gradient reduction (DDP for the rest, the
           expert-data-parallel all-reduce for the experts) at ep 2 and 4 against ep = 1 at the
           same world size (median of --reps)
  memory   expert weights per rank against ep = 1's, against 1/ep
  balance  (--balance-steps N > 0) the tiny MoE recipe trained N steps on the quickstart corpus
           (one process, through the CLI) with balancing off, the aux loss and the DeepSeek bias:
           the max/mean tokens per expert, mean over the last 10 steps

    python scripts/bench_moe.py                  # a table
    python scripts/bench_moe.py --json           # {"runs": [...], "balance": [...]}
    python scripts/bench_moe.py --reps 2 --balance-steps 0     # quicker
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spawn import join_group, max_over_ranks, run_workers  # noqa: E402

from partrain.config.schema import Config  # noqa: E402
from partrain.models.arith import moe_block_count  # noqa: E402
from partrain.models.llama import build_model  # noqa: E402
from partrain.parallel.data import apply_data_parallel  # noqa: E402
from partrain.parallel.dist import end_distributed  # noqa: E402
from partrain.parallel.expert import (
    apply_expert_parallel,
    average_expert_gradients,
    count_traffic,
)
from partrain.parallel.mesh import ParallelDims  # noqa: E402
from partrain.plan.costs import moe_traffic

BALANCE = ("none", "aux_loss", "bias")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4, help="processes (dp ranks)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--balance-steps", type=int, default=100,
                    help="training steps per balancing mode (0: skip)")
    ap.add_argument("--bias-rate", type=float, default=0.01,
                    help="model.moe.bias_update_rate of the bias run (DeepSeek's 0.001 is for "
                         "runs of many thousands of steps)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def model_config(args):
    cfg = OmegaConf.structured(Config).model
    cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads = args.layers, args.dim, 4, 4
    cfg.max_seq_len = args.seq
    moe = cfg.moe
    moe.n_experts, moe.top_k, moe.expert_ffn_dim = args.experts, args.top_k, args.expert_ffn
    return cfg


def worker(rank, args, store_path, out_path):
    join_group(rank, args.world, store_path)
    dims = ParallelDims(pp=1, dp=args.world, tp=1, ep=args.ep)
    mesh = dims.build_mesh("cpu")
    expert_mesh = dims.build_expert_mesh("cpu") if dims.ep_enabled else None
    cfg = model_config(args)
    model = build_model(cfg, seed=0)
    if expert_mesh is not None:
        apply_expert_parallel(model, expert_mesh["ep"])
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if ".experts." in n)
    ddp = apply_data_parallel(model, mesh["dp_cp"])
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    times = []
    for rep in range(args.reps + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        with count_traffic() as sent:
            logits = ddp(tokens)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
            if expert_mesh is not None:
                average_expert_gradients(model, expert_mesh["edp_cp"].get_group(), dims.dp_cp)
        elapsed = max_over_ranks(time.perf_counter() - start)
        ddp.zero_grad(set_to_none=True)
        if rep:
            times.append(elapsed)
    formula = moe_traffic(cfg, args.batch * args.seq, 1, args.ep, moe_block_count(cfg))
    result = {"ep": args.ep, "tokens_per_s": args.world * args.batch * args.seq / statistics.median(times),
              "rows_sent": max_over_ranks(sent["rows_sent"]),
              "bytes_sent": max_over_ranks(sent["bytes_sent"] + sent["count_bytes"]),
              "formula_bytes": formula["bytes_sent"] + formula["count_bytes"],
              "formula_rows": formula["rows_sent"], "expert_bytes": expert_bytes}
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    del ddp, model, mesh, expert_mesh
    end_distributed()  # barrier, gc, destroy: gloo can abort at exit otherwise


def balance_run(mode: str, steps: int, bias_rate: float) -> dict:
    """The moe-tiny recipe on one process for `steps` steps with model.moe.balance=mode."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "partrain", "launch", "moe-tiny", "parallel.dp=1",
               "--nproc-per-node", "1", "train.micro_batch_size=16", f"train.max_steps={steps}",
               "train.eval_every=0", "checkpoint.every=0", "checkpoint.save_last=false",
               f"model.moe.balance={mode}", f"model.moe.bias_update_rate={bias_rate}",
               "--run-dir", str(run_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        steps_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in line]
    tail = steps_[-10:]
    return {"balance": mode, "steps": steps,
            "load_max_over_mean": sum(s["moe_load_balance"] for s in tail) / len(tail),
            "first_step_load": steps_[0]["moe_load_balance"], "final_loss": steps_[-1]["loss"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = []
    for ep in (1, 2, 4):
        if args.world % ep or args.experts % ep:
            continue
        args.ep = ep
        runs.append(run_workers(worker, args, args.world))
    base = runs[0]
    for r in runs:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["memory_ratio"] = r["expert_bytes"] / base["expert_bytes"]
        r["bytes_over_formula"] = r["bytes_sent"] / r["formula_bytes"] if r["formula_bytes"] else None
    balance = ([balance_run(mode, args.balance_steps, args.bias_rate) for mode in BALANCE]
               if args.balance_steps else [])
    result = {"world": args.world, "runs": runs, "balance": balance}
    if args.json:
        print(json.dumps(result))
        return
    print(f"model: {args.layers} MoE blocks, dim {args.dim}, {args.experts} experts (top-"
          f"{args.top_k}, inner {args.expert_ffn}); {args.world} gloo processes on CPU, "
          f"{args.batch} x {args.seq} tokens per rank, forward + backward + gradient reduction")
    for r in runs:
        ratio = (f"{r['bytes_over_formula']:.3f} of the formula's {r['formula_bytes']:,}"
                 if r["formula_bytes"] else "none, as the formula says")
        print(f"  ep={r['ep']}: {r['tokens_per_s']:9.0f} tokens/s ({r['speedup']:.2f} x ep=1); "
              f"expert weights {r['expert_bytes'] / 2**20:6.2f} MiB per rank ({r['memory_ratio']:.3f}"
              f" of ep=1, 1/ep = {1 / r['ep']:.3f}); all-to-all sent {r['bytes_sent']:,.0f} bytes "
              f"per rank ({ratio})")
    if balance:
        print(f"moe-tiny on the quickstart corpus, one process (bias_update_rate {args.bias_rate}):")
    for b in balance:
        print(f"  balance={b['balance']:8s}: load max/mean {b['load_max_over_mean']:.2f} over the "
              f"last 10 of {b['steps']} steps (step 1: {b['first_step_load']:.2f}); loss "
              f"{b['final_loss']:.3f}")


if __name__ == "__main__":
    main()

"""Benchmark: `partrain plan`'s memory model against measured memory, layout by layout.

For each layout of a matrix (dp, tp, sequence parallelism, pp schedules, cp, ZeRO stages, ep,
activation checkpointing, micro-batches), on CPU with gloo:

  predicted  `partrain plan --json`'s peak bytes per rank (memory_per_stage: model state,
             activations in flight, the loss's buffers, a recomputed block)
  measured   `partrain launch ... train.measure_memory=true`: tensor accounting of the run's 2nd
             step on every rank (partrain/observe/memory.py: every storage alive, from the model state
             found at the start to the step's peak)

and prints, per layout, the largest rank's measured peak, the prediction for that rank and their
ratio (goal: within 10%), and the worst ratio over all ranks.

    python scripts/bench_memory.py                 # the whole matrix (a few minutes on 2 cores)
    python scripts/bench_memory.py --only dp2 tp2  # some layouts
    python scripts/bench_memory.py --json
    python scripts/bench_memory.py --device cuda --extra model.dim=1024 ...   # on one GPU
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ("launcher.device=cpu", "train.max_steps=2", "train.eval_every=0", "checkpoint.every=0",
          "checkpoint.save_last=false", "train.global_batch_size=16", "train.seq_len=128")

LAYOUTS = {
    "1 process": ("parallel.dp=1", "train.micro_batch_size=16"),
    "1 process, 4 micro-batches": ("parallel.dp=1", "train.micro_batch_size=4"),
    "dp2": ("parallel.dp=2", "train.micro_batch_size=8"),
    "dp2, 2 micro-batches": ("parallel.dp=2", "train.micro_batch_size=4"),
    "tp2": ("parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=16"),
    "tp2 + sp": ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                 "train.micro_batch_size=16"),
    "pp2 1f1b": ("parallel.dp=1", "parallel.pp=2", "train.micro_batch_size=4"),
    "pp2 gpipe": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=gpipe",
                  "train.micro_batch_size=4"),
    "pp2 interleaved v2": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                           "parallel.pp_virtual_stages=2", "train.micro_batch_size=4"),
    "cp2": ("parallel.dp=1", "parallel.cp=2", "train.micro_batch_size=16"),
    "zero1 dp2": ("parallel.dp=2", "parallel.zero_stage=1", "train.micro_batch_size=8"),
    "zero3 dp2": ("parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=8"),
    "full checkpointing": ("parallel.dp=1", "train.micro_batch_size=16",
                           "train.activation_checkpointing=full"),
    "selective checkpointing": ("parallel.dp=1", "train.micro_batch_size=16",
                                "train.activation_checkpointing=selective"),
    "selective, tp2 + sp": ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                            "train.micro_batch_size=16", "train.activation_checkpointing=selective"),
    "moe ep2": ("moe-tiny", "parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=8"),
    "moe ep2, zero2": ("moe-tiny", "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=2",
                       "train.micro_batch_size=8"),
    "dp2 x tp2 x pp2": ("parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                        "train.micro_batch_size=4"),
}


# One GPU: the layouts of one rank, in the compute dtype of CUDA (bf16 autocast) unless --extra
# says train.dtype=fp32.
ONE_RANK = ("1 process", "1 process, 4 micro-batches", "full checkpointing",
            "selective checkpointing")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="layouts to run (names of LAYOUTS)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the one-rank layouts, measured by max_memory_allocated")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every layout")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def _split(layout: tuple[str, ...]) -> tuple[list[str], list[str]]:
    recipe = [a for a in layout if "=" not in a]
    return recipe, [a for a in layout if "=" in a]


def _common(device: str) -> tuple[str, ...]:
    return tuple(a.replace("launcher.device=cpu", f"launcher.device={device}") for a in COMMON)


def predicted(layout, device: str = "cpu") -> dict:
    recipe, overrides = _split(layout)
    out = subprocess.run([sys.executable, "-m", "partrain", "plan", *recipe, *_common(device),
                          *overrides, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def measured(layout, run_dir: Path, device: str = "cpu") -> dict:
    recipe, overrides = _split(layout)
    proc = subprocess.run([sys.executable, "-m", "partrain", "launch", *recipe, *_common(device),
                           *overrides,
                           "train.measure_memory=true", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, start_new_session=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(layout)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if "memory_peak_bytes" in r)


def compare(name: str, layout, device: str = "cpu") -> dict:
    plan = predicted(layout, device)
    with tempfile.TemporaryDirectory() as tmp:
        record = measured(layout, Path(tmp) / "run", device)
    per_stage = {s["pp_rank"]: s for s in plan["memory_per_stage"]}
    ranks = []
    # On CUDA the allocator's peak is the measurement (the accounting is kept beside it).
    peaks = record.get("memory_cuda_peak_bytes", record["memory_peak_bytes"])
    for rank, (peak, base) in enumerate(zip(peaks, record["memory_base_bytes"])):
        stage = per_stage[plan["ranks"][rank]["pp"]]
        ranks.append({"rank": rank, "measured": peak, "measured_base": base,
                      "predicted": stage["total"], "ratio": stage["total"] / peak,
                      "predicted_parts": {k: v for k, v in stage.items() if k.endswith("_bytes")}})
    top = max(ranks, key=lambda r: r["measured"])
    worst = max(ranks, key=lambda r: abs(r["ratio"] - 1))
    return {"layout": name, "overrides": list(layout), "ranks": ranks, "largest": top,
            "worst_ratio": worst["ratio"]}


def main(argv=None):
    a = parse_args(argv)
    names = a.only or list(ONE_RANK if a.device == "cuda" else LAYOUTS)
    rows = [compare(name, (*LAYOUTS[name], *a.extra), a.device) for name in names]
    if a.json:
        print(json.dumps(rows))
        return
    mib = 2 ** 20
    print(f"{'layout':<28} {'measured':>10} {'predicted':>10} {'ratio':>6} {'worst rank':>10}")
    for r in rows:
        top = r["largest"]
        print(f"{r['layout']:<28} {top['measured'] / mib:>6.1f} MiB {top['predicted'] / mib:>6.1f} MiB "
              f"{top['ratio']:>6.3f} {r['worst_ratio']:>10.3f}")
    worst = max((abs(r["worst_ratio"] - 1) for r in rows), default=0)
    print(f"largest deviation over all ranks: {worst:.1%} (goal: within 10%)")


if __name__ == "__main__":
    main()

"""Benchmark: how the ranks start (launcher.start_method), forked from one rank server per node
against spawned, on the same short run.

Each repetition launches the same CPU run twice through the real CLI (`python -m partrain launch`,
a subprocess, as a user runs it), once per start method, in alternating order: the tiny model,
--steps steps, one checkpoint at the end. Measured per launch: the wall time of the whole command
(composing the config, the ranks' start, training, the save, the end), and the CPU time of the
launcher and every process under it (getrusage of the waited-for children: the ranks, spawned or
forked, and the rank server are all reaped inside that tree). Medians over --reps; ratios
forkserver / spawn (below 1: the fork is faster). The two runs of a repetition must agree on
every step's loss and grad_norm (the start method changes nothing a rank computes).

On a GPU (`--device cuda --layouts dp1`: one rank, the same tiny run on CUDA) the forked start is
checked as the spawned one: the same steps, each loss and grad_norm within --tolerance (relative;
CUDA's kernels need not repeat bit for bit); the largest gap is printed.

    python scripts/bench_start.py                  # dp2 and dp2 x tp2, 3 repetitions, a table
    python scripts/bench_start.py --json           # {"layouts": [{"layout", "ranks", ...}]}
    python scripts/bench_start.py --layouts dp4 --reps 1
    python scripts/bench_start.py --device cuda --layouts dp1 --reps 1 --steps 20
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"dp1": ["parallel.dp=1"], "dp2": ["parallel.dp=2"], "dp4": ["parallel.dp=4"],
           "dp2xtp2": ["parallel.dp=2", "parallel.tp=2"],
           "dp4xtp2": ["parallel.dp=4", "parallel.tp=2"]}
METHODS = ("spawn", "forkserver")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(layout: list[str], method: str, steps: int, run_dir: Path, device: str) -> dict:
    """One launch through the CLI: its wall and CPU seconds and its steps' (loss, grad_norm)."""
    command = [sys.executable, "-m", "partrain", "launch", f"launcher.device={device}", *layout,
               f"launcher.start_method={method}", f"train.max_steps={steps}",
               "train.eval_every=0", f"checkpoint.every={steps}", "--run-dir", str(run_dir)]
    cpu, started = children_cpu(), time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    wall, cpu = time.monotonic() - started, children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{method} {' '.join(layout)}: exit {done.returncode}\n"
                         f"{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps_seen}


def largest_gap(one: list, other: list) -> float:
    """The largest relative difference of any step's loss or grad_norm (inf: other steps)."""
    if [s for s, _, _ in one] != [s for s, _, _ in other]:
        return float("inf")
    return max((abs(a - b) / max(abs(b), 1e-12) for (_, *x), (_, *y) in zip(one, other)
                for a, b in zip(x, y)), default=0.0)


def measure(name: str, reps: int, steps: int, root: Path, device: str, tolerance: float) -> dict:
    layout = LAYOUTS[name]
    ranks = 1
    for key in layout:
        ranks *= int(key.split("=")[1])
    seen = {method: [] for method in METHODS}
    gap = 0.0
    for rep in range(reps):
        order = METHODS if rep % 2 == 0 else METHODS[::-1]
        results = {method: launch(layout, method, steps, root / f"{name}-{method}-{rep}", device)
                   for method in order}
        gap = max(gap, largest_gap(results["forkserver"]["steps"], results["spawn"]["steps"]))
        if gap > tolerance:
            raise SystemExit(f"{name}: the start methods disagree on the steps (largest relative "
                             f"gap {gap:.3g}, tolerance {tolerance:g}): "
                             f"{results['spawn']['steps']} vs {results['forkserver']['steps']}")
        for method in METHODS:
            seen[method].append(results[method])
    row = {"layout": name, "device": device, "ranks": ranks, "reps": reps, "steps": steps,
           "largest_gap": gap}
    for method in METHODS:
        row[f"{method}_wall_s"] = statistics.median(r["wall_s"] for r in seen[method])
        row[f"{method}_cpu_s"] = statistics.median(r["cpu_s"] for r in seen[method])
    row["wall_ratio"] = row["forkserver_wall_s"] / row["spawn_wall_s"]
    row["cpu_ratio"] = row["forkserver_cpu_s"] / row["spawn_cpu_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["dp2", "dp2xtp2"], choices=LAYOUTS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest relative gap of a step's loss or grad_norm between the "
                        "methods (default 0 on cpu: the same bits; 1e-3 on cuda)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tolerance = args.tolerance if args.tolerance is not None else (
        0.0 if args.device == "cpu" else 1e-3)
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        rows = [measure(name, args.reps, args.steps, Path(tmp), args.device, tolerance)
                for name in args.layouts]
    if args.json:
        print(json.dumps({"cores": len(os.sched_getaffinity(0)), "layouts": rows}))
        return
    print(f"{len(os.sched_getaffinity(0))} cores; medians of {args.reps}; {args.steps} steps "
          f"and one save per launch on {args.device}; every launch's steps agreed across the "
          f"methods (largest relative gap {max(r['largest_gap'] for r in rows):.3g})")
    print(f"{'layout':>8} {'ranks':>5} | {'spawn wall':>10} {'fork wall':>9} {'ratio':>6} | "
          f"{'spawn CPU':>9} {'fork CPU':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['layout']:>8} {r['ranks']:>5} | {r['spawn_wall_s']:>9.2f}s "
              f"{r['forkserver_wall_s']:>8.2f}s {r['wall_ratio']:>6.2f} | "
              f"{r['spawn_cpu_s']:>8.2f}s {r['forkserver_cpu_s']:>7.2f}s {r['cpu_ratio']:>6.2f}")


if __name__ == "__main__":
    main()

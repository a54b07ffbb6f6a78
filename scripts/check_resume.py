"""Exact resume on a device: a run stopped at half its steps and resumed against the same run
uninterrupted, step by step (losses and gradient norms; skipped steps included).

On a GPU this checks what CPU tests cannot: fp16 under ZeRO, whose dynamic loss scale a
checkpoint keeps (partrain/parallel/zero.py, ZeroBackend.scaler_state); without it the resumed
run started again at 2^16 and skipped steps the uninterrupted one did not.

    python scripts/check_resume.py --json                                  # CPU, fp32, DDP
    python scripts/check_resume.py --extra launcher.device=cuda train.dtype=fp16 \\
        parallel.zero_stage=1 --nproc 1 --json                             # one GPU, fp16
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ("train.eval_every=0", "checkpoint.save_last=true")


def launch(run_dir: Path, steps: int, every: int, extra: list[str], nproc: int,
           resume: bool = False) -> None:
    args = (["--resume", str(run_dir), f"train.max_steps={steps}"] if resume else
            [*COMMON, *extra, f"train.max_steps={steps}", f"checkpoint.every={every}",
             "--run-dir", str(run_dir)])
    res = subprocess.run([sys.executable, "-m", "partrain", "launch", *args,
                          "--nproc-per-node", str(nproc)], capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"launch {' '.join(args)} exited {res.returncode}:\n{res.stdout[-2000:]}"
                 f"{res.stderr[-3000:]}")


def steps_of(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r and "step" in r}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for both runs")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="check-resume-"))
    half = args.steps // 2
    whole, resumed = work / "whole", work / "resumed"
    launch(whole, args.steps, half, args.extra, args.nproc)
    launch(resumed, half, half, args.extra, args.nproc)
    launch(resumed, args.steps, half, args.extra, args.nproc, resume=True)
    a, b = steps_of(whole), steps_of(resumed)
    rows = []
    for step in range(half + 1, args.steps + 1):
        x, y = a.get(step, {}), b.get(step, {})
        rows.append({"step": step, "loss": x.get("loss"), "resumed_loss": y.get("loss"),
                     "skipped": bool(x.get("skipped")), "resumed_skipped": bool(y.get("skipped"))})
    same = all(r["loss"] == r["resumed_loss"] and r["skipped"] == r["resumed_skipped"]
               for r in rows)
    result = {"extra": args.extra, "steps": args.steps, "resumed_at": half,
              "identical": same, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for r in rows:
            print(f"step {r['step']:4d}  {r['loss']}  {r['resumed_loss']}"
                  f"{'  skipped' if r['skipped'] else ''}{'  resumed skipped' if r['resumed_skipped'] else ''}")
        print("identical" if same else "DIFFERENT")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

"""The GPU path, measured on one CUDA GPU: `partrain launch` as a user runs it, and its figures.

On the machine it runs on:
  1. a token dir made by `partrain data prepare` from text found there (the Python standard
     library's sources, concatenated; the byte tokenizer);
  2. a Llama-3.2-1B-shaped model (1.5B parameters untied) at seq_len 2048, bf16, one rank, NCCL,
     trained for --steps steps in each case:
       ddp              eager blocks (DDP is not wrapped at dp=1: the plain model), fused AdamW
       ddp + compile    train.compile=true
       zero1/2/3        DeepSpeed's CUDA path, bf16, torch's fused AdamW
       zero2 + offload  DeepSpeedCPUAdam on the host (parallel.offload_optimizer=cpu)
       fsdp2            FSDP2 at dp=1 (parallel.zero_backend=fsdp, zero_stage=3)
       zero3 + offload  ZeRO-3 with the optimizer on the host (offload_optimizer=cpu): nvme's peer
       zero3 + nvme     the optimizer's state on the machine's disk (offload_optimizer=nvme)
       float8 ...       compiled, the blocks' linears in FP8 (train.float8, torchao), tensorwise
                        and rowwise: tokens/s against "ddp + compile" and the largest relative
                        gap of any step's loss to its loss (--steps 200 for issue 33's figure)
  3. per case, over the steps after --warmup: tokens/s, partrain's MFU, the MFU by hand
     (plan's FLOPs per token x tokens/s / the GPU's peak), its tokens/s against ddp's, and
     torch.cuda.max_memory_allocated (metrics.jsonl's memory_gib) against `partrain plan`'s
     predicted peak for the same config.

    python scripts/gpu_check.py                     # every case (about 7 minutes on an H100)
    python scripts/gpu_check.py --only ddp "ddp + compile" --extra train.global_batch_size=32
    python scripts/gpu_check.py --json

What one GPU cannot show (NCCL between ranks, tp/pp/cp/ep across GPUs) is the CPU suite's.
"""

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

COMMON = ("model=llama-1b", "data=tokens", "launcher.device=cuda", "launcher.nproc_per_node=1",
          "parallel.dp=1", "train.dtype=bf16", "train.seq_len=2048", "train.global_batch_size=8",
          "train.micro_batch_size=4", "train.eval_every=0", "train.eval_batches=1",
          "train.log_every=5", "checkpoint.every=0", "checkpoint.save_last=false",
          # the 1B shape's rate (recipes/llama-1b-dp8), constant as torchtitan's in
          # gpu_side_by_side: the defaults' 3e-3 (the tiny model's) sent its loss from 8.7 to
          # 18.4 at step 3; at 3e-4 it still jumps, 8.7 to 14.2 (no warmup), and FP8's
          # rounding moves the jump a step: the largest loss gaps sit in steps 2-5
          "optim.lr=3e-4", "optim.warmup_steps=0", "optim.schedule=constant")

CASES = {
    "ddp": (),
    "ddp + compile": ("train.compile=true",),
    "zero1": ("parallel.zero_stage=1",),
    "zero2": ("parallel.zero_stage=2",),
    "zero3": ("parallel.zero_stage=3",),
    "zero2 + offload": ("parallel.zero_stage=2", "parallel.offload_optimizer=cpu"),
    # issue 33: FSDP2 at dp=1 against DDP and DeepSpeed's ZeRO-3, and ZeRO-Infinity's optimizer
    # on the machine's disk against ZeRO-Offload's host memory (DeepSpeed's async_io op: libaio)
    "fsdp2": ("parallel.zero_stage=3", "parallel.zero_backend=fsdp"),
    "zero3 + offload": ("parallel.zero_stage=3", "parallel.offload_optimizer=cpu"),
    "zero3 + nvme": ("parallel.zero_stage=3", "parallel.offload_optimizer=nvme",
                     "parallel.offload_nvme_path={work}/nvme"),
    # issue 33: FP8 against bf16, both compiled (torchao's casts fuse into the blocks)
    "float8 tensorwise": ("train.compile=true", "train.float8=true"),
    "float8 rowwise": ("train.compile=true", "train.float8=true", "train.float8_recipe=rowwise"),
    # The MoE balancing loss under DeepSpeed's fp16 loss scale (its gradient was once divided
    # by the scale): the fp16 run's load balance must follow the bf16 run's, not balance=none's.
    "moe zero1": ("parallel.zero_stage=1", "model.moe.n_experts=8", "model.moe.top_k=2",
                  "model.moe.balance=aux_loss", "model.moe.aux_loss_coef=0.01"),
    "moe zero1 fp16": ("parallel.zero_stage=1", "train.dtype=fp16", "model.moe.n_experts=8",
                       "model.moe.top_k=2", "model.moe.balance=aux_loss",
                       "model.moe.aux_loss_coef=0.01"),
    "moe zero1 unbalanced": ("parallel.zero_stage=1", "model.moe.n_experts=8", "model.moe.top_k=2",
                             "model.moe.balance=none"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(CASES), help="some cases (default: all)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the means "
                    "(compilation, allocator warm-up)")
    ap.add_argument("--corpus-mb", type=int, default=48)
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to every case")
    ap.add_argument("--work", type=Path, help="keep the token dir and run dirs here (default: a "
                    "temporary dir)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def partrain(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partrain", *args], capture_output=capture,
                          text=True)


def make_tokens(work: Path, megabytes: int) -> Path:
    """Text from this machine (the standard library's .py files) -> `partrain data prepare`
    (a token dir already in `work` is used as it is)."""
    tokens = work / "tokens"
    if (tokens / "meta.json").exists():
        return tokens
    text, size = work / "corpus.txt", 0
    with text.open("w", encoding="utf-8") as out:
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                chunk = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(chunk + "\n")
            size += len(chunk)
            if size >= megabytes * 2**20:
                break
    res = partrain("data", "prepare", str(text), "--out", str(tokens))
    if res.returncode:
        sys.exit(f"data prepare failed:\n{res.stderr}")
    return tokens


def plan(overrides: list[str]) -> dict:
    res = partrain("plan", *overrides, "--json")
    if res.returncode:
        sys.exit(f"plan failed:\n{res.stderr}")
    return json.loads(res.stdout)


def run_dir_of(name: str, work: Path) -> Path:
    """Where run_case runs the case `name`."""
    return work / name.replace(" ", "_").replace("+", "")


def run_case(name: str, overrides: list[str], work: Path, warmup: int) -> dict:
    run_dir = run_dir_of(name, work)
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun in the same --work starts over
    start = time.perf_counter()
    # the launch's lines go on to stderr as they come (a stage stopped at its limit still shows
    # how far each case got); the last of them stay for the row of a failed case
    tail = collections.deque(maxlen=200)
    with subprocess.Popen([sys.executable, "-m", "partrain", "launch", *overrides, "--run-dir",
                           str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
        for line in proc.stdout:
            sys.stderr.write(f"[{name}] {line}")
            tail.append(line)
    wall = time.perf_counter() - start
    if proc.returncode:
        row = {"case": name, "failed": f"exit {proc.returncode}", "log": "".join(tail)[-4000:]}
        # the failing rank's traceback is in its own log, which stays on the device machine
        ranks = sorted((run_dir / "logs").glob("rank-*.log"))
        if ranks:
            row["rank_log"] = {p.name: p.read_text(errors="replace")[-4000:] for p in ranks[:2]}
        return row
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s]
    steady = steps[warmup:]
    mean = lambda key: sum(s[key] for s in steady) / len(steady)  # noqa: E731
    return {"case": name, "wall_s": wall, "tokens_per_s": mean("tokens_per_s"),
            "mfu": mean("mfu") if "mfu" in steady[0] else None,
            "memory_gib": max(s["memory_gib"] for s in steps),
            "first_step_s": steps[0]["step_time_s"], "loss_first": steps[0]["loss"],
            "loss_last": steps[-1]["loss"], "losses": [s["loss"] for s in steps],
            **({"load_balance": [s["moe_load_balance"] for s in steps]}
               if "moe_load_balance" in steps[0] else {})}


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU")
    from partrain.observe.metrics import peak_flops

    gpu = torch.cuda.get_device_name(0)
    peak = peak_flops(gpu)
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, peak bf16 "
          f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        tokens = make_tokens(work, args.corpus_mb)
        print(f"token dir made in {time.perf_counter() - start:.0f} s", flush=True)
        for name in args.only or list(CASES):
            overrides = [*COMMON, f"data.path={tokens}", f"train.max_steps={args.steps}",
                         *(o.format(work=work) for o in CASES[name]), *args.extra]
            planned = plan(overrides)
            row = run_case(name, overrides, work, args.warmup)
            row["predicted_gib"] = planned["memory_per_stage"][0]["total"] / 2**30
            if "failed" not in row:
                row["mfu_by_hand"] = (planned["model"]["flops_per_token"] * row["tokens_per_s"]
                                      / peak if peak else None)
                row["memory_ratio"] = row["predicted_gib"] / row["memory_gib"]
            rows.append(row)
            # under --json the whole row (its losses too), so a case cut by a limit loses nothing
            print(json.dumps(row) if "failed" in row or args.json else _line(row), flush=True)
    base = next((r for r in rows if r["case"] == "ddp" and "failed" not in r), None)
    for row in rows:
        if base and "failed" not in row:
            row["vs_ddp"] = row["tokens_per_s"] / base["tokens_per_s"]
    bf16 = next((r for r in rows if r["case"] == "ddp + compile" and "failed" not in r), None)
    for row in rows:
        if bf16 and row["case"].startswith("float8") and "failed" not in row:
            row["vs_bf16_compiled"] = row["tokens_per_s"] / bf16["tokens_per_s"]
            row["loss_gap_vs_bf16"] = max(abs(a - b) / abs(b) for a, b in
                                          zip(row["losses"], bf16["losses"]))
    if args.json:
        print(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=1))
        return
    print(f"\n{'case':<18}{'tokens/s':>10}{'vs ddp':>8}{'MFU':>7}{'by hand':>9}"
          f"{'peak GiB':>10}{'plan GiB':>10}{'plan/meas':>10}")
    for r in rows:
        if "failed" in r:
            print(f"{r['case']:<18}  failed ({r['failed']})")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        hand = f"{r['mfu_by_hand']:.1%}" if r.get("mfu_by_hand") is not None else "-"
        print(f"{r['case']:<18}{r['tokens_per_s']:>10.0f}{r.get('vs_ddp', float('nan')):>8.3f}"
              f"{mfu:>7}{hand:>9}{r['memory_gib']:>10.2f}{r['predicted_gib']:>10.2f}"
              f"{r['memory_ratio']:>10.3f}")
        if "vs_bf16_compiled" in r:
            print(f"{'':<18}against ddp + compile: tokens/s {r['vs_bf16_compiled']:.3f}, "
                  f"largest loss gap {r['loss_gap_vs_bf16']:.2%} over {len(r['losses'])} steps")


def _line(r: dict) -> str:
    return (f"{r['case']}: {r['tokens_per_s']:.0f} tokens/s, mfu {r['mfu']}, peak "
            f"{r['memory_gib']:.2f} GiB (plan {r['predicted_gib']:.2f}), first step "
            f"{r['first_step_s']:.1f} s, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, "
            f"{r['wall_s']:.0f} s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

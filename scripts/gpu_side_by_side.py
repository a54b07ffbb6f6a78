"""Side by side on one CUDA GPU: partrain against torchtitan, the same model, tokens and batch.

Issue 33, point 1. Both train the Llama-3.2-1B shape (16 layers, dim 2048, 32 heads, 8 kv heads,
ffn 8192, vocabulary 128,256, untied: partrain's model=llama-1b; torchtitan's llama3 model with
that shape registered as a flavor, since 0.2.2 ships 8B and up) at seq 2048 in bf16 autocast,
compiled, on the same token dir (`partrain data prepare` of the machine's Python sources, as
scripts/gpu_check.py makes it), --global-batch sequences per step in micro-batches of
--micro-batch, no activation checkpointing (--ckpt full: both recompute every block), AdamW.
Both attend with SDPA (flash); torchtitan's loss is its cross-entropy over full logits, compiled
with the model; partrain's its chunked one.

torchtitan is 0.2.2, the newest release that runs on the device's torch 2.11 (0.3.0 imports
torch.distributed.fsdp.DataParallelMeshDims, which 2.11 lacks). It and what it needs beyond the
device's image travel as wheels in .whl/ (not tracked; `bash scripts/gpu_wheels.sh` makes it:
torchtitan==0.2.2, torchdata, datasets, tyro, dill, multiprocess, docstring-parser, typeguard,
tomli, beside partrain's own), installed to --site on the device.

Per trainer, over the steps after --warmup: tokens/s, MFU by one formula for both (partrain's
plan FLOPs per token x tokens/s / the GPU's bf16 peak; torchtitan's own MFU beside it), peak
memory (torch.cuda.max_memory_allocated), and partrain / torchtitan.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    python scripts/gpu_side_by_side.py --site /tmp/site                # both, no checkpointing
    python scripts/gpu_side_by_side.py --site /tmp/site --ckpt full
    python scripts/gpu_side_by_side.py --site /tmp/site --dry-run      # no GPU: torchtitan's
        config and this script's token-dir loader are built and read once, nothing trains
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402

SEQ = 2048
PROFILE_STEPS = 3
MARK = "side-by-side result: "


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", type=Path, help="where torchtitan's wheels are installed")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10,
                    help="first steps left out of the means (compilation, allocator warm-up)")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--ckpt", choices=("none", "full"), default="none")
    ap.add_argument("--only", choices=("partrain", "torchtitan"))
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler over PROFILE_STEPS steps after the warm-up, in both "
                         "trainers (partrain's train.profile_start): each one's table of the "
                         "kernels that took the GPU's time, on stderr and in the JSON (the "
                         "profiled steps are among the timed ones: take tokens/s from a run "
                         "without it)")
    ap.add_argument("--corpus-mb", type=int, default=48)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--torchtitan-worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- torchtitan, in its own process ---------------------------------------------------------

def _loader(path: str, seq: int, batch: int):
    """A torchtitan dataloader over a partrain token dir: consecutive windows of seq + 1 tokens
    of the train split, the input and its shift by one (one causal document per row: the same
    attention as partrain's)."""
    import numpy as np
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    from partrain.data.tokens import load_tokens

    class TokenDirLoader(BaseDataLoader):
        def __init__(self):
            self.ids = np.asarray(load_tokens(SimpleNamespace(source="tokens", path=path)).train)
            self.offset = 0

        def __iter__(self):
            window = seq + 1
            while True:
                if self.offset + batch * window > len(self.ids):
                    self.offset = 0
                rows = self.ids[self.offset:self.offset + batch * window].reshape(
                    batch, window).astype(np.int64)
                self.offset += batch * window
                rows = torch.from_numpy(rows)
                yield {"input": rows[:, :-1]}, rows[:, 1:]

        def state_dict(self):
            return {"offset": self.offset}

        def load_state_dict(self, state_dict):
            self.offset = state_dict["offset"]

    return TokenDirLoader()


FLAVOR = "partrain-1B"
SPEC = "llama3_partrain"


def register_spec() -> None:
    """torchtitan's llama3 train spec with the Llama-3.2-1B shape as a flavor (0.2.2 ships 8B and
    up: dim 2048, 16 layers, 32 heads, 8 kv heads, ffn 1.5 x 2/3 x 4 x dim rounded up to 256 =
    8192, rope theta 500,000, SDPA, untied), our token-dir loader and no tokenizer."""
    import dataclasses

    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    base = get_train_spec("llama3")
    args = TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.5,
                                rope_theta=500000, attn_type="sdpa")
    register_train_spec(SPEC, dataclasses.replace(
        base, model_args={FLAVOR: args}, build_tokenizer_fn=None, build_validator_fn=None,
        build_dataloader_fn=lambda *, job_config, **_: _loader(
            job_config.training.dataset_path, job_config.training.seq_len,
            job_config.training.local_batch_size)))


def torchtitan_args(tokens: Path, work: Path, steps: int, global_batch: int, micro_batch: int,
                    ckpt: str) -> list[str]:
    """torchtitan's command line for the run: compiled (model and loss), bf16 autocast on one GPU
    (its single-device mixed precision), AdamW at a constant 3e-4, no checkpoints or profiling."""
    return ["--model.name", SPEC, "--model.flavor", FLAVOR,
            "--training.dataset_path", str(tokens), "--training.seq_len", str(SEQ),
            "--training.local_batch_size", str(micro_batch),
            "--training.global_batch_size", str(global_batch), "--training.steps", str(steps),
            "--training.mixed_precision_param", "bfloat16",
            # constant: no warmup, and no decay (by default torchtitan decays over every step)
            "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_ratio", "0",
            "--activation_checkpoint.mode", ckpt, "--compile.enable",
            "--metrics.log_freq", "1", "--job.dump_folder", str(work / "torchtitan")]


LOG = re.compile(r"step:\s*(\d+).*?loss:\s*([\d.]+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def torchtitan_worker(spec: dict) -> dict:
    """Train with torchtitan in this process; its per-step log lines and the peak memory."""
    import logging

    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    from torchtitan.config import ConfigManager

    register_spec()
    config = ConfigManager().parse_args(torchtitan_args(
        Path(spec["tokens"]), Path(spec["work"]), spec["steps"], spec["global_batch"],
        spec["micro_batch"], spec["ckpt"]))
    if spec["dry_run"]:
        from torchtitan.protocols.train_spec import get_train_spec

        train_spec = get_train_spec(config.model.name)
        loader = train_spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None,
                                                job_config=config)
        inputs, labels = next(iter(loader))
        args = train_spec.model_args[config.model.flavor]
        return {"dry_run": True, "input": list(inputs["input"].shape),
                "labels_shift_ok": bool((inputs["input"][:, 1:] == labels[:, :-1]).all()),
                "flavor": config.model.flavor, "ckpt": config.activation_checkpoint.mode,
                "compile": config.compile.enable, "dim": args.dim, "layers": args.n_layers}
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    from torchtitan.tools.logging import init_logger

    init_logger()  # it sets the root logger's handlers up: ours goes beside them
    logging.getLogger().addHandler(Keep())
    # torchtitan resets the peak after every logged step; the run's peak is what is compared
    from torchtitan.components.metrics import DeviceMemoryMonitor
    from torchtitan.train import Trainer

    DeviceMemoryMonitor.reset_peak_stats = lambda self: None
    start = time.perf_counter()
    trainer = Trainer(config)
    profiler = None
    if spec["profile_start"]:
        # partrain's own profiler window around torchtitan's steps: the same table for both
        from partrain.observe.profile import StepProfiler

        profiler = StepProfiler(Path(spec["work"]) / "torchtitan", 0, trainer.device,
                                spec["profile_start"], PROFILE_STEPS)
        step_once = trainer.train_step

        def train_step(data_iterator):
            profiler.begin(trainer.step)
            began = time.perf_counter()
            step_once(data_iterator)  # its metrics line reads the loss: the step is done
            profiler.end(trainer.step, time.perf_counter() - began)

        trainer.train_step = train_step
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    steps = []
    for line in lines:
        m = LOG.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            steps.append({"step": int(m[1]), "loss": float(m[2]),
                          "tokens_per_s": float(m[3].replace(",", "")), "mfu": float(m[4]) / 100})
    result = {"steps": steps, "memory_gib": torch.cuda.max_memory_allocated() / 2**30,
              "wall_s": time.perf_counter() - start}
    if profiler is not None and profiler.path.with_suffix(".txt").exists():
        result["profile"] = profiler.path.with_suffix(".txt").read_text()
    return result


# ---- the comparison ------------------------------------------------------------------------

def run_torchtitan(args, tokens: Path, work: Path) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"tokens": str(tokens), "work": str(work), "steps": args.steps, "port": port,
            "global_batch": args.global_batch, "micro_batch": args.micro_batch,
            "ckpt": args.ckpt, "dry_run": args.dry_run,
            "profile_start": args.warmup + 1 if args.profile else 0}
    env = dict(os.environ)
    if args.site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.site),
                                                          env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, __file__, "--torchtitan-worker", json.dumps(spec)],
                         capture_output=True, text=True, env=env)
    out = [line[len(MARK):] for line in res.stdout.splitlines() if line.startswith(MARK)]
    if res.returncode or not out:
        return {"case": "torchtitan", "failed": f"exit {res.returncode}",
                "log": (res.stdout + res.stderr)[-4000:]}
    result = json.loads(out[-1])
    if args.dry_run:
        return {"case": "torchtitan", **result}
    steady = [s for s in result["steps"] if s["step"] > args.warmup]
    if not steady:
        return {"case": "torchtitan", "failed": "no step logged after the warm-up",
                "log": (res.stdout + res.stderr)[-4000:]}
    mean = lambda key: sum(s[key] for s in steady) / len(steady)  # noqa: E731
    row = {"case": "torchtitan", "tokens_per_s": mean("tokens_per_s"), "mfu_own": mean("mfu"),
           "memory_gib": result["memory_gib"], "loss_first": result["steps"][0]["loss"],
           "loss_last": result["steps"][-1]["loss"], "wall_s": result["wall_s"]}
    if "profile" in result:
        row["profile"] = result["profile"]
    return row


def run_partrain(args, tokens: Path, work: Path) -> dict:
    overrides = [*gpu_check.COMMON, f"data.path={tokens}", f"train.max_steps={args.steps}",
                 "train.compile=true", f"train.global_batch_size={args.global_batch}",
                 f"train.micro_batch_size={args.micro_batch}",
                 f"train.activation_checkpointing={args.ckpt}", "train.log_every=1"]
    if args.dry_run:
        planned = gpu_check.plan(overrides)
        return {"case": "partrain", "dry_run": True,
                "flops_per_token": planned["model"]["flops_per_token"]}
    if args.profile:
        overrides += [f"train.profile_start={args.warmup + 1}",
                      f"train.profile_steps={PROFILE_STEPS}"]
    name = f"partrain ckpt {args.ckpt}"
    row = gpu_check.run_case(name, overrides, work, args.warmup)
    row["case"] = "partrain"
    table = gpu_check.run_dir_of(name, work) / "profile" / "rank-0.txt"
    if args.profile and table.exists():
        row["profile"] = table.read_text()
    row["flops_per_token"] = gpu_check.plan(overrides)["model"]["flops_per_token"]
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.torchtitan_worker:
        # torchtitan logs to stdout too: the result is the line with the marker
        print(MARK + json.dumps(torchtitan_worker(json.loads(args.torchtitan_worker))))
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_side_by_side needs a CUDA GPU (or --dry-run)")
    from partrain.observe.metrics import peak_flops

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run)"
    peak = peak_flops(gpu) if torch.cuda.is_available() else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="side_by_side_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokens = gpu_check.make_tokens(work, args.corpus_mb)
        for name in [args.only] if args.only else ["partrain", "torchtitan"]:
            run = run_partrain if name == "partrain" else run_torchtitan
            rows.append(run(args, tokens, work))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
            if "profile" in rows[-1]:
                print(f"{name}, profiled:\n{rows[-1]['profile']}", file=sys.stderr, flush=True)
    ours = next((r for r in rows if r["case"] == "partrain" and "tokens_per_s" in r), None)
    theirs = next((r for r in rows if r["case"] == "torchtitan" and "tokens_per_s" in r), None)
    report = {"gpu": gpu, "torch": torch.__version__, "ckpt": args.ckpt, "rows": rows}
    if ours and peak:
        for r in (ours, theirs):
            if r:  # one FLOP count for both: partrain's plan, per token, same model
                r["mfu_same_formula"] = ours["flops_per_token"] * r["tokens_per_s"] / peak
    if ours and theirs:
        report["partrain_over_torchtitan"] = {
            "tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "memory": ours["memory_gib"] / theirs["memory_gib"]}
    print(json.dumps(report, indent=1) if args.json else _table(report))


def _table(report: dict) -> str:
    lines = [f"{report['gpu']}, torch {report['torch']}, activation checkpointing "
             f"{report['ckpt']}", f"{'trainer':<12}{'tokens/s':>10}{'MFU':>8}{'own MFU':>9}"
             f"{'peak GiB':>10}{'loss':>16}"]
    for r in report["rows"]:
        if "tokens_per_s" not in r:
            lines.append(f"{r['case']:<12}  {r.get('failed') or 'dry run: ' + json.dumps(r)}")
            continue
        own = r.get("mfu_own", r.get("mfu"))
        own = "-" if own is None else format(own, ".1%")
        lines.append(f"{r['case']:<12}{r['tokens_per_s']:>10.0f}"
                     f"{r.get('mfu_same_formula', float('nan')):>8.1%}"
                     f"{own:>9}{r['memory_gib']:>10.2f}"
                     f"{r['loss_first']:>8.3f}{r['loss_last']:>8.3f}")
    ratio = report.get("partrain_over_torchtitan")
    if ratio:
        lines.append(f"partrain / torchtitan: tokens/s {ratio['tokens_per_s']:.3f}, peak memory "
                     f"{ratio['memory']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

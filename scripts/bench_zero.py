"""Benchmark: what each rank holds under DDP, DeepSpeed ZeRO stages 1-3 and FSDP2 stages 2-3,
against the ZeRO formulas, and FSDP2's tokens/s against DeepSpeed's at the same stage.

One run, dp=2 on 2 gloo processes, the same model, config and batches for every stage: each
stage's model is set up exactly as the workers do it (`apply_data_parallel` for stage 0,
`apply_zero` with the derived DeepSpeed config for 1-3, `apply_fsdp` for the FSDP rows), trained
a few steps for tokens/s, and
then, after the backward of one more step and before its reduction and update (when gradients,
parameters and optimizer state are all alive), every tensor the engine holds is found by walking
the model and the optimizer's objects, deduplicated by storage, and counted as parameters,
gradients or optimizer state (Adam moments and fp32 master weights). Process RSS is not used.

Prediction: partrain.plan.costs.zero_memory (ZeRO paper's per-rank formulas with this run's
dtype; `partrain plan` prints the same). FSDP2 reduce-scatters during backward and frees a block's
gathered weights when its backward ends, so at that point both FSDP stages hold what ZeRO-3 does
(its formula); stage 2's gathered weights live only from a block's forward to its backward.

    python scripts/bench_zero.py          # a table
    python scripts/bench_zero.py --json   # {"stages": [{"stage", "param_bytes", "grad_bytes",
                                          #   "optim_bytes", "predicted_bytes", "tokens_per_s_ratio"}]}
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from _spawn import run_workers  # noqa: E402

from partrain.config.compose import compose_config
from partrain.config.deepspeed import deepspeed_config
from partrain.config.resolve import World, compute_dtype  # noqa: E402
from partrain.config.validate import resolve_and_validate
from partrain.data.batches import rank_micro_batches  # noqa: E402
from partrain.data.tokens import load_tokens
from partrain.models.llama import build_model  # noqa: E402
from partrain.parallel.data import DDPBackend, apply_data_parallel  # noqa: E402
from partrain.parallel.fsdp import FSDPBackend, apply_fsdp
from partrain.parallel.mesh import ParallelDims  # noqa: E402
from partrain.parallel.zero import ZeroBackend, apply_zero
from partrain.plan.costs import zero_memory  # noqa: E402
from partrain.train.optim import build_optimizer, param_groups
from partrain.train.step import forward_backward, loss_function

DP = 2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per stage")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def config(a, stage: int):
    cfg = compose_config("quickstart", [
        f"parallel.dp={DP}", f"parallel.zero_stage={stage}", "launcher.device=cpu",
        f"model.n_layers={a.layers}", f"model.dim={a.dim}", f"model.n_heads={a.dim // 64}",
        f"model.n_kv_heads={a.dim // 64}", f"train.seq_len={a.seq}", "train.global_batch_size=null",
        f"train.micro_batch_size={a.micro_batch_size}", f"train.micro_batches={a.micro_batches}",
        "data.stdlib_max_bytes=2000000"])
    resolve_and_validate(cfg, World(nnodes=1, nproc_per_node=DP))
    return cfg


def _tensors(obj, path: str, seen: set, out: list, depth: int = 0) -> None:
    """Every tensor reachable from obj through attributes (of DeepSpeed's and torch.optim's
    objects), lists, tuples and dict values, with the path it was found under."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if hasattr(obj, "to_local"):  # FSDP2's DTensors: this rank's shard, and its gradient's
        _tensors(obj.to_local(), path, seen, out, depth + 1)
        if obj.is_leaf and obj.grad is not None:
            _tensors(obj.grad, f"{path}.grad", seen, out, depth + 1)
        return
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        grad = obj.grad if obj.is_leaf else None
        for name, sub in (("grad", grad), ("ds_tensor", getattr(obj, "ds_tensor", None))):
            if isinstance(sub, torch.Tensor):
                _tensors(sub, f"{path}.{name}", seen, out, depth + 1)
        return
    if isinstance(obj, dict):
        items = [(k if isinstance(k, (str, int)) else "[key]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set)):
        items = enumerate(obj)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for key, value in items:
        _tensors(value, f"{path}.{key}", seen, out, depth + 1)


def _is_grad(path: str) -> bool:
    return any("grad" in part.lower() or "ipg" in part.lower() for part in path.split("."))


def held_bytes(model, optimizer) -> tuple[dict, dict]:
    """Bytes of the distinct storages the model and optimizer hold, by kind: the module's
    parameters (ZeRO-3: their shards) are params; gradients and the optimizer's gradient buffers
    are grads; everything else the optimizer holds (moments, fp32 master weights) is optim."""
    found, seen = [], set()
    for name, param in model.named_parameters():
        _tensors(param, f"module.{name}", seen, found)
    _tensors(optimizer, "optimizer", seen, found)

    def kind(path):
        if _is_grad(path):
            return "grad"
        return "param" if path.startswith("module.") else "optim"
    order = {"param": 0, "grad": 1, "optim": 2}  # a storage found twice counts as the first
    counted, totals, paths = set(), dict.fromkeys(order, 0), {}
    for path, tensor in sorted(found, key=lambda pt: order[kind(pt[0])]):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in counted:
            continue
        counted.add(storage.data_ptr())
        totals[kind(path)] += storage.nbytes()
        paths.setdefault(kind(path), []).append((path, storage.nbytes()))
    return totals, paths


def worker(rank, a, store_path, out_path):
    sys.stdout = sys.stderr  # DeepSpeed prints op-build lines; stdout is for the table or JSON
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(DP))
    store = dist.FileStore(store_path, DP)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=DP,
                            timeout=timedelta(seconds=300))
    results = []
    for stage, engine in ((0, "ddp"), (1, "deepspeed"), (2, "deepspeed"), (3, "deepspeed"),
                          (2, "fsdp"), (3, "fsdp")):
        cfg = config(a, stage)
        t = cfg.train
        dims = ParallelDims(pp=1, dp=DP, tp=1, zero_stage=stage)
        mesh = dims.build_mesh("cpu")
        model = build_model(cfg.model, t.seed)
        n_params = sum(p.numel() for p in model.parameters())
        fsdp = engine == "fsdp"
        if fsdp:
            apply_fsdp(model, mesh["dp_cp"], None, stage, None, offload=False)
            optimizer = build_optimizer(model, cfg.optim)
            backend = FSDPBackend(model, optimizer, dims, mesh, False, cfg.optim.grad_clip,
                                  mesh["dp_cp"])
        elif stage:
            model, optimizer = apply_zero(model, mesh, dims, deepspeed_config(cfg),
                                          param_groups(model, cfg.optim))
            backend = ZeroBackend(model, optimizer)
        else:
            model = apply_data_parallel(model, mesh["dp"])
            optimizer = build_optimizer(model, cfg.optim)
            backend = DDPBackend(model, optimizer, dims, mesh, None, False, cfg.optim.grad_clip)
        splits = load_tokens(cfg.data)
        loss_fn = loss_function(dims, mesh)
        autocast = torch.autocast("cpu", enabled=False)
        device = torch.device("cpu")

        def micro(step):
            return rank_micro_batches(splits.train, step, global_batch_size=t.global_batch_size,
                                      micro_batch_size=t.micro_batch_size, dp=DP, dp_rank=rank,
                                      seq_len=t.seq_len, seed=t.seed)

        def update():
            if stage and not fsdp:
                model.step()
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        def step(s):
            forward_backward(backend, micro(s), loss_fn, dims, device, autocast)
            update()

        step(0)  # warm-up: optimizer state exists from here on
        times = []
        for s in range(1, a.steps + 1):
            dist.barrier()
            start = time.perf_counter()
            step(s)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        forward_backward(backend, micro(a.steps + 1), loss_fn, dims, device, autocast)
        gc.collect()
        totals, paths = held_bytes(model, optimizer)
        # Between steps FSDP holds its shards alone at either stage (its stage-3 formula).
        predicted = zero_memory(3 if fsdp else stage, n_params, DP,
                                compute_dtype(cfg.train.dtype, False), engine=engine)
        results.append({"stage": stage, "engine": engine, "n_params": n_params,
                        "param_bytes": totals["param"],
                        "grad_bytes": totals["grad"], "optim_bytes": totals["optim"],
                        "predicted": predicted,
                        "predicted_bytes": predicted["total"],
                        "tokens_per_s": t.global_batch_size * t.seq_len / statistics.median(times),
                        "largest": {k: sorted(v, key=lambda x: -x[1])[:4] for k, v in paths.items()}})
        update()
        del model, optimizer, mesh, backend
        gc.collect()
        dist.barrier()
    if rank == 0:
        base = results[0]["tokens_per_s"]
        deepspeed = {r["stage"]: r["tokens_per_s"] for r in results if r["engine"] == "deepspeed"}
        for r in results:
            r["tokens_per_s_ratio"] = r["tokens_per_s"] / base
            if r["engine"] == "fsdp":
                r["vs_deepspeed"] = r["tokens_per_s"] / deepspeed[r["stage"]]
        Path(out_path).write_text(json.dumps({"dp": DP, "stages": results, "torch": torch.__version__}))
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def main(argv=None):
    a = parse_args(argv)
    result = run_workers(worker, a, DP)
    if a.json:
        print(json.dumps({"dp": result["dp"], "stages": [
            {k: s[k] for k in ("stage", "engine", "param_bytes", "grad_bytes", "optim_bytes",
                               "predicted_bytes", "tokens_per_s_ratio", "vs_deepspeed")
             if k in s}
            for s in result["stages"]]}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    n = result["stages"][0]["n_params"]
    mib = 2**20
    table = Table(title=f"MiB held per rank at dp={DP}, Ψ = {n:,} parameters, fp32 on CPU: "
                        "measured (tensors the engine holds) vs the ZeRO formula")
    for col in ("stage", "params", "grads", "optim", "measured", "formula", "predicted",
                "ratio", "tokens/s vs 0", "vs DeepSpeed"):
        table.add_column(col, justify="right")
    for s in result["stages"]:
        measured = s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"]
        name = f"FSDP {s['stage']}" if s["engine"] == "fsdp" else str(s["stage"])
        table.add_row(name, f"{s['param_bytes'] / mib:.2f}",
                      f"{s['grad_bytes'] / mib:.2f}", f"{s['optim_bytes'] / mib:.2f}",
                      f"{measured / mib:.2f}", s["predicted"]["formula"],
                      f"{s['predicted_bytes'] / mib:.2f}", f"{measured / s['predicted_bytes']:.3f}",
                      f"{s['tokens_per_s_ratio']:.2f}",
                      f"{s['vs_deepspeed']:.2f}" if "vs_deepspeed" in s else "")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()

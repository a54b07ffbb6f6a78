"""Benchmark: partrain's DCP checkpoints against every rank doing torch.save of its own tensors.

One run, 2 gloo processes, two layouts one after the other (dp2, tp2), each parallelized as
partrain.train does it (apply_tensor_parallel, then DDP; AdamW from build_optimizer) and trained
one real step so that the Adam moments exist. The state is `build_state`'s (the checkpoint's keys,
DTensor shards under tp). For each layout, medians over --reps repetitions:

  save    partrain's dcp.save (its storage_writer: two writer threads per rank) into a fresh
          dir vs each rank torch.save-ing all its local tensors (replicated ones included) into
          its own file; ratio raw/DCP time, goal >= 0.8
  load    partrain's load_weights + load_optimizer (into the live model and optimizer, zeroed
          first) vs torch.load of each rank's file; ratio raw/DCP. Also dcp.load alone into a
          template (the I/O without partrain's copies into the model)
  bytes   what DCP wrote vs the state's true size (12 bytes per parameter + 8 per step scalar,
          each replicated tensor once, each shard once); goal 1.00-1.01. Raw total for contrast
  async   partrain's asynchronous save (as Checkpointer does: dcp.async_save on its own gloo group,
          the copy of the state on a background thread): the time the loop is blocked (the call,
          then, after the next step's forward and backward, the wait for the copy before the
          optimizer may change the parameters) vs the synchronous save; goal <= 0.25. The write
          is waited for before going on. The background copy and write share the CPU with that
          forward and backward: its slowdown (with a save in flight / alone) is the cost the
          blocked time does not show, printed beside it

Against the page cache: both saves fsync every file (DCP's FileSystemWriter does by default; the
raw save flushes and fsyncs), every file written is then evicted (posix_fadvise DONTNEED, clean
pages after the fsync) so that each load reads from the disk, and os.sync() runs before every
timed operation so that nobody else's dirty pages are written back inside it. Save orders
alternate between repetitions, loads rotate. Every load is checked against the saved tensors.

    python scripts/bench_checkpoint.py                 # ~75M parameters, a table
    python scripts/bench_checkpoint.py --json          # {"layouts": [{"layout", "save_ratio", ..}]}
    python scripts/bench_checkpoint.py --dim 64 --layers 2 --vocab 256 --heads 4 --kv-heads 2
                                                       # a tiny model, in a minute (add --reps 1)
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spawn import run_workers  # noqa: E402

from partrain.checkpoint.checkpointer import _result, storage_writer  # noqa: E402
from partrain.checkpoint.state import build_state, load_optimizer, load_weights
from partrain.config.compose import compose_config
from partrain.config.resolve import World
from partrain.config.validate import resolve_and_validate
from partrain.errors import ConfigError  # noqa: E402
from partrain.models.llama import build_model  # noqa: E402
from partrain.observe.trace import Tracer  # noqa: E402
from partrain.parallel.data import DDPBackend, apply_data_parallel  # noqa: E402
from partrain.parallel.mesh import ParallelDims  # noqa: E402
from partrain.parallel.tensor import apply_tensor_parallel  # noqa: E402
from partrain.plan.costs import true_size
from partrain.train.optim import build_optimizer
from partrain.train.step import forward_backward, loss_function, train_step

WORLD = 2
LAYOUTS = {"dp2": (2, 1), "tp2": (1, 2)}  # name: (dp, tp)
# Short, so that a broken run fails fast, yet long enough for a slowest rank's fsync of ~1 GB on
# a busy disk inside DCP's collectives.
TIMEOUT = timedelta(seconds=120)
GOALS = {"save": 0.8, "load": 0.8, "bytes": (1.0, 1.01), "async": 0.25}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median)")
    ap.add_argument("--dir", help="where the temporary checkpoints go (default: the temp dir if "
                                  "it is on the repository's disk, else the repository)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def config(a, layout: str):
    dp, tp = LAYOUTS[layout]
    cfg = compose_config("quickstart", [
        f"parallel.dp={dp}", f"parallel.tp={tp}", "launcher.device=cpu",
        f"model.n_layers={a.layers}", f"model.dim={a.dim}", f"model.n_heads={a.heads}",
        f"model.n_kv_heads={a.kv_heads}", f"model.vocab_size={a.vocab}", "train.seq_len=32",
        "train.global_batch_size=null", "train.micro_batch_size=1", "train.micro_batches=1"])
    resolve_and_validate(cfg, World(nnodes=1, nproc_per_node=WORLD))
    return cfg


def default_dir() -> Path:
    """The temp dir if it lives on the repository's disk (not a tmpfs), else the repository."""
    repo, tmp = Path(__file__).resolve().parents[1], Path(tempfile.gettempdir())
    return tmp if os.stat(tmp).st_dev == os.stat(repo).st_dev else repo


def file_system(path: Path) -> str:
    """'device (type)' of the mount holding path."""
    best = ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, fstype = line.split()[:3]
        if (str(path) + "/").startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[2]):
            best = (device, fstype, mount)
    return f"{best[0]} ({best[1]})"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(*paths: Path) -> None:
    """Drop the files' pages from the page cache (they are clean: every save fsyncs)."""
    for path in paths:
        for file in (p for p in path.rglob("*") if p.is_file()):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn):
    """(seconds on the slowest rank, fn's result); starts together, nobody's dirty pages pending."""
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), out


def local_tensors(state: dict) -> dict:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def digests(tensors: dict) -> dict:
    return {k: (torch.sum(v, dtype=torch.float64).item(),
                torch.linalg.vector_norm(v.double()).item())
            for k, v in local_tensors(tensors).items()}  # (the generator states are bytes)


def save_raw(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(local_tensors(state), f)
        f.flush()
        os.fsync(f.fileno())


def empty_template(state: dict) -> dict:
    """Uninitialised tensors shaped like the state (DTensor shards where it has them)."""
    def like(v):
        if isinstance(v, DTensor):
            return DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements,
                                      run_check=False, shape=v.shape, stride=v.stride())
        return torch.empty_like(v)
    return {k: like(v) for k, v in state.items()}


def warm_up(work: Path, rank: int, group) -> None:
    """One tiny save and load of each kind, so that no measurement pays first-call costs
    (imports, DCP's thread pool, the async executor)."""
    path = work / "warm-up"
    state = {"w": torch.ones(8)}
    dcp.save(state, storage_writer=storage_writer(path / "dcp"))
    dcp.load(state, checkpoint_id=path / "dcp")
    _result(dcp.async_save(state, storage_writer=storage_writer(path / "async"), process_group=group))
    (path / "raw").mkdir(exist_ok=True)
    save_raw(state, path / "raw" / f"rank-{rank}.pt")
    torch.load(path / "raw" / f"rank-{rank}.pt", weights_only=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)


def measure(layout: str, cfg, a, rank: int, group) -> dict:
    dims = ParallelDims(pp=1, dp=cfg.parallel.dp, tp=cfg.parallel.tp)
    mesh = dims.build_mesh("cpu")
    model = build_model(cfg.model, cfg.train.seed)
    single = [p.numel() for p in model.parameters()]
    if dims.tp_enabled:
        model = apply_tensor_parallel(model, mesh["tp"], cfg.parallel)
    if dims.dp_enabled:
        model = apply_data_parallel(model, mesh["dp"])
    optimizer = build_optimizer(model, cfg.optim)
    backend = DDPBackend(model, optimizer, dims, mesh, None, False, cfg.optim.grad_clip)
    tp_mesh = mesh["tp"] if dims.tp_enabled else None

    # One real step (tp ranks of a dp rank see the same batch) so that the moments exist.
    gen = torch.Generator().manual_seed(dims.coords(rank)["dp"])
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len + 1), generator=gen)
    train_step(backend, [(x[:, :-1], x[:, 1:])], loss_function(dims, mesh), dims, mesh,
               torch.device("cpu"), torch.autocast("cpu", enabled=False), Tracer(False))
    state = build_state(model, optimizer, tp_mesh, zero=False)
    expected = digests(state)
    loss_fn = loss_function(dims, mesh)

    def next_step():
        """The next step's forward and backward (what overlaps an asynchronous save)."""
        forward_backward(backend, [(x[:, :-1], x[:, 1:])], loss_fn, dims, torch.device("cpu"),
                         torch.autocast("cpu", enabled=False))
        model.zero_grad(set_to_none=True)

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=False))
    times, ok, sizes = defaultdict(list), True, {}

    def load_partrain(path):
        load_weights(model, path, tp_mesh)
        load_optimizer(model, optimizer, path, tp_mesh, zero=False)

    def load_template(path):
        template = empty_template(state)
        dcp.load(template, checkpoint_id=path)
        return template

    for rep in range(a.reps):
        base = Path(a.work) / layout / f"rep-{rep}"
        dirs = {"dcp": base / "dcp", "raw": base / "raw", "async": base / "async"}
        raw_file = dirs["raw"] / f"rank-{rank}.pt"
        if rank == 0:
            dirs["raw"].mkdir(parents=True)
        dist.barrier()

        saves = {"dcp": lambda: dcp.save(state, storage_writer=storage_writer(dirs["dcp"])),
                 "raw": lambda: save_raw(state, raw_file)}
        for kind in ("dcp", "raw") if rep % 2 == 0 else ("raw", "dcp"):
            times[f"save_{kind}"].append(timed(saves[kind])[0])
            evict(dirs[kind])
        if rank == 0 and rep == 0:
            sizes = {"dcp_bytes": dir_bytes(dirs["dcp"]), "raw_bytes": dir_bytes(dirs["raw"])}

        loads = ["template", "dcp", "raw"]
        for kind in loads if rep % 2 == 0 else loads[::-1]:
            if kind == "dcp":  # prove the load: nothing of the state may survive in the model
                for param in model.parameters():
                    param.data.zero_()
                optimizer.state.clear()
                state = None
                gc.collect()
            evict(dirs["dcp"], dirs["raw"])
            seconds, loaded = timed({"template": lambda: load_template(dirs["dcp"]),
                                     "dcp": lambda: load_partrain(dirs["dcp"]),
                                     "raw": lambda: torch.load(raw_file, weights_only=True)}[kind])
            times[f"load_{kind}"].append(seconds)
            if kind == "dcp":
                state = loaded = build_state(model, optimizer, tp_mesh, zero=False)
            ok = ok and digests(loaded) == expected
            del loaded
            gc.collect()

        # The next step's forward and backward alone, for the slowdown a save in flight causes.
        os.sync()
        dist.barrier()
        fb_alone = timed(next_step)[0]
        # partrain's asynchronous save (Checkpointer): the copy runs in a background thread while
        # the loop goes on with the next forward and backward; the loop waits for the copy only
        # before the optimizer update. Blocked = the async_save call + that wait.
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=storage_writer(dirs["async"]),
                                process_group=group, async_stager=stager)
        blocked = time.perf_counter() - start
        fb_during = timed(next_step)[0]
        wait = time.perf_counter()
        future.staging_completion.result()
        blocked += time.perf_counter() - wait
        _result(future)
        total = time.perf_counter() - start
        spans = torch.tensor([blocked, total, fb_alone, fb_during], dtype=torch.float64)
        dist.all_reduce(spans, op=dist.ReduceOp.MAX)
        times["async_blocked"].append(spans[0].item())
        times["async_total"].append(spans[1].item())
        times["fb_alone"].append(spans[2].item())
        times["fb_during_save"].append(spans[3].item())
        if rank == 0 and rep == 0:
            sizes["async_bytes"] = dir_bytes(dirs["async"])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base)

    everyone_ok = torch.tensor(int(ok))
    dist.all_reduce(everyone_ok, op=dist.ReduceOp.MIN)
    med = {k: statistics.median(v) for k, v in times.items()}
    true = true_size(cfg.model)
    result = {
        "layout": layout, "dp": dims.dp, "tp": dims.tp,
        "save_dcp_s": med["save_dcp"], "save_raw_s": med["save_raw"],
        "save_ratio": med["save_raw"] / med["save_dcp"],
        "load_dcp_s": med["load_dcp"], "load_raw_s": med["load_raw"],
        "load_ratio": med["load_raw"] / med["load_dcp"],
        "load_template_s": med["load_template"],
        "load_template_ratio": med["load_raw"] / med["load_template"],
        **sizes, "true_bytes": true,
        "true_bytes_from_model": 12 * sum(single) + 8 * len(single),
        "bytes_ratio": sizes.get("dcp_bytes", 0) / true,
        "async_blocked_s": med["async_blocked"], "async_total_s": med["async_total"],
        "async_ratio": med["async_blocked"] / med["save_dcp"],
        "fb_alone_s": med["fb_alone"], "fb_during_save_s": med["fb_during_save"],
        "fb_slowdown": med["fb_during_save"] / med["fb_alone"],
        "loaded_ok": bool(everyone_ok.item()), "n_params": sum(single),
        "samples": dict(times),
    }
    result["met"] = {
        "save": result["save_ratio"] >= GOALS["save"],
        "load": result["load_ratio"] >= GOALS["load"],
        "bytes": GOALS["bytes"][0] <= result["bytes_ratio"] <= GOALS["bytes"][1],
        "async": result["async_ratio"] <= GOALS["async"],
    }
    stager.close()
    return result


def worker(rank, a, store_path, out_path):
    sys.stdout = sys.stderr  # stdout is for the table or the JSON
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    # Every rank creates it, in the same place, as new_group requires (as Checkpointer does).
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    warm_up(Path(a.work), rank, group)
    results = []
    for layout, cfg in a.configs.items():
        results.append(measure(layout, cfg, a, rank, group))
        gc.collect()  # the layout's model, optimizer and mesh went with measure's frame
        dist.barrier()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"layouts": results, "torch": torch.__version__}))
    del group
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def main(argv=None):
    a = parse_args(argv)
    if a.reps < 1:
        sys.exit(f"bench_checkpoint.py: --reps={a.reps} must be at least 1")
    try:
        a.configs = {layout: config(a, layout) for layout in LAYOUTS}
    except ConfigError as e:
        sys.exit(f"bench_checkpoint.py: {e}")
    base = Path(a.dir).resolve() if a.dir else default_dir()
    if not base.is_dir():
        sys.exit(f"bench_checkpoint.py: --dir {base} is not a directory")
    started, load_before = time.perf_counter(), os.getloadavg()
    a.work = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=base)
    try:
        result = run_workers(worker, a, WORLD)
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    result.update(dir=str(base), file_system=file_system(base), reps=a.reps,
                  wall_s=time.perf_counter() - started,
                  load_average={"before": load_before[0], "after": os.getloadavg()[0]},
                  cpus=os.cpu_count(),
                  model={"dim": a.dim, "layers": a.layers, "vocab": a.vocab, "heads": a.heads,
                         "kv_heads": a.kv_heads})
    if a.json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    first = result["layouts"][0]
    mb = 1e6
    table = Table(title=f"checkpoints of a {first['n_params'] / 1e6:.1f}M-parameter Llama "
                        f"(fp32 + AdamW), 2 gloo ranks, on {result['file_system']}: "
                        f"medians of {a.reps}, DCP vs every rank torch.save / torch.load")
    for col in ("layout", "metric", "DCP", "raw", "ratio", "goal", "met?"):
        table.add_column(col, justify="left" if col in ("layout", "metric", "goal") else "right")

    def met(ok):
        return "yes" if ok else "NO"
    for r in result["layouts"]:
        name = r["layout"]
        table.add_row(name, "save s", f"{r['save_dcp_s']:.2f}", f"{r['save_raw_s']:.2f}",
                      f"{r['save_ratio']:.2f}", f"raw/DCP >= {GOALS['save']}",
                      met(r["met"]["save"]))
        table.add_row(name, "load s: load_weights + load_optimizer", f"{r['load_dcp_s']:.2f}",
                      f"{r['load_raw_s']:.2f}", f"{r['load_ratio']:.2f}",
                      f"raw/DCP >= {GOALS['load']}", met(r["met"]["load"]))
        table.add_row(name, "load s: dcp.load of a template", f"{r['load_template_s']:.2f}",
                      f"{r['load_raw_s']:.2f}", f"{r['load_template_ratio']:.2f}",
                      "(for comparison)", "")
        table.add_row(name, f"MB written (true size {r['true_bytes'] / mb:,.1f})",
                      f"{r['dcp_bytes'] / mb:,.1f}", f"{r['raw_bytes'] / mb:,.1f}",
                      f"{r['bytes_ratio']:.4f}", "DCP/true in [1, 1.01]", met(r["met"]["bytes"]))
        table.add_row(name, "async save s: blocked / sync",
                      f"{r['async_blocked_s']:.2f} / {r['save_dcp_s']:.2f}", "",
                      f"{r['async_ratio']:.2f}", f"blocked/sync <= {GOALS['async']}",
                      met(r["met"]["async"]))
        table.add_row(name, "fwd+bwd s: during async save / alone",
                      f"{r['fb_during_save_s']:.2f} / {r['fb_alone_s']:.2f}", "",
                      f"{r['fb_slowdown']:.2f}", "(the cost not in blocked)", "",
                      end_section=True)
    Console(width=140).print(table)
    bad = [r["layout"] for r in result["layouts"] if not r["loaded_ok"]]
    print("every load returned the saved tensors" if not bad
          else f"WARNING: loads differ from the saved tensors in {', '.join(bad)}")
    load = result["load_average"]
    print(f"wall time {result['wall_s']:.0f} s; load average {load['before']:.1f} before, "
          f"{load['after']:.1f} after, on {result['cpus']} CPUs "
          "(other jobs on the machine make the figures noisy)")


if __name__ == "__main__":
    main()

"""Benchmark: partrain's pipeline schedules, against torch.distributed.pipelining and against theory.

One run, P=2 stages on 2 processes (each with a core of its own here), one model and split:
1. partrain's 1F1B against torch.distributed.pipelining's Schedule1F1B on the same two stages
   (same modules, same micro-batches): tokens/s of each and the ratio, alternating in rounds.
2. For each partrain schedule (gpipe, 1f1b, interleaved_1f1b with 2 chunks per rank) and m in
   {P, 2P, 4P}: the measured bubble, each rank's idle time in the step (the step time less its
   F/B compute spans from the tracer), averaged over ranks, against (p-1)/(m+p-1)
   (interleaved (p-1)/(v*m+p-1)); and the replayed bubble: the schedule simulated with the
   step's own measured compute times and free communication. Measured minus replayed is what the
   executor and its transfers add; replayed minus theory is the compute times being unequal
   (stages, cores, noise), which no executor removes.

Each rank is pinned to a core of its own where the machine has enough, and a case's figure is
the median over its timed steps.

    python scripts/bench_pp.py            # tables
    python scripts/bench_pp.py --json     # {"partrain_tokens_per_s", "torch_tokens_per_s", "ratio", "bubble": [...]}
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spawn import run_workers  # noqa: E402

from partrain.models.llama import build_model  # noqa: E402
from partrain.observe.trace import Tracer  # noqa: E402
from partrain.parallel.dist import end_distributed  # noqa: E402
from partrain.parallel.pipeline import apply_pipeline_parallel  # noqa: E402
from partrain.parallel.schedules import bubble_theory, build_schedule, simulate  # noqa: E402

PP = 2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and case")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def model_cfg(a):
    return OmegaConf.create(dict(
        name="bench", n_layers=a.layers, n_heads=max(1, a.dim // 64), n_kv_heads=max(1, a.dim // 64),
        dim=a.dim, ffn_dim=None, multiple_of=32, vocab_size=a.vocab, max_seq_len=a.seq,
        rope_theta=10000.0, norm_eps=1e-5, init_std=0.02))


def micro_batches(a, m):
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, a.vocab, (m, a.micro_batch_size, a.seq + 1), generator=gen)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def partrain_pipeline(a, mesh, schedule, v, tracer):
    section = OmegaConf.create({"pp_schedule": schedule, "pp_virtual_stages": v, "pp_layers": None})
    model = apply_pipeline_parallel(build_model(model_cfg(a), seed=0), mesh, section,
                                    (a.micro_batch_size, a.seq, a.dim), tracer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def torch_pipeline(a, mesh, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = mesh.get_local_rank()
    full = build_model(model_cfg(a), seed=0)
    half = a.layers // PP
    chunk = full.pipeline_chunk(list(range(rank * half, (rank + 1) * half)), first=rank == 0,
                                last=rank == PP - 1)
    stage = PipelineStage(chunk, rank, PP, torch.device("cpu"), group=mesh.get_group())
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(chunk.parameters(), lr=1e-3)
    return schedule, opt


def _step_time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank, a, store_path, out_path):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    if len(os.sched_getaffinity(0)) >= PP:  # a core each: the other rank's threads stay off it
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    store = dist.FileStore(store_path, PP)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=PP,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (PP,), mesh_dim_names=("pp",))
    nullctx = torch.autocast("cpu", enabled=False)
    result = {"bubble": []}

    # 1. partrain 1F1B against torch.distributed.pipelining's Schedule1F1B, m = 2P.
    m = 2 * PP
    micro = micro_batches(a, m)
    tokens = torch.cat([x for x, _ in micro])
    targets = torch.cat([y for _, y in micro])
    ours, ours_opt = partrain_pipeline(a, mesh, "1f1b", 1, None)
    theirs, theirs_opt = torch_pipeline(a, mesh, m)

    def ours_step():
        ours.run(micro, loss_fn, nullctx)
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)

    def theirs_step():
        if rank == 0:
            theirs.step(tokens)
        else:
            theirs.step(target=targets, losses=[])
        theirs_opt.step()
        theirs_opt.zero_grad(set_to_none=True)

    times = {"partrain": [], "torch": []}
    ours_step(), theirs_step()  # warm-up (torch infers stage shapes on its first step)
    for _ in range(a.rounds):
        times["partrain"] += [_step_time(ours_step) for _ in range(a.steps)]
        times["torch"] += [_step_time(theirs_step) for _ in range(a.steps)]
    tokens_per_step = m * a.micro_batch_size * a.seq
    result["partrain_tokens_per_s"] = tokens_per_step / statistics.median(times["partrain"])
    result["torch_tokens_per_s"] = tokens_per_step / statistics.median(times["torch"])
    result["ratio"] = result["partrain_tokens_per_s"] / result["torch_tokens_per_s"]
    del ours, theirs, ours_opt, theirs_opt

    # 2. Measured bubble of each partrain schedule.
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in (PP, 2 * PP, 4 * PP):
            tracer = Tracer(True)
            model, opt = partrain_pipeline(a, mesh, schedule, v, tracer)
            micro = micro_batches(a, m)
            model.run(micro, loss_fn, nullctx)  # warm-up
            opt.zero_grad(set_to_none=True)
            idle, replayed, per_rank = [], [], []
            ranks = build_schedule(schedule, PP, m, v)
            for _ in range(a.steps):
                tracer.spans.clear()
                dist.barrier()
                start = time.perf_counter()
                model.run(micro, loss_fn, nullctx)
                step = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the step ends on its slowest rank
                opt.zero_grad(set_to_none=True)
                spans = {name: end - begin for name, cat, begin, end in tracer.spans
                         if cat == "compute"}
                share = torch.tensor(1 - sum(spans.values()) / step.item())
                dist.all_reduce(share)  # mean over ranks
                idle.append(share.item() / PP)
                every = [None] * PP
                dist.all_gather_object(every, spans)
                sim = simulate(ranks, durations=lambda r, x: every[r][f"{x.op}{x.chunk}.{x.mb}"])
                replayed.append(sim.bubble())
                # each rank's compute in the step, F and B: what theory assumes equal
                per_rank.append([[sum(t for n, t in spans_r.items() if n.startswith(op))
                                  for op in "FB"] for spans_r in every])
            result["bubble"].append({"schedule": schedule, "m": m, "v": v,
                                     "measured": statistics.median(idle),
                                     "replayed": statistics.median(replayed),
                                     "theory": bubble_theory(schedule, PP, m, v),
                                     # per rank, its F and B compute seconds in the step
                                     # (medians over the steps)
                                     "compute_s": [[statistics.median(s[r][i] for s in per_rank)
                                                    for i in range(2)] for r in range(PP)]})
            del model, opt

    if rank == 0:
        result.update({"pp": PP, "model": {"layers": a.layers, "dim": a.dim, "vocab": a.vocab},
                       "micro_batch_size": a.micro_batch_size, "seq_len": a.seq,
                       "torch": torch.__version__})
        Path(out_path).write_text(json.dumps(result))
    del mesh
    end_distributed()  # barrier, gc, destroy: gloo can abort at exit otherwise


def main(argv=None):
    a = parse_args(argv)
    result = run_workers(worker, a, PP)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(title=f"1F1B, pp={PP}, {2 * PP} micro-batches of {a.micro_batch_size} x {a.seq}, "
                       f"{a.layers} layers, dim {a.dim}, torch {result['torch']}")
    for col in ("partrain tokens/s", "torch.distributed.pipelining tokens/s", "ratio"):
        head.add_column(col, justify="right")
    head.add_row(f"{result['partrain_tokens_per_s']:,.0f}", f"{result['torch_tokens_per_s']:,.0f}",
                 f"{result['ratio']:.2f}")
    console.print(head)
    bubbles = Table(title="bubble: idle share of a step, measured from the trace vs theory; "
                          "replayed: the schedule with the measured compute times, free transfers")
    for col in ("schedule", "m", "measured", "theory", "difference", "replayed",
                "measured - replayed", "F+B ms r0/r1"):
        bubbles.add_column(col, justify="right")
    for b in result["bubble"]:
        name = b["schedule"] + (f" (v={b['v']})" if b["v"] > 1 else "")
        bubbles.add_row(name, str(b["m"]), f"{b['measured']:.3f}", f"{b['theory']:.3f}",
                        f"{b['measured'] - b['theory']:+.3f}", f"{b['replayed']:.3f}",
                        f"{b['measured'] - b['replayed']:+.3f}",
                        " / ".join(f"{sum(fb) * 1e3:.0f}" for fb in b["compute_s"]))
    console.print(bubbles)


if __name__ == "__main__":
    main()

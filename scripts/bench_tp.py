"""Benchmark: partrain's tensor parallelism against PyTorch's DTensor tensor parallelism.

The same Llama-style model (same seed), the same layout, the same steps (forward, vocab-parallel
loss, backward, gradient clipping, AdamW), measured in one run on gloo/CPU: the two
implementations alternate in rounds so that both see the same machine. Prints tokens/s of each,
their ratio, and the bytes partrain's tp collectives moved per step, counted by wrapping
torch.distributed's collectives (independent of partrain's own bookkeeping), against the
theoretical count: per layer 2 all-reduces of batch x seq x dim forward and 2 backward, plus
the embedding, the head, the loss and the gradient norm.

    python scripts/bench_tp.py                      # tp=2 on 2 processes
    python scripts/bench_tp.py --dp 2 --tp 2        # dp=2 x tp=2 on 4 processes
    python scripts/bench_tp.py --json               # {"partrain_tokens_per_s", ...}
"""

import argparse
import json
import math
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
from partrain.parallel.data import apply_data_parallel  # noqa: E402
from partrain.parallel.dist import end_distributed  # noqa: E402
from partrain.parallel.grads import clip_grad_norm  # noqa: E402
from partrain.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from partrain.plan.costs import tp_collectives, tp_step_collectives


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per dp rank per step")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and implementation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def model_cfg(a):
    return OmegaConf.create(dict(
        name="bench", n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads, dim=a.dim,
        ffn_dim=None, multiple_of=32 * a.tp, vocab_size=a.vocab, max_seq_len=a.seq,
        rope_theta=10000.0, norm_eps=1e-5, init_std=0.02))


class ByteCounter:
    """Wraps torch.distributed's collectives; counts payload bytes of calls on one group."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self, group):
        self.group, self.active, self.bytes, self.calls = group, False, 0, 0
        self.originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.originals.items():
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.active and kwargs.get("group") is self.group:
                # all_reduce(t), all_gather_into_tensor(out, in), reduce_scatter_tensor(out, in):
                # the payload is the full tensor (the gather's output, the scatter's input).
                full = args[1] if name == "reduce_scatter_tensor" else args[0]
                self.bytes += full.numel() * full.element_size()
                self.calls += 1
            return fn(*args, **kwargs)
        return wrapped


def build_partrain(a, mesh):
    model = build_model(model_cfg(a), seed=0)
    model = apply_tensor_parallel(model, mesh["tp"], OmegaConf.create({"sequence_parallel": False}))
    if a.dp > 1:
        model = apply_data_parallel(model, mesh["dp"])
    tp_group = mesh["tp"].get_group()

    def step(x, y, opt):
        loss = vocab_parallel_cross_entropy(model(x), y, tp_group)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0, tp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return model, step


def build_dtensor(a, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model = build_model(model_cfg(a), seed=0)
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in model.layers.items():
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                     "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        block.attention.n_heads //= a.tp
        block.attention.n_kv_heads //= a.tp
    parallelize_module(model, mesh["tp"], plan)
    dp_group = mesh["dp"].get_group() if a.dp > 1 else None

    def step(x, y, opt):
        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        if dp_group is not None:
            # One flat all-reduce of the local shards over dp (what DDP's buckets do).
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                     for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads]).div_(a.dp)
            dist.all_reduce(flat, group=dp_group)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(chunk.view_as(g))
        # torch's clip_grad_norm_ refuses a mix of DTensor and plain tensors (the norm gains stay
        # plain without sequence parallelism): take each kind's norm, combine, clip both.
        dgrads = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
        pgrads = [p.grad for p in model.parameters() if not isinstance(p.grad, DTensor)]
        dnorm = torch.nn.utils.get_total_norm(dgrads, foreach=True).full_tensor()
        total = torch.sqrt(dnorm ** 2 + torch.nn.utils.get_total_norm(pgrads, foreach=True) ** 2)
        torch.nn.utils.clip_grads_with_norm_(dgrads, 1.0, total, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(pgrads, 1.0, total, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
    return model, step


def worker(rank, a, store_path, out_path):
    from torch.distributed.device_mesh import init_device_mesh

    world = a.dp * a.tp
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (a.dp, a.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    impls = {}
    for name, build in (("partrain", build_partrain), ("dtensor", build_dtensor)):
        model, step = build(a, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        impls[name] = (model, step, opt)

    counter = ByteCounter(mesh["tp"].get_group())
    times = {name: [] for name in impls}
    losses = {name: [] for name in impls}
    for name, (_, step, opt) in impls.items():
        for i in range(a.warmup):
            counter.active = name == "partrain" and i == a.warmup - 1
            losses[name].append(step(x, y, opt).item())
            counter.active = False
    for _ in range(a.rounds):
        for name, (_, step, opt) in impls.items():
            for _ in range(a.steps):
                dist.barrier()
                start = time.perf_counter()
                losses[name].append(step(x, y, opt).item())
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends on its slowest rank
                times[name].append(elapsed.item())

    if rank == 0:
        cfg = model_cfg(a)
        tokens = a.batch * a.seq
        theory_rows = tp_collectives(cfg, tokens, a.tp, False) + tp_step_collectives(cfg, a.tp, False)
        tps = {name: a.dp * tokens / statistics.median(t) for name, t in times.items()}
        result = {
            "partrain_tokens_per_s": tps["partrain"],
            "dtensor_tokens_per_s": tps["dtensor"],
            "ratio": tps["partrain"] / tps["dtensor"],
            "tp_bytes_per_step": counter.bytes,
            "tp_bytes_theory": sum(r["bytes"] for r in theory_rows),
            "tp_block_bytes_theory": 4 * a.layers * tokens * a.dim * 4,
            "tp_collectives_per_step": counter.calls,
            "tp_collectives_theory": sum(r["calls"] for r in theory_rows),
            "loss_first_step": {n: v[0] for n, v in losses.items()},
            "loss_last_step": {n: v[-1] for n, v in losses.items()},
            "layout": {"dp": a.dp, "tp": a.tp},
            "model": {"layers": a.layers, "dim": a.dim, "heads": a.heads, "kv_heads": a.kv_heads,
                      "vocab": a.vocab},
            "batch_per_dp_rank": a.batch, "seq_len": a.seq,
            "timed_steps": a.steps * a.rounds, "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        Path(out_path).write_text(json.dumps(result))
    impls.clear()
    del mesh
    end_distributed()  # barrier, gc, destroy: gloo can abort at exit otherwise


def main(argv=None):
    a = parse_args(argv)
    result = run_workers(worker, a, a.dp * a.tp)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tensor parallelism, dp={a.dp} x tp={a.tp}, {a.layers} layers, dim {a.dim}, "
                        f"{a.batch} x {a.seq} tokens per dp rank, torch {result['torch']}")
    for col in ("", "partrain", "DTensor", "partrain / DTensor"):
        table.add_column(col, justify="right")
    table.add_row("tokens/s", f"{result['partrain_tokens_per_s']:,.0f}",
                  f"{result['dtensor_tokens_per_s']:,.0f}", f"{result['ratio']:.2f}")
    table.add_row("loss, first / last step",
                  f"{result['loss_first_step']['partrain']:.4f} / {result['loss_last_step']['partrain']:.4f}",
                  f"{result['loss_first_step']['dtensor']:.4f} / {result['loss_last_step']['dtensor']:.4f}", "")
    Console().print(table)
    measured, theory = result["tp_bytes_per_step"], result["tp_bytes_theory"]
    print(f"partrain tp collectives per step: {result['tp_collectives_per_step']} calls, "
          f"{measured:,} bytes measured vs {theory:,} theory ({measured / theory:.4f}); "
          f"of which blocks (2 all-reduces fwd + 2 bwd per layer): "
          f"{result['tp_block_bytes_theory']:,} bytes")
    if not math.isclose(measured, theory):
        print("warning: measured tp bytes differ from theory")


if __name__ == "__main__":
    main()

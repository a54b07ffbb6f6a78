"""apply_data_parallel over the dp mesh dimension against the dense single-process reference:
with gradient accumulation (no_sync on all but the last micro-batch), every dp rank ends with the
gradient of the mean loss over the whole global batch, forward and backward in fp32."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from partrain.config.compose import compose_config
from partrain.data.batches import rank_micro_batches
from partrain.models.llama import build_model
from partrain.parallel.data import apply_data_parallel
from partrain.parallel.mesh import ParallelDims
from tests.distributed.helpers import run_distributed

GLOBAL, SEQ = 8, 32


def _grads(model, micro):
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        ctx = model.no_sync() if hasattr(model, "no_sync") and not last else nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(micro)
        loss.backward()
    return {n.removeprefix("module."): p.grad for n, p in model.named_parameters()}


def _check_ddp(rank: int, world_size: int, micro_batch_size: int) -> None:
    cfg = compose_config(None, ["model.n_layers=2", "model.dim=64"])
    tokens = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(1)).numpy()
    batch = dict(global_batch_size=GLOBAL, seq_len=SEQ, seed=3)
    reference = _grads(build_model(cfg.model, 0),
                       rank_micro_batches(tokens, 1, micro_batch_size=GLOBAL, dp=1, dp_rank=0, **batch))
    dims = ParallelDims(pp=1, dp=world_size, tp=1)
    model = apply_data_parallel(build_model(cfg.model, 0), dims.build_mesh("cpu")["dp"])
    grads = _grads(model, rank_micro_batches(tokens, 1, micro_batch_size=micro_batch_size,
                                             dp=world_size, dp_rank=rank, **batch))
    assert grads.keys() == reference.keys()
    for name, ref in reference.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_matches_dense_one_micro_batch():
    run_distributed(_check_ddp, 2, 4)


def test_ddp_matches_dense_with_accumulation():
    run_distributed(_check_ddp, 2, 1)

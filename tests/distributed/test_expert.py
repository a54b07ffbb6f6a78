"""Expert parallelism (partrain.parallel.expert) on real gloo groups: the all-to-all dispatch at
ep 2 and 4 against the same MoE layer run whole on each rank (ep=1): every rank's output and
input gradient, the router's gradient, and each expert slice's gradient against the sum of the
ep group's dense gradients; dropless and with a capacity factor; routings that leave a rank's
experts without a row (the dp4 x ep4 hang: that rank skipped the backward all-to-all); and the
rows each rank sent against the routing."""

import copy

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from partrain.config.schema import ModelConfig
from partrain.models.moe import MoE
from tests.distributed.helpers import run_distributed

pytestmark = pytest.mark.slow


def _layer(capacity_factor: float) -> MoE:
    cfg = OmegaConf.structured(ModelConfig)
    cfg.dim = 32
    cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_ffn_dim = 8, 2, 16
    cfg.moe.n_shared_experts, cfg.moe.capacity_factor = 1, capacity_factor
    torch.manual_seed(0)  # the same weights on every rank
    layer = MoE(cfg, 64)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _force(layer: MoE, routing: str) -> MoE:
    """Routings where a rank's experts receive no row: "starve_last" sends no token to the last
    two experts (the last ep rank's at ep=4), "all_to_first" sends every token to experts 0 and 1
    (every other rank's experts idle). Through the balancing bias, which only picks experts."""
    if routing != "natural":
        layer.balance = "bias"
        bias = torch.zeros(8)
        if routing == "starve_last":
            bias[-2:] = -100.0
        else:
            bias[:2] = 100.0
        layer.expert_bias.copy_(bias)
    return layer


def _check(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.parallel.expert import apply_expert_parallel, count_traffic

    for ep in (2, 4):
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
        ep_group = mesh["ep"].get_group()
        routings = ("natural", "starve_last", "all_to_first") if ep == 4 else ("natural",)
        for capacity_factor, routing in [(c, r) for r in routings for c in (0.0, 1.0)]:
            dense = _force(_layer(capacity_factor), routing)
            gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
            x = torch.randn(2, 12, 32, generator=gen)
            grad_out = torch.randn(2, 12, 32, generator=gen)
            x_dense = x.clone().requires_grad_()
            dense(x_dense).backward(grad_out)

            sharded = apply_expert_parallel(copy.deepcopy(dense), mesh["ep"])
            sharded.zero_grad(set_to_none=True)
            x_ep = x.clone().requires_grad_()
            with count_traffic() as sent:
                out = sharded(x_ep)
                out.backward(grad_out)
            label = f"ep={ep} capacity_factor={capacity_factor} routing={routing}"
            with torch.no_grad():
                want = dense(x)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=label)
            torch.testing.assert_close(x_ep.grad, x_dense.grad, rtol=1e-5, atol=1e-5, msg=label)
            torch.testing.assert_close(sharded.router.weight.grad, dense.router.weight.grad,
                                       rtol=1e-5, atol=1e-5, msg=label)
            n_local, first = 8 // ep, dist.get_rank(ep_group) * (8 // ep)
            for name in ("w1", "w3", "w2"):
                summed = getattr(dense.experts, name).grad.clone()
                dist.all_reduce(summed, group=ep_group)
                torch.testing.assert_close(getattr(sharded.experts, name).grad,
                                           summed[first:first + n_local], rtol=1e-4, atol=1e-5,
                                           msg=f"{label} {name}")
            assert sharded.experts.w1.shape[0] == n_local
            # Rows sent to other ranks: the kept choices for remote experts out, the rows received
            # back, each once forward and once backward (4 exchanges in all over the group).
            _, chosen, _ = dense.route(x.reshape(-1, 32))
            kept = dense._kept(chosen, 2, 12)
            kept = chosen.flatten() if kept is None else chosen[kept]
            remote = int(((kept < first) | (kept >= first + n_local)).sum())
            totals = torch.tensor([sent["rows_sent"], remote], dtype=torch.float64)
            dist.all_reduce(totals, group=ep_group)
            assert totals[0] == 4 * totals[1], (label, totals)
            assert sent["count_bytes"] == (8 - n_local) * 8


def test_expert_parallel_dispatch_matches_the_whole_layer():
    run_distributed(_check, 4)

"""A model of one training step's time on a cluster (`partrain plan --hardware`, and the search).

The step of the slowest pipeline stage, from its parts:

- compute: the stage's FLOPs (6 x active parameters per token, causal attention, a full
  recomputation's extra forward of the blocks) at `matmul_efficiency` of the GPU's peak, lowered
  for GEMMs too thin to fill the GPU (a tp slice of a small hidden size, a micro-batch of few
  tokens);
- tp: the block's collectives (costs.tp_collectives: all-reduces, or all-gathers and
  reduce-scatters under sequence parallelism), on the critical path, over NVLink when a tp group
  fits in a node and over the inter-node links when it spans nodes;
- cp: the ring's key/value blocks or the all-to-alls (costs.cp_traffic), on the critical path;
- ep: the token all-to-alls of the MoE blocks (costs.moe_traffic), on the critical path;
- pp: the schedule's bubble, (p-1)/(m+p-1) of the step ((p-1)/(v m + p-1) interleaved), and the
  point-to-point sends, priced in line with compute: on NCCL partrain's executor posts them in
  the schedule's order (gloo's early receives are a CPU matter: scripts/bench_pp.py);
- dp: the gradient reduction over dp x cp with the overlap partrain really has: DDP's buckets
  overlap the last micro-batch's backward; under pp the average comes after the schedule; ZeRO-1/2
  reduce-scatter at DeepSpeed's step and all-gather the updated weights; ZeRO-3 also gathers every
  weight for every micro-batch's forward and backward;
- offload: ZeRO-Offload's AdamW on the host and the gradients and weights over PCIe.

Ring collectives move 2(n-1)/n of the payload per rank for an all-reduce and (n-1)/n for an
all-gather or reduce-scatter, at the per-GPU bandwidth of the links the group uses.
"""

import math
from dataclasses import dataclass

from partrain.models.arith import count_params, flops_per_token, moe_blocks
from partrain.parallel.schedules import bubble_theory
from partrain.plan.costs import cp_traffic, moe_traffic, tp_collectives
from partrain.plan.hardware import Hardware

# DeepSpeed's own work beyond the collectives, per parameter of the rank: the bf16 -> fp32
# gradient copies into its flat buffers and the weights' copy back (ZeRO-1/2, per step), and
# ZeRO-3's per-module gather and release hooks (per micro-batch). Measured at dp=1 on an H100,
# where there is nothing to communicate (README "On GPUs": a 1.5B model, ZeRO-1/2/3 at 0.963,
# 0.828 and 0.362 of DDP's tokens/s, 2 micro-batches per step).
DEEPSPEED_S_PER_PARAM = {1: 1.1e-11, 2: 5.7e-11, 3: 5.7e-11}
ZERO3_HOOKS_S_PER_PARAM_MB = 2.4e-10
HOST_ADAM_PARAMS_PER_S = 1.5e9  # DeepSpeedCPUAdam over one GPU's host cores (H100 node, measured)
PCIE_BYTES_PER_S = 25e9  # one way, per GPU (PCIe gen4 x16 in practice; gen5 cards reach more)
# GEMMs thinner than this (the smaller of the rows and the per-rank columns) lose efficiency in
# proportion: fewer tiles than the GPU has SMs, and less reuse per byte loaded.
FULL_EFFICIENCY_DIM = 1024


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    micro_batch_size: int = 1
    activation_checkpointing: str = "none"
    offload_optimizer: str = "none"
    cp_method: str = "ring"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def _ring(op: str, payload: float, n: int, bandwidth: float) -> float:
    if n <= 1 or payload <= 0:
        return 0.0
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return factor * payload / bandwidth


def crosses_nodes(span: int, gpus_per_node: int) -> bool:
    """Whether a group of consecutive-stride ranks spanning `span` ranks leaves a node."""
    return span > gpus_per_node


@dataclass(frozen=True)
class Implementation:
    """What the time model assumes of the trainer; partrain's by default. Another trainer's
    published runs are modelled by its own (scripts/bench_time_model.py: Megatron-LM 2021)."""
    dp_overlap: bool = True  # DDP's gradient buckets go out during the last backward
    send_bytes: int = 4  # bytes per element of a pipeline send (partrain: the fp32 residual)
    send_split_tp: bool = False  # each tp rank sends 1/tp of it (Megatron's scatter/gather)


PARTRAIN = Implementation()


def step_time(model_cfg, layout: Layout, global_batch_size: int, seq_len: int, hw: Hardware,
              low_precision: bool = True, impl: Implementation = PARTRAIN) -> dict:
    """Seconds per optimizer step by part, tokens/s, MFU, and what limits the step most."""
    L = layout
    act_bytes = 2 if low_precision else 4
    m = global_batch_size // (L.micro_batch_size * L.dp)  # micro-batches per step
    micro_tokens = L.micro_batch_size * seq_len // L.cp  # one rank's tokens of a micro-batch

    # One micro-batch on one rank of the slowest stage: compute, then what the collectives and
    # the pipeline's sends add on the critical path. Each over the links its group spans: rank
    # order is pp, dp, cp, tp (mesh.py), so tp groups are consecutive ranks, cp groups stride tp,
    # dp groups stride cp x tp, pp groups stride dp x cp x tp.
    model_flops_token = flops_per_token(model_cfg, seq_len)
    compute_mb, efficiency = _compute_per_micro_batch(model_cfg, L, model_flops_token,
                                                      micro_tokens, hw)
    tp_mb = _tp_per_micro_batch(model_cfg, L, micro_tokens, hw, low_precision)
    cp_mb = _cp_per_micro_batch(model_cfg, L, seq_len, hw, act_bytes)
    ep_mb = _ep_per_micro_batch(model_cfg, L, micro_tokens, hw, act_bytes)
    p2p_mb = _p2p_per_micro_batch(model_cfg, L, micro_tokens, hw, impl)
    per_mb = compute_mb + tp_mb + cp_mb + ep_mb + p2p_mb
    v = L.pp_virtual_stages if L.pp > 1 and L.pp_schedule == "interleaved_1f1b" else 1
    bubble = bubble_theory(L.pp_schedule, L.pp, m, v) if L.pp > 1 else 0.0
    pipeline = m * per_mb / (1 - bubble)

    dp_s, zero3_s, offload_s, optimizer_s = _data_parallel(model_cfg, L, m, compute_mb, hw,
                                                           act_bytes, impl)
    total = pipeline + dp_s + zero3_s + offload_s + optimizer_s

    tokens_per_s = global_batch_size * seq_len / total
    mfu = model_flops_token * tokens_per_s / (hw.peak_flops * L.world_size)
    parts = {"compute_s": m * compute_mb, "tp_s": m * tp_mb, "cp_s": m * cp_mb, "ep_s": m * ep_mb,
             "pp_p2p_s": m * p2p_mb, "pp_bubble_s": pipeline - m * per_mb, "dp_s": dp_s,
             "zero3_gather_s": zero3_s, "offload_s": offload_s, "optimizer_s": optimizer_s}
    return {"step_s": total, "tokens_per_s": tokens_per_s, "mfu": mfu, **parts,
            "efficiency": efficiency, "micro_batches": m, "bubble": bubble,
            "limits": limits(parts, total, crosses_nodes(L.tp, hw.gpus_per_node),
                             crosses_nodes(L.dp * L.cp * L.tp, hw.gpus_per_node))}


def _compute_per_micro_batch(model_cfg, L: Layout, model_flops_token: float, micro_tokens: int,
                             hw: Hardware) -> tuple[float, float]:
    """Seconds of one micro-batch's forward and backward on a rank of the slowest stage (the
    last: it has the head), and the matmul efficiency they run at."""
    head_flops = 6 * model_cfg.vocab_size * model_cfg.dim
    block_flops = model_flops_token - head_flops
    recompute = {"none": 0.0, "selective": 0.0, "full": 1 / 3}[L.activation_checkpointing]
    stage_flops = (block_flops / L.pp * (1 + recompute) + head_flops) * micro_tokens / L.tp
    thin = min(micro_tokens, model_cfg.dim // L.tp, FULL_EFFICIENCY_DIM)
    efficiency = hw.matmul_efficiency * min(1.0, thin / FULL_EFFICIENCY_DIM) ** 0.5
    compute_mb = stage_flops / (hw.peak_flops * efficiency)
    # Selective recomputation redoes only element-wise work: a few percent of the time.
    if L.activation_checkpointing == "selective":
        compute_mb *= 1.03
    return compute_mb, efficiency


def _tp_per_micro_batch(model_cfg, L: Layout, micro_tokens: int, hw: Hardware,
                        low_precision: bool) -> float:
    """The tp collectives of a micro-batch (the stage's share of the blocks; the recomputed
    forward repeats its collectives)."""
    tp_mb = 0.0
    if L.tp > 1:
        bw = hw.bandwidth(crosses_nodes(L.tp, hw.gpus_per_node))
        for row in tp_collectives(model_cfg, micro_tokens, L.tp, L.sequence_parallel, low_precision):
            share = 1 / L.pp if "attention/MLP" in row["where"] else 1.0
            again = 1 + (0.5 if L.activation_checkpointing == "full" and "(fwd)" in row["where"]
                         and "attention/MLP" in row["where"] else 0.0)
            tp_mb += share * again * row["calls"] * _ring(row["op"], row["bytes"] / row["calls"],
                                                           L.tp, bw)
    return tp_mb


def _cp_per_micro_batch(model_cfg, L: Layout, seq_len: int, hw: Hardware,
                        act_bytes: int) -> float:
    """The cp ring's key/value blocks or the all-to-alls of a micro-batch, for the stage's
    blocks."""
    cp_mb = 0.0
    if L.cp > 1:
        bw = hw.bandwidth(crosses_nodes(L.cp * L.tp, hw.gpus_per_node))
        layers = model_cfg.n_layers / L.pp  # per stage (the balanced split)
        for row in cp_traffic(model_cfg, L.micro_batch_size, seq_len, L.cp, L.tp, L.cp_method,
                              math.ceil(layers), act_bytes):
            cp_mb += row["bytes"] / bw
    return cp_mb


def _ep_per_micro_batch(model_cfg, L: Layout, micro_tokens: int, hw: Hardware,
                        act_bytes: int) -> float:
    """The token all-to-alls of the stage's MoE blocks for a micro-batch."""
    n_moe = len(moe_blocks(model_cfg)) / L.pp if getattr(model_cfg, "moe", None) else 0
    if not (L.ep > 1 and n_moe):
        return 0.0
    # ep groups are consecutive dp ranks: they span ep x cp x tp ranks.
    bw = hw.bandwidth(crosses_nodes(L.ep * L.cp * L.tp, hw.gpus_per_node))
    traffic = moe_traffic(model_cfg, micro_tokens, 1, L.ep, round(n_moe), act_bytes)
    return (traffic["bytes_sent"] + traffic["count_bytes"]) / bw


def _p2p_per_micro_batch(model_cfg, L: Layout, micro_tokens: int, hw: Hardware,
                         impl: Implementation) -> float:
    """The pipeline's sends of the residual stream in and out of each stage, for a micro-batch
    (every chunk of an interleaved schedule sends)."""
    if L.pp <= 1:
        return 0.0
    # pp groups stride dp x cp x tp: they leave the node when the world spans nodes and one
    # stage's ranks fill a node.
    pp_cross = crosses_nodes(L.world_size, hw.gpus_per_node) and \
        L.dp * L.cp * L.tp >= hw.gpus_per_node
    seq_split = L.tp if L.sequence_parallel or impl.send_split_tp else 1
    send = micro_tokens * model_cfg.dim * impl.send_bytes / seq_split
    return 2 * send * L.pp_virtual_stages / hw.bandwidth(pp_cross)


def _data_parallel(model_cfg, L: Layout, m: int, compute_mb: float, hw: Hardware,
                   act_bytes: int, impl: Implementation) -> tuple[float, float, float, float]:
    """The step's data-parallel part over dp x cp, for this rank's parameters (its stage's, its
    tp slice): the gradient reduction (DDP's or ZeRO's), ZeRO-3's per-micro-batch gathers,
    ZeRO-Offload's host step, and the optimizer step on the GPU."""
    nd = L.dp * L.cp
    params = count_params(model_cfg) / (L.pp * L.tp)
    grad_bytes = params * (4 if L.zero_stage == 0 else act_bytes)
    bw_dp = hw.bandwidth(crosses_nodes(L.dp * L.cp * L.tp, hw.gpus_per_node))
    dp_s, zero3_s, offload_s = 0.0, 0.0, 0.0
    if L.zero_stage == 0:
        reduce = _ring("all_reduce", grad_bytes, nd, bw_dp)
        # DDP's buckets go out during the last micro-batch's backward (2/3 of its compute);
        # under pp partrain averages after the schedule.
        hidden = 0.0 if L.pp > 1 or not impl.dp_overlap else 2 / 3 * compute_mb
        dp_s = max(reduce - hidden, 0.0)
    else:
        dp_s = (_ring("reduce_scatter", grad_bytes, nd, bw_dp)
                + _ring("all_gather", params * act_bytes, nd, bw_dp))
        dp_s += params * DEEPSPEED_S_PER_PARAM[L.zero_stage]
        if L.zero_stage == 3:
            zero3_s = m * (2 * _ring("all_gather", params * act_bytes, nd, bw_dp)
                           + params * ZERO3_HOOKS_S_PER_PARAM_MB)
    if L.zero_stage and L.offload_optimizer != "none":
        shard = params / nd
        offload_s = shard / HOST_ADAM_PARAMS_PER_S + shard * 2 * act_bytes / PCIE_BYTES_PER_S
    optimizer_s = 0.0 if offload_s else params / (nd if L.zero_stage else 1) * 16 * 2 / 2e12
    return dp_s, zero3_s, offload_s, optimizer_s


def limits(parts: dict, total: float, tp_cross: bool, dp_cross: bool) -> str:
    """What costs the step most besides compute, in words: "bubble 14%", "tp all-reduce crosses
    nodes 22%", "ZeRO-3 gathers on every micro-batch 30%"."""
    words = {"tp_s": "tp collectives cross nodes" if tp_cross else "tp collectives",
             "cp_s": "cp ring/all-to-all", "ep_s": "ep all-to-all", "pp_p2p_s": "pipeline sends",
             "pp_bubble_s": "bubble",
             "dp_s": "dp reduction across nodes" if dp_cross else "dp reduction",
             "zero3_gather_s": "ZeRO-3 gathers on every micro-batch",
             "offload_s": "optimizer on the host (offload)", "optimizer_s": "optimizer step"}
    overheads = sorted(((v, k) for k, v in parts.items() if k in words and v > 0), reverse=True)
    if not overheads or overheads[0][0] < 0.05 * total:
        return "compute"
    return ", ".join(f"{words[k]} {v / total:.0%}" for v, k in overheads[:2] if v >= 0.05 * total)

"""A model of one training step's time on a cluster (`partrain plan --hardware`, and the search).

A rank of each pipeline stage (`Stage`: its blocks, the embedding on the first, the head and
the loss on the last) is priced by its parts; the slowest sets the pipeline's pace, and each
rank then does the data-parallel work of its own stage's parameters (dp_time.py), the slowest
ending the step. Each term names where its figure comes from; `Implementation` says what the trainer does (partrain's by
default; scripts/bench_time_model.py models other trainers' published runs by their own).

- compute, three kinds of work, not one efficiency for all, at the peak of the compute dtype
  (`hw.compute_peak_flops`: bf16/fp16 on the tensor cores; fp32 on the CUDA cores, as partrain
  never enables TF32, about 1/15 of it on an H100):
  - GEMMs (the blocks' linear layers, the output head): FLOPs at `hw.matmul_efficiency` of the
    peak, lowered for thin GEMMs by x / (x + GEMM_HALF_DIM), x the thinnest side (the rank's
    tokens of a micro-batch, the hidden size / tp; the head's vocabulary / tp): few tiles per
    SM and little reuse per byte (cuBLAS sweeps of GEMM shapes, and the fit below);
  - attention (flash attention): its causal FLOPs at ATTENTION_EFFICIENCY of the GEMMs'
    (FlashAttention-2 paper: forward + backward at 50-73% of A100 peak, about 0.7 of a GEMM's),
    or at the kernel's own fraction of the peak where it is known on that GPU
    (`impl.attention_peak_fraction`: FlashAttention-2 on an H100 reaches 35%, the
    FlashAttention-3 paper's abstract);
    without a fused kernel (`impl.flash_attention` False: Megatron-LM 2021-22) the full score
    matrix's GEMMs at GEMM efficiency and its softmax and dropout through HBM
    (UNFUSED_SCORE_BYTES per score);
  - element-wise work (norms, rotary, SwiGLU's gate, residual adds, the loss's softmax): bytes
    through HBM at the GPU's memory bandwidth (`hw.hbm_bandwidth`), elements of the compute
    dtype; replicated over tp ranks unless sequence parallelism shards it;
  plus recomputation: "full" repeats the forward, "selective" repeats the element-wise forward
  (partrain) and `impl.selective_matmuls` of the forward GEMMs (torchtitan's per-op policy
  recomputes every other matmul).
- tp: the block's collectives (costs.tp_collectives) at the implementation's wire bytes
  (partrain gathers the fp32 residual under sequence parallelism; Megatron sends bf16), less the
  share the implementation overlaps (`impl.tp_overlap`: partrain none; Megatron-Core's
  `--tp-comm-overlap` and torchtitan's async TP most of it).
- cp: the ring's key/value blocks or the all-to-alls (costs.cp_traffic); hidden behind the
  attention it feeds where the implementation overlaps them (`impl.cp_overlap`).
- ep: the token all-to-alls of the MoE blocks (costs.moe_traffic), on the critical path. A MoE's
  MLP is replicated within tp: each tp rank runs it, and routes, on its own tokens, 1/tp of them
  under sequence parallelism and all of them without.
- pp: the schedule's bubble, (p-1)/(m+p-1) of the step ((p-1)/(v m + p-1) interleaved with v
  chunks per rank: `virtual_stage_counts` lists every v the layers allow), and the sends. The
  stages hold parallel.pp_layers's blocks (`Layout.pp_layers`), else an even split; the slowest
  sets the pace, the bubble's too (an upper bound where the stages differ: the fill and drain
  pass the faster ones).
- dp over dp x cp (a MoE's routed experts under ep over the dp/ep x cp ranks holding the same
  ones, after the backward under DDP): the gradient reduction and the updated weights' all-gather, hidden behind
  the backward and forward they overlap (DDP's buckets, Megatron's `--overlap-grad-reduce` and
  `--overlap-param-gather`); ZeRO-3 / FSDP gathers every weight for each micro-batch's forward
  and backward and reduce-scatters its gradients, hidden behind that micro-batch's compute when
  the next layer is prefetched (FSDP2, DeepSpeed's prefetch buckets), plus DeepSpeed's
  per-module hooks (measured).
- offload: ZeRO-Offload's AdamW on the host and the gradients and weights over PCIe.

Links (plan/links.py): a ring collective moves 2(n-1)/n of the payload per rank for an
all-reduce and (n-1)/n for an all-gather or reduce-scatter, at BUS_EFFICIENCY of the per-GPU
bandwidth of its links. Where a group's ranks land decides its links, not its span: a group
inside a node uses NVLink; where any group of its kind has ranks on two nodes (tp=4 on nodes of
6: ranks 4-7), all are priced at that group's network share, min(k x inter_node, intra_node) per
GPU, k its fewest ranks on a node (tp=8 leaves one dp rank per node, one NIC's share).

MFU is against the bf16 peak (`hw.peak_flops`) whatever the dtype, as a run's metrics.jsonl
reports it (observe/metrics.PEAK_BF16_FLOPS): an fp32 run's MFU says how far it is from what the
GPU could do in bf16.

Fitted, on the fit rows of scripts/bench_time_model.py only (Megatron-LM's 2021 A100 table, the
Llama 3 paper's Table 4, and a few rows by rule of each other trainer whose kernels get their
own constants; every other row is held out): the presets' matmul_efficiency for A100 and H100
and GEMM_HALF_DIM.
"""

import math

from partrain.models.arith import (
    ffn_dim,
    flops_per_token,
    head_dim,
    moe_block_count,
    moe_blocks_among,
    stage_layers,
)
from partrain.parallel.schedules import bubble_theory
from partrain.plan.costs import cp_traffic, moe_traffic, tp_collectives
from partrain.plan.dp_time import block_params, data_parallel
from partrain.plan.hardware import Hardware
from partrain.plan.links import BUS_EFFICIENCY, crosses_nodes, group_bandwidth, ring
# The priced data, named here too (fit, search, the scripts and tests import them from here)
from partrain.plan.priced import FSDP_IMPL, PARTRAIN, Implementation, Layout, Stage

# Thin GEMMs: efficiency x / (x + GEMM_HALF_DIM) of a large one, x the thinnest side. Fitted
# on the fit rows (scripts/bench_time_model.py --fit): 32, a 4% penalty at 768 (MPT-125M's
# hidden size, a fit row), 1% at 4096; the grid's other values fit those rows no better.
GEMM_HALF_DIM = 384
# Flash attention's forward + backward against a large GEMM (FlashAttention-2, Dao 2023: 50-73%
# of A100 peak forward, less backward; about 0.7 of cuBLAS's large GEMMs).
ATTENTION_EFFICIENCY = 0.7
# Attention without a fused kernel (batched GEMMs and a fused scale-mask-softmax, Megatron-LM
# 2021-22): bytes per score element through HBM, forward and backward (scores written, read by
# the softmax, probabilities written, dropout's read, write and mask, and the backward's
# reads and writes of each): about 20 bytes.
UNFUSED_SCORE_BYTES = 20


def virtual_stage_counts(n_layers: int, pp: int, max_chunks: int | None = None) -> list[int]:
    """Every number of chunks per rank an interleaved schedule can use: v >= 2 with pp * v
    dividing the layers (each chunk a whole number of them), pp * v at most max_chunks."""
    if pp <= 1:
        return []
    return [v for v in range(2, n_layers // pp + 1)
            if not n_layers % (pp * v) and (max_chunks is None or pp * v <= max_chunks)]


def pipeline_stages(model_cfg, L: Layout) -> list[Stage]:
    """Every pp rank's Stage, in rank order: its chunks' blocks by parallel.pp_layers, else an
    even split."""
    n, moe = model_cfg.n_layers, moe_block_count(model_cfg)
    if L.pp == 1 or L.pp_layers is None:
        return [Stage(n / L.pp, moe / L.pp, r == 0, r == L.pp - 1) for r in range(L.pp)]
    chunks = stage_layers(n, L.pp, len(L.pp_layers) // L.pp, L.pp_layers)
    ranks = [[b for ids in chunks[r::L.pp] for b in ids] for r in range(L.pp)]
    return [Stage(len(ids), moe_blocks_among(model_cfg, ids), r == 0, r == L.pp - 1)
            for r, ids in enumerate(ranks)]


def step_time(model_cfg, layout: Layout, global_batch_size: int, seq_len: int, hw: Hardware,
              low_precision: bool = True, impl: Implementation = PARTRAIN) -> dict:
    """Seconds per optimizer step by part, tokens/s, MFU, and what limits the step most."""
    L = layout
    if L.zero_backend == "fsdp" and impl is PARTRAIN:
        impl = FSDP_IMPL
    act_bytes = 2 if low_precision else 4
    m = global_batch_size // (L.micro_batch_size * L.dp)  # micro-batches per step
    micro_tokens = L.micro_batch_size * seq_len // L.cp  # one rank's tokens of a micro-batch

    # One micro-batch on a rank of each stage: compute, then what the collectives and the
    # pipeline's sends add on the critical path. The slowest stage sets the pipeline's pace,
    # its bubble too ((p-1)/(m+p-1) of the step at that pace: an upper bound where they differ).
    priced = {stage: _per_micro_batch(model_cfg, L, stage, seq_len, micro_tokens, hw, impl,
                                      low_precision)
              for stage in dict.fromkeys(pipeline_stages(model_cfg, L))}
    slowest = max(priced, key=lambda stage: (priced[stage]["per_mb"], stage.last))
    mb = priced[slowest]
    v = L.pp_virtual_stages if L.pp > 1 and L.pp_schedule == "interleaved_1f1b" else 1
    bubble = bubble_theory(L.pp_schedule, L.pp, m, v) if L.pp > 1 else 0.0
    pipeline = m * mb["per_mb"] / (1 - bubble)

    # Then every rank's data-parallel work on its own stage's parameters: the slowest ends it.
    dp_s, zero3_s, offload_s, optimizer_s = max(
        (data_parallel(model_cfg, L, stage, m, priced[stage]["compute_s"], hw, act_bytes, impl)
         for stage in priced), key=sum)
    total = pipeline + dp_s + zero3_s + offload_s + optimizer_s

    tokens_per_s = global_batch_size * seq_len / total
    mfu = flops_per_token(model_cfg, seq_len) * tokens_per_s / (hw.peak_flops * L.world_size)
    parts = {"compute_s": m * mb["compute_s"], "tp_s": m * mb["tp_s"], "cp_s": m * mb["cp_s"],
             "ep_s": m * mb["ep_s"], "pp_p2p_s": m * mb["pp_p2p_s"],
             "pp_bubble_s": pipeline - m * mb["per_mb"], "dp_s": dp_s,
             "zero3_gather_s": zero3_s, "offload_s": offload_s, "optimizer_s": optimizer_s}
    return {"step_s": total, "tokens_per_s": tokens_per_s, "mfu": mfu, **parts,
            "compute_parts": {k: m * s for k, s in mb["compute"].items() if k.endswith("_s")},
            "efficiency": mb["compute"]["efficiency"], "micro_batches": m, "bubble": bubble,
            "limits": limits(parts, total,
                             crosses_nodes(L.world_size, hw.gpus_per_node, (L.tp, 1)),
                             crosses_nodes(L.world_size, hw.gpus_per_node, (L.dp * L.cp, L.tp)))}


def _per_micro_batch(model_cfg, L: Layout, stage: Stage, seq_len: int, micro_tokens: int,
                     hw: Hardware, impl: Implementation, low_precision: bool) -> dict:
    """One micro-batch on a rank of `stage`, by part. Rank order is pp, dp, cp, tp (mesh.py):
    tp groups are consecutive ranks, cp groups stride tp, dp groups stride cp x tp."""
    act_bytes = 2 if low_precision else 4
    c = _compute_per_micro_batch(model_cfg, L, stage, seq_len, micro_tokens, hw, impl,
                                 low_precision)
    parts = {"compute_s": c["gemm_s"] + c["attention_s"] + c["elementwise_s"],
             "tp_s": _tp_per_micro_batch(model_cfg, L, stage, micro_tokens, hw, low_precision,
                                         impl),
             "cp_s": _cp_per_micro_batch(model_cfg, L, stage, seq_len, hw, act_bytes, impl,
                                         c["attention_s"]),
             "ep_s": _ep_per_micro_batch(model_cfg, L, stage, micro_tokens, hw, act_bytes),
             "pp_p2p_s": _p2p_per_micro_batch(model_cfg, L, micro_tokens, hw, impl)}
    return {**parts, "per_mb": sum(parts.values()), "compute": c}


def gemm_efficiency(hw: Hardware, thinnest: float, scale: float = 1.0) -> float:
    """The fraction of peak a GEMM whose thinnest side is `thinnest` reaches (`scale`: the
    trainer's kernels against the preset's, Implementation.gemm_scale)."""
    return hw.matmul_efficiency * scale * thinnest / (thinnest + GEMM_HALF_DIM)


def elementwise_bytes(model_cfg, tp: int, sequence_parallel: bool,
                      element_bytes: int = 2) -> float:
    """Bytes of element-wise work per token and block on one rank, forward and backward (the
    backward reads and writes about twice the forward's): the two norms and residual adds
    (10 x dim, replicated over tp unless sequence parallel), rotary on q and k, SwiGLU's gate
    (3 x ffn), each element `element_bytes` (the compute dtype's)."""
    q, kv = model_cfg.n_heads * head_dim(model_cfg), model_cfg.n_kv_heads * head_dim(model_cfg)
    residual = 10 * model_cfg.dim / (tp if sequence_parallel else 1)
    sharded = (2 * (q + kv) + 3 * ffn_dim(model_cfg)) / tp
    return 3 * element_bytes * (residual + sharded)


def _compute_per_micro_batch(model_cfg, L: Layout, stage: Stage, seq_len: int,
                             micro_tokens: int, hw: Hardware, impl: Implementation,
                             low_precision: bool = True) -> dict:
    """Seconds of one micro-batch's forward and backward on a rank of `stage`, by kind of work,
    and the blocks' GEMM efficiency; at the compute dtype's peak (fp32: the CUDA cores')."""
    peak = hw.compute_peak_flops(low_precision)
    vocab, dim = model_cfg.vocab_size, model_cfg.dim
    head_flops = 6 * vocab * dim if stage.last else 0.0
    # causal, forward and backward, over the heads' width (dim unless model.head_dim is set)
    attention_flops = 6 * stage.blocks * seq_len * model_cfg.n_heads * head_dim(model_cfg)
    # Recomputation repeats forwards (a third of forward + backward).
    matmul_again = {"none": 0.0, "selective": impl.selective_matmuls / 3,
                    "full": 1 / 3}[L.activation_checkpointing]
    attention_again = 1 / 3 if L.activation_checkpointing == "full" else 0.0
    elementwise_again = 0.0 if L.activation_checkpointing == "none" else 1 / 3

    efficiency = gemm_efficiency(hw, min(micro_tokens, dim / L.tp), impl.gemm_scale)
    head_efficiency = gemm_efficiency(hw, min(micro_tokens, dim, vocab / L.tp), impl.gemm_scale)
    tokens = micro_tokens / L.tp
    # The blocks' linear layers, split by tp; a MoE's MLP (the active experts and the router) is
    # replicated within tp and runs on the rank's own tokens: 1/tp of them under sequence
    # parallelism, every one without (each tp rank repeats it).
    common, dense_mlp, moe_mlp = block_params(model_cfg, active=True)
    block_flops = (6 * (stage.blocks * common + (stage.blocks - stage.moe_blocks) * dense_mlp)
                   * tokens + 6 * stage.moe_blocks * moe_mlp
                   * micro_tokens / (L.tp if L.sequence_parallel else 1))
    gemm_s = (block_flops * (1 + matmul_again) / (peak * efficiency)
              + head_flops * tokens / (peak * head_efficiency))
    if impl.flash_attention:
        fraction = impl.attention_peak_fraction or efficiency * ATTENTION_EFFICIENCY
        attention_s = attention_flops * (1 + attention_again) * tokens / (peak * fraction)
    else:  # every score computed (twice the causal FLOPs) and moved through HBM
        scores = seq_len * model_cfg.n_heads / L.tp * stage.blocks
        attention_s = (1 + attention_again) * micro_tokens * (
            2 * attention_flops / L.tp / (peak * efficiency)
            + scores * UNFUSED_SCORE_BYTES / hw.hbm_bandwidth)
    # The loss: fp32 logits written, soft-maxed and differentiated, about 5 passes of 4 bytes.
    loss_bytes = 20 * vocab / L.tp if stage.last else 0.0
    block_bytes = elementwise_bytes(model_cfg, L.tp, L.sequence_parallel,
                                    2 if low_precision else 4) * stage.blocks
    elementwise_s = (block_bytes * (1 + elementwise_again) + loss_bytes) * micro_tokens \
        / hw.hbm_bandwidth
    return {"gemm_s": gemm_s, "attention_s": attention_s, "elementwise_s": elementwise_s,
            "efficiency": efficiency}


def _tp_per_micro_batch(model_cfg, L: Layout, stage: Stage, micro_tokens: int, hw: Hardware,
                        low_precision: bool, impl: Implementation) -> float:
    """The tp collectives of a micro-batch left on the critical path: the stage's blocks' (the
    recomputed forward repeats its collectives), the embedding's on the first stage, the head's
    and the loss's on the last."""
    if L.tp <= 1:
        return 0.0
    bw = group_bandwidth(hw, L.world_size, (L.tp, 1))
    tp_mb = 0.0
    for row in tp_collectives(model_cfg, micro_tokens, L.tp, L.sequence_parallel, low_precision):
        where = row["where"]
        block = "attention/MLP" in where or "q/k norm" in where
        share = (stage.blocks / model_cfg.n_layers if block
                 else stage.first if where.startswith("embedding") else stage.last)
        again = 1 + (0.5 if L.activation_checkpointing == "full" and "(fwd)" in where
                     and "attention/MLP" in where else 0.0)
        payload = row["elements"] * impl.tp_wire_bytes if impl.tp_wire_bytes \
            else row["bytes"] / row["calls"]
        tp_mb += share * again * row["calls"] * ring(row["op"], payload, L.tp, bw)
    return tp_mb * (1 - impl.tp_overlap)


def _cp_per_micro_batch(model_cfg, L: Layout, stage: Stage, seq_len: int, hw: Hardware,
                        act_bytes: int, impl: Implementation, attention_s: float) -> float:
    """The cp ring's key/value blocks or the all-to-alls of a micro-batch, for the stage's
    blocks (whole ones); what attention hides of them where the implementation overlaps."""
    if L.cp <= 1:
        return 0.0
    bw = group_bandwidth(hw, L.world_size, (L.cp, L.tp))
    cp_mb = sum(row["bytes"] for row in cp_traffic(
        model_cfg, L.micro_batch_size, seq_len, L.cp, L.tp, L.cp_method,
        math.ceil(stage.blocks), act_bytes)) / bw
    return max(cp_mb - attention_s, 0.0) if impl.cp_overlap else cp_mb


def _ep_per_micro_batch(model_cfg, L: Layout, stage: Stage, micro_tokens: int, hw: Hardware,
                        act_bytes: int) -> float:
    """The token all-to-alls of the stage's MoE blocks for a micro-batch: a rank routes its own
    tokens, 1/tp of them under sequence parallelism, else every tp rank all of them."""
    if L.ep <= 1 or not stage.moe_blocks:
        return 0.0
    # ep groups are consecutive dp ranks: ep of them, cp x tp apart.
    bw = group_bandwidth(hw, L.world_size, (L.ep, L.cp * L.tp))
    routed = micro_tokens // (L.tp if L.sequence_parallel else 1)
    traffic = moe_traffic(model_cfg, routed, 1, L.ep, round(stage.moe_blocks), act_bytes)
    return (traffic["bytes_sent"] + traffic["count_bytes"]) / bw


def _p2p_per_micro_batch(model_cfg, L: Layout, micro_tokens: int, hw: Hardware,
                         impl: Implementation) -> float:
    """The pipeline's sends of the residual stream in and out of each stage, for a micro-batch
    (every chunk of an interleaved schedule sends), in line with compute: on NCCL partrain's
    executor posts them in the schedule's order."""
    if L.pp <= 1:
        return 0.0
    # pp groups stride dp x cp x tp: on more than one node some stage's send crosses a node
    # boundary (the pipeline keeps its pace), over each GPU's own share of the NICs.
    pp_cross = crosses_nodes(L.world_size, hw.gpus_per_node, (L.pp, L.dp * L.cp * L.tp))
    seq_split = L.tp if L.sequence_parallel or impl.send_split_tp else 1
    send = micro_tokens * model_cfg.dim * impl.send_bytes / seq_split
    return 2 * send * L.pp_virtual_stages / (hw.bandwidth(pp_cross) * BUS_EFFICIENCY)

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

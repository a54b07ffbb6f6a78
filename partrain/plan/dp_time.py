"""The data-parallel part of a step's time (partrain/plan/time_model.py): what one pipeline
stage's rank holds, and the reductions, gathers, host and GPU optimizer steps over the ranks
that hold the same parameters.

Two kinds of parameters meet over two groups (partrain/parallel/expert.py, data.py, zero.py,
fsdp.py). Dense ones (attention, norms, dense MLPs, the router and shared experts, embedding and
head) are reduced over dp x cp. A MoE's routed experts under ep > 1 are split over the ep ranks
and replicated on the dp/ep x cp ranks that hold the same experts (edp x cp): their gradients are
reduced there, and ZeRO and FSDP shard them there. partrain replicates a MoE's MLP within tp
(each tp rank holds it whole), so tp divides the dense parameters but not the experts.
"""

from partrain.models.arith import (
    count_params,
    count_params_per_rank,
    expert_params,
    ffn_dim,
    head_dim,
    mlp_params,
    moe_block_count,
    vocab_matrices,
)
from partrain.plan.hardware import Hardware
from partrain.plan.links import group_bandwidth, ring
from partrain.plan.priced import DEEPSPEED_S_PER_PARAM, Implementation, Layout, Stage

MODULES_PER_BLOCK = 9  # q, k, v, o, w1, w2, w3 and the two norms
HOST_ADAM_PARAMS_PER_S = 1.5e9  # DeepSpeedCPUAdam over one GPU's host cores (H100 node, measured)
PCIE_BYTES_PER_S = 25e9  # one way, per GPU (PCIe gen4 x16 in practice; gen5 cards reach more)


def block_params(model_cfg, active: bool = False) -> tuple[float, float, float]:
    """Parameters of a block, by part: (what every block has beside its MLP: attention and
    norms; a dense MLP; a MoE MLP, its router, shared experts and routed experts, all of them or
    the `active` ones a token uses)."""
    n, n_moe = model_cfg.n_layers, moe_block_count(model_cfg)
    dense_mlp = 3 * model_cfg.dim * ffn_dim(model_cfg)
    moe_mlp = mlp_params(model_cfg, model_cfg.moe.first_dense, active=active) if n_moe else 0
    blocks = (count_params(model_cfg, active=active)
              - vocab_matrices(model_cfg) * model_cfg.vocab_size * model_cfg.dim - model_cfg.dim)
    return (blocks - (n - n_moe) * dense_mlp - n_moe * moe_mlp) / n, dense_mlp, moe_mlp


def rank_params(model_cfg, L: Layout, stage: Stage) -> tuple[float, float]:
    """A rank's parameters on `stage`: (those reduced over dp x cp, the routed experts reduced
    over edp x cp). tp splits all but the norm gains and a MoE's MLP; ep splits routed experts."""
    common, dense_mlp, _ = block_params(model_cfg)
    # the two norm gains and the q/k norm gains: replicated over tp
    norms = 2 * model_cfg.dim + (2 * head_dim(model_cfg) if getattr(model_cfg, "qk_norm", False)
                                 else 0)
    moe_mlp = mlp_params(model_cfg, model_cfg.moe.first_dense, ep=L.ep) if stage.moe_blocks else 0
    ends = count_params_per_rank(model_cfg, L.tp, blocks=0, first=stage.first, last=stage.last)
    held = (ends + stage.blocks * ((common - norms) / L.tp + norms)
            + (stage.blocks - stage.moe_blocks) * dense_mlp / L.tp + stage.moe_blocks * moe_mlp)
    experts = (stage.moe_blocks * model_cfg.moe.n_experts // L.ep * expert_params(model_cfg)
               if L.ep > 1 else 0)
    return held - experts, experts


def data_parallel(model_cfg, L: Layout, stage: Stage, m: int, compute_mb: float,
                  hw: Hardware, act_bytes: int, impl: Implementation
                  ) -> tuple[float, float, float, float]:
    """The step's data-parallel part for a rank of `stage`, as much of it as the compute it
    overlaps does not hide: the gradient reduction and the weights' all-gather (ZeRO-1/2),
    ZeRO-3's per-micro-batch gathers and reductions, ZeRO-Offload's host step, and the optimizer
    step on the GPU. Dense parameters over dp x cp, routed experts over edp x cp (ep > 1)."""
    nd = L.dp * L.cp
    dense, experts = rank_params(model_cfg, L, stage)
    params = dense + experts
    ne = nd // L.ep  # the ranks holding the same experts (edp x cp)
    grad_bytes = impl.grad_bytes or (4 if L.zero_stage == 0 else act_bytes)
    bw = group_bandwidth(hw, L.world_size, (nd, L.tp))
    ebw = group_bandwidth(hw, L.world_size, (L.dp // L.ep, L.ep * L.cp * L.tp), (L.cp, L.tp))

    def both(op: str, bytes_per_param: float, dense_n: int = nd, dense_bw: float = bw) -> float:
        return (ring(op, dense * bytes_per_param, dense_n, dense_bw)
                + ring(op, experts * bytes_per_param, ne, ebw))

    overlaps = impl.dp_overlap and (L.pp == 1 or impl.dp_overlap_under_pp)
    backward, forward = 2 / 3 * compute_mb, 1 / 3 * compute_mb
    dp_s, zero3_s, offload_s = 0.0, 0.0, 0.0
    if L.zero_stage == 0:
        # DDP's buckets overlap the dense gradients; partrain all-reduces the expert slices in
        # one flat tensor after the backward (data.py: average_expert_gradients).
        dp_s = (max(ring("all_reduce", dense * grad_bytes, nd, bw)
                    - (backward if overlaps else 0.0), 0.0)
                + ring("all_reduce", experts * grad_bytes, ne, ebw))
    elif L.zero_stage == 1 or L.zero_stage == 2 and L.zero_backend != "fsdp" or L.pp > 1:
        # (FSDP under pp gathers a stage's weights once a step and reduce-scatters once.)
        reduce = both("reduce_scatter", grad_bytes)
        gather = both("all_gather", act_bytes)
        dp_s = (max(reduce - (backward if overlaps else 0.0), 0.0)
                + max(gather - (forward if impl.param_gather_overlap else 0.0), 0.0))
    else:
        # Every micro-batch gathers the weights for its forward and (ZeRO-3) again for its
        # backward, and reduce-scatters its gradients; prefetching hides them behind its compute,
        # all but the first block's gather. FSDP2 at stage 2 is this with one gather: it keeps a
        # block's weights from its forward to its backward.
        gathers = 2 if L.zero_stage == 3 else 1
        # HSDP (never with ep): the shards' group is a replica's dp_shard x cp ranks
        # (consecutive: inside a node when they fit); each reduced shard is then all-reduced
        # across the replicas, whose ranks on a node each drive a NIC.
        shard = nd // L.dp_replicate
        sbw = group_bandwidth(hw, L.world_size, (shard, L.tp)) if L.dp_replicate > 1 else bw
        comm = (gathers * both("all_gather", act_bytes, shard, sbw)
                + both("reduce_scatter", grad_bytes, shard, sbw)
                + ring("all_reduce", dense / shard * grad_bytes, L.dp_replicate,
                       group_bandwidth(hw, L.world_size, (L.dp_replicate, shard * L.tp))))
        exposed = (max(comm - compute_mb, comm / (3 * stage.blocks)) if impl.zero3_prefetch
                   else comm)
        hooks = impl.zero3_hook_s_per_module * (MODULES_PER_BLOCK * stage.blocks + 3)
        # Copy-in and copy-out of each gather (the rank's shard in, the whole weights out) and
        # of each reduce-scatter (the whole gradients in, the shard out), read and written.
        copies = ((dense * (1 + 1 / shard) + experts * (1 + 1 / ne))
                  * (gathers * act_bytes + grad_bytes) * 2 / hw.hbm_bandwidth
                  if impl.fsdp_copies else 0.0)
        zero3_s = m * (exposed + hooks + copies)
    if L.zero_stage and impl.deepspeed:
        dp_s += params * DEEPSPEED_S_PER_PARAM[L.zero_stage]
    # The rank's share of the optimizer's state: all of it without ZeRO, else its shard of each.
    owned = dense / (nd // L.dp_replicate) + experts / ne if L.zero_stage else params
    if L.zero_stage and L.offload_optimizer != "none":
        offload_s = owned / HOST_ADAM_PARAMS_PER_S + owned * 2 * act_bytes / PCIE_BYTES_PER_S
    # AdamW on the GPU: weights, gradients and two moments read and written (16 bytes each way
    # per parameter of the rank's shard), at the memory's bandwidth.
    optimizer_s = 0.0 if offload_s else owned * 16 * 2 / hw.hbm_bandwidth
    return dp_s, zero3_s, offload_s, optimizer_s

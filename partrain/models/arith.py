"""The arithmetic of a model config, with no torch: hidden sizes, parameter counts (whole, per
rank, active per token), training FLOPs per token, which blocks are mixtures of experts, and the
values model and activation-checkpointing keys take. Used by validation and the planner before any
process starts, and by the models themselves."""

import math


def head_dim(cfg) -> int:
    """Elements per attention head: model.head_dim, or dim / n_heads when null (or absent, as in
    a config written before the key)."""
    return getattr(cfg, "head_dim", None) or cfg.dim // cfg.n_heads


def ffn_dim(cfg) -> int:
    """SwiGLU inner size: given, or 8/3 * dim rounded up to a multiple of `multiple_of`."""
    if cfg.ffn_dim:
        return cfg.ffn_dim
    hidden = int(8 * cfg.dim / 3)
    return cfg.multiple_of * math.ceil(hidden / cfg.multiple_of)


def expert_params(cfg) -> int:
    """Parameters of one routed (or shared) expert: a SwiGLU of the expert's hidden size."""
    return 3 * cfg.dim * expert_ffn_dim(cfg, ffn_dim(cfg))


def mlp_params(cfg, layer: int, ep: int = 1, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP: the dense SwiGLU, or a MoE's router, shared experts and
    routed experts (all of them, 1/ep of them under expert parallelism, or only the top_k a
    token uses when `active`)."""
    return _mlp_params(cfg, is_moe_block(cfg, layer), ep, active)


def _mlp_params(cfg, moe_block: bool, ep: int = 1, active: bool = False) -> int:
    """mlp_params by the kind of block: every dense MLP is the same size, as is every MoE."""
    if not moe_block:
        return 3 * cfg.dim * ffn_dim(cfg)
    moe = cfg.moe
    routed = moe.top_k if active else moe.n_experts // ep
    return (routed + moe.n_shared_experts) * expert_params(cfg) + cfg.dim * moe.n_experts


def _attention_params(cfg) -> int:
    """q/k/v/o matrices and the q/k/v biases (model.qkv_bias): split by tp."""
    width = head_dim(cfg)
    bias = width * (cfg.n_heads + 2 * cfg.n_kv_heads) if getattr(cfg, "qkv_bias", False) else 0
    return cfg.dim * width * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + bias


def _head_norm_params(cfg) -> int:
    """The per-head q and k norm gains (model.qk_norm): replicated over tp."""
    return 2 * head_dim(cfg) if getattr(cfg, "qk_norm", False) else 0


def count_params(cfg, active: bool = False) -> int:
    """Parameters of the full model from its shape alone (used by `plan` for models never built);
    `active`: those one token uses (a MoE's top_k experts, not all of them). Blocks come in two
    kinds, dense and MoE, each the same size: the layout search asks this for every layout."""
    moe = moe_block_count(cfg)
    blocks = (cfg.n_layers * (_attention_params(cfg) + _head_norm_params(cfg) + 2 * cfg.dim)
              + (cfg.n_layers - moe) * _mlp_params(cfg, False)
              + (moe * _mlp_params(cfg, True, active=active) if moe else 0))
    return blocks + vocab_matrices(cfg) * cfg.vocab_size * cfg.dim + cfg.dim


def tied(cfg) -> bool:
    """Whether the head's weight is the embedding's (model.tie_embeddings; absent = untied)."""
    return bool(getattr(cfg, "tie_embeddings", False))


def vocab_matrices(cfg) -> int:
    """(vocab_size, dim) matrices of the full model: embedding and head, or one when tied."""
    return 1 if tied(cfg) else 2


def count_params_per_rank(cfg, tp: int = 1, blocks=None, first: bool = True,
                          last: bool = True, ep: int = 1) -> int:
    """Parameters held by one rank: `blocks` (the block ids, or a count of blocks from 0; all by
    default), the embedding if first, final norm and head if last; tensor parallelism splits
    everything but the norm gains and the MoE MLPs (replicated within tp, split over ep). A tied
    head on the embedding's rank is the same matrix; on another pipeline stage it is a copy."""
    ids = range(cfg.n_layers if blocks is None else blocks) if not isinstance(blocks, (list, range)) \
        else blocks
    vocab = (first or last) if tied(cfg) else first + last
    n = len(ids)
    moe = moe_blocks_among(cfg, ids)
    split = (n * _attention_params(cfg) + (n - moe) * _mlp_params(cfg, False)
             + vocab * cfg.vocab_size * cfg.dim)
    replicated = (n * (2 * cfg.dim + _head_norm_params(cfg))
                  + (moe * _mlp_params(cfg, True, ep) if moe else 0))
    return split // tp + replicated + (cfg.dim if last else 0)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (active params less the embedding lookup) + causal attention.
    A tied head still multiplies: its matrix counts (once) even though the lookup does not. A MoE
    counts the experts a token uses (top_k and the shared ones) and the router.

    Attention scores and the weighted sum cost 2 * 2 * seq * n_heads * head_dim multiply-adds per
    layer and token forward (dim, unless model.head_dim sets its own); with backward (x3) and the
    causal half that is 6 * L * seq * n_heads * head_dim.
    """
    dense = count_params(cfg, active=True) - (vocab_matrices(cfg) - 1) * cfg.vocab_size * cfg.dim
    return 6 * dense + 6 * cfg.n_layers * seq_len * cfg.n_heads * head_dim(cfg)


BALANCE = ("aux_loss", "bias", "none")


def moe_enabled(model_cfg) -> bool:
    moe = getattr(model_cfg, "moe", None)
    return moe is not None and moe.n_experts > 0


def is_moe_block(model_cfg, layer: int) -> bool:
    """Whether block `layer` has a MoE in place of the dense MLP: after the first `first_dense`
    blocks, every `every`-th one."""
    if not moe_enabled(model_cfg):
        return False
    moe = model_cfg.moe
    return layer >= moe.first_dense and (layer - moe.first_dense) % moe.every == 0


def moe_block_count(model_cfg) -> int:
    """How many blocks are MoE blocks (is_moe_block), counted without a loop over the layers."""
    if not moe_enabled(model_cfg):
        return 0
    moe = model_cfg.moe
    return max(0, -(-(model_cfg.n_layers - moe.first_dense) // moe.every))


def moe_blocks_among(model_cfg, blocks) -> int:
    """How many of `blocks` (block ids) are MoE blocks."""
    return sum(is_moe_block(model_cfg, i) for i in blocks) if moe_enabled(model_cfg) else 0


def moe_blocks(model_cfg) -> list[int]:
    return [i for i in range(model_cfg.n_layers) if is_moe_block(model_cfg, i)]


def expert_ffn_dim(model_cfg, dense_ffn: int) -> int:
    return model_cfg.moe.expert_ffn_dim or dense_ffn


def capacity(moe_cfg, seq_len: int) -> int | None:
    """Tokens one expert takes from one sequence, or None (dropless)."""
    if not moe_cfg.capacity_factor:
        return None
    return math.ceil(moe_cfg.capacity_factor * seq_len * moe_cfg.top_k / moe_cfg.n_experts)


RECOMPUTE_MODES = ("none", "selective", "full")  # train.activation_checkpointing


# The chunked cross-entropy's chunk (models/loss.py), in fp32 elements of its softmax: 64 Mi,
# 256 MiB; a chunk is at least one token. Here for the planner's memory model, torch-free.
CHUNK_ELEMENTS = 1 << 26


def stage_layers(n_layers: int, pp: int, v: int = 1, pp_layers=None) -> list[range]:
    """Block ids of every stage s = 0..pp*v-1, consecutive; pp_layers gives the counts. Ranges,
    so that `plan` costs the same for any model.n_layers."""
    stages = pp * v
    counts = list(pp_layers) if pp_layers else [n_layers // stages] * stages
    if len(counts) != stages or sum(counts) != n_layers:
        raise ValueError(f"stage sizes {counts} must be {stages} numbers summing to {n_layers}")
    ids, start = [], 0
    for count in counts:
        ids.append(range(start, start + count))
        start += count
    return ids

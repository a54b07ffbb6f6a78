"""The memory model `partrain plan` prints: bytes per rank of one training step at its peak, by
part. Pure arithmetic (no torch), so it answers for any model and world size in microseconds.

Counted as partrain's code really holds them (checked against tensor accounting of real runs by
`scripts/bench_memory.py`):

- model state: weights, gradients and AdamW's state at the ZeRO stage (`zero_memory`); under
  expert parallelism the expert slices are sharded over their own dp/ep x cp ranks.
- activations: what autograd keeps per token of a block for its backward (`block_elements`),
  times this rank's tokens per micro-batch (micro_batch x seq_len / cp), its blocks, and the
  micro-batches in flight on its pipeline stage at once (the schedule's simulated peak: GPipe all
  of them, 1F1B at most pp - stage, interleaved by its own rule; one without pp).
- the loss: log-probabilities and two gradients of a micro-batch (vocabulary / tp per token).
- pipeline sends: buffers the executor holds until the end of the step.
- transients, one at a time: the loss's at the start of the backward, or a block's backward:
  the gradients of its MLP's hidden layer and of its output, and under checkpointing the part
  of the block it recomputed; the peak takes the larger.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes of one block's tensors, per token."""
    dim: int
    q: int  # query width on this tp rank (heads / tp x head_dim)
    kv: int  # key (or value) width on this tp rank
    heads: int  # query heads on this tp rank
    ffn: int  # dense MLP width on this tp rank
    norm_split: int  # ranks a norm's tokens are split over: tp under sequence parallelism, else 1
    ring: bool = False  # attention through the cp ring


def shape(model_cfg, tp: int, sequence_parallel: bool, ring: bool = False) -> Shape:
    from partrain.models.llama import ffn_dim

    head_dim = model_cfg.dim // model_cfg.n_heads
    return Shape(model_cfg.dim, model_cfg.n_heads // tp * head_dim,
                 model_cfg.n_kv_heads // tp * head_dim, model_cfg.n_heads // tp,
                 ffn_dim(model_cfg) // tp, tp if sequence_parallel else 1, ring)


def _attention_elements(s: Shape) -> float:
    """Norm (input, input x rsqrt, rsqrt: split under sequence parallelism), its output as the
    q/k/v projections' input (the whole sequence: gathered under sequence parallelism), rotated q
    and k, v, the attention's log-sum-exp and output (the output projection's input); the cp
    ring keeps its fp32 output besides the projection's input."""
    return ((2 * s.dim + 1) / s.norm_split + s.dim + 2 * s.q + 2 * s.kv + s.heads
            + (s.q if s.ring else 0))


def _mlp_elements(s: Shape) -> float:
    """Norm as above, its output as w1/w3's input, w1 and w3 outputs, SiLU, their product."""
    return (2 * s.dim + 1) / s.norm_split + s.dim + 4 * s.ffn


def _moe_elements(model_cfg, s: Shape) -> float:
    """A MoE MLP per routed token of this rank (its own tokens; under ep the rows it receives
    equal those it sends, with uniform routing): the norm as above, router scores (fp32),
    top_k gathered rows and expert outputs, each expert's w1, w3, SiLU and product, the shared
    experts' MLP, and the int64 indices (2 elements each) of the dispatch."""
    from partrain.models.llama import ffn_dim
    from partrain.models.moe import expert_ffn_dim

    moe = model_cfg.moe
    hidden = expert_ffn_dim(model_cfg, ffn_dim(model_cfg))
    k, d = moe.top_k, model_cfg.dim
    return ((2 * d + 1) / s.norm_split + d + moe.n_experts + 2 * k * d + 4 * k * hidden
            + 4 * hidden * moe.n_shared_experts + 3 * 2 * k + 2 * k)


def _kept_elements(model_cfg, s: Shape, moe_block: bool) -> float:
    """Selective checkpointing keeps the outputs of matrix products and of attention: q, k, v, the
    attention output and log-sum-exp, the output projection's; w1, w3, w2's (a MoE: the router
    logits and the experts' products), and the block's input."""
    from partrain.models.llama import ffn_dim
    from partrain.models.moe import expert_ffn_dim

    attention = s.dim / s.norm_split + 2 * s.q + 2 * s.kv + s.heads + s.dim
    if not moe_block:
        return attention + 2 * s.ffn + s.dim
    moe = model_cfg.moe
    hidden = expert_ffn_dim(model_cfg, ffn_dim(model_cfg))
    return (attention + moe.n_experts + moe.top_k * (2 * hidden + model_cfg.dim)
            + (2 * hidden * moe.n_shared_experts + model_cfg.dim if moe.n_shared_experts else 0))


def block_elements(model_cfg, layer: int, s: Shape, mode: str = "none") -> float:
    """fp32-sized elements one block keeps per token of this rank for its backward."""
    from partrain.models.moe import is_moe_block

    moe_block = is_moe_block(model_cfg, layer)
    if mode == "full":
        return s.dim / s.norm_split
    if mode == "selective":
        return _kept_elements(model_cfg, s, moe_block)
    mlp = _moe_elements(model_cfg, s) if moe_block else _mlp_elements(s)
    return _attention_elements(s) + mlp


def activations(model_cfg, blocks, s: Shape, tokens: int, in_flight: list[int],
                mode: str, act_bytes: int = 4) -> dict:
    """Bytes of a stage's activations: `blocks` per chunk (a list of block-id lists, one per local
    chunk), `in_flight` its chunks' micro-batches alive at the peak (the same for each chunk when
    one number is given), `tokens` per micro-batch on this rank."""
    per_chunk = [sum(block_elements(model_cfg, i, s, mode) for i in ids) for ids in blocks]
    kept = sum(e * n for e, n in zip(per_chunk, in_flight)) * tokens * act_bytes
    # Checkpointing: the block whose backward runs holds what it recomputed meanwhile.
    recompute = 0
    if mode != "none" and any(blocks):
        recompute = max(block_elements(model_cfg, i, s) - block_elements(model_cfg, i, s, mode)
                        for ids in blocks for i in ids)
    # A block's backward works on the gradient of its MLP's hidden layer and of its output.
    from partrain.models.llama import ffn_dim
    from partrain.models.moe import expert_ffn_dim, is_moe_block

    moe = model_cfg.moe
    hidden = max([s.ffn] + [moe.top_k * expert_ffn_dim(model_cfg, ffn_dim(model_cfg))
                            for ids in blocks for i in ids if is_moe_block(model_cfg, i)])
    working = (hidden + s.dim) if any(blocks) else 0
    return {"kept_bytes": kept, "backward_bytes": (recompute + working) * tokens * act_bytes,
            "per_token_per_block": [e / max(1, len(ids)) for e, ids in zip(per_chunk, blocks)]}


def loss_bytes(model_cfg, tp: int, tokens: int, act_bytes: int = 4) -> int:
    """The loss at the start of the backward of a micro-batch: the log-probabilities (or,
    vocabulary-parallel, the softmax) kept by the forward, their gradient and the logits'
    gradient: three vocabulary / tp rows per token."""
    return 3 * model_cfg.vocab_size // tp * tokens * act_bytes


def pipeline_send_bytes(dim: int, tokens: int, micro_batches: int, first: bool, last: bool) -> int:
    """The pipeline executor holds every send's buffer until the end of the step (it never
    waits on a send mid-schedule): each micro-batch's output sent forward (all stages but the
    last) and its input's gradient sent back (all but the first), fp32."""
    sends = (not last) + (not first)
    return sends * micro_batches * tokens * dim * 4

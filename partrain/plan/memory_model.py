"""The memory model `partrain plan` prints: bytes per rank of one training step at its peak, by
part. Pure arithmetic (no torch), so it answers for any model and world size in microseconds.

Counted as partrain's code really holds them (checked against tensor accounting of real runs by
`scripts/bench_memory.py`):

- model state: weights, gradients and the optimizer's state (optim.name's) at the ZeRO stage
  (`zero_memory`); under expert parallelism ZeRO shards the expert slices over their own
  dp/ep x cp ranks (`model_state`).
- activations: what autograd keeps per token of a block for its backward (`block_elements`),
  times this rank's tokens per micro-batch (micro_batch x seq_len / cp), its blocks, and the
  micro-batches in flight on its pipeline stage at once (the schedule's simulated peak: GPipe all
  of them, 1F1B at most pp - stage, interleaved by its own rule; one without pp).
- ZeRO-3's gathered blocks: the weights of the block computing and of the one prefetched, whole
  (w bytes each), and one block's whole gradients before their reduce-scatter (fp32 under FSDP2,
  which reduces in fp32; w under DeepSpeed) (`gathered_bytes`). Parameter offload
  (parallel.offload_params) keeps the weights' shards in host memory.
- the loss: log-probabilities and two gradients of a micro-batch (vocabulary / tp per token).
- pipeline sends and receives: the p2p buffers the executor's program holds at most at once
  (a send until the peer has posted its receive, a receive from its early post to its wait).
- transients, one at a time: the loss's at the start of the backward, or a block's backward:
  the gradients of its MLP's hidden layer and of its output, and under checkpointing the part
  of the block it recomputed; the peak takes the larger.
"""

from dataclasses import dataclass

# The share of a GPU's memory a training step may plan to use: the rest goes to the CUDA context,
# the libraries' workspaces and the caching allocator's fragmentation. `plan` warns above it and
# `plan --search` keeps only layouts below it.
USABLE_FRACTION = 0.9
# How far a measured peak has been from this model's prediction (docs/performance.md, "Memory:
# plan against measured"): scripts/bench_memory.py holds every rank of its 17 layouts to 10% on
# CPU (all came within 9.0%), and on one H100 plan / measured ran from 0.907 (bf16 without
# checkpointing, about 8% unexplained) to 1.043. `partrain launch` refuses a layout only when
# the prediction exceeds the device's memory by more than this: then even the model's error
# cannot make it fit.
MODEL_ERROR = 0.10

from partrain.models.arith import (
    CHUNK_ELEMENTS,
    count_params_per_rank,
    expert_ffn_dim,
    expert_params,
    ffn_dim,
    head_dim,
    is_moe_block,
    moe_blocks_among,
)
from partrain.plan.costs import optimizer_state_bytes, zero_memory


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
    width = head_dim(model_cfg)
    return Shape(model_cfg.dim, model_cfg.n_heads // tp * width,
                 model_cfg.n_kv_heads // tp * width, model_cfg.n_heads // tp,
                 ffn_dim(model_cfg) // tp, tp if sequence_parallel else 1, ring)


# Each part is (fp32 elements, activation-dtype elements) per token: norms work in fp32 on the
# fp32 residual stream and the router and attention's log-sum-exp are fp32; the matrix products
# and what they read are in the compute dtype (bf16 under autocast). int64 indices count as two
# fp32 elements.

def _attention_elements(s: Shape) -> tuple[float, float]:
    """Norm (input, input x rsqrt, rsqrt: split under sequence parallelism) and log-sum-exp, the
    cp ring's fp32 output; the norm's output as the q/k/v projections' input (the whole
    sequence: gathered under sequence parallelism), rotated q and k, v, the attention output
    (the output projection's input)."""
    return ((2 * s.dim + 1) / s.norm_split + s.heads + (s.q if s.ring else 0),
            s.dim + 2 * s.q + 2 * s.kv)


def _mlp_elements(s: Shape) -> tuple[float, float]:
    """Norm as above; its output as w1/w3's input, w1 and w3 outputs, SiLU, their product."""
    return (2 * s.dim + 1) / s.norm_split, s.dim + 4 * s.ffn


def _moe_hidden(model_cfg) -> int:
    return expert_ffn_dim(model_cfg, ffn_dim(model_cfg))


def _moe_elements(model_cfg, s: Shape) -> tuple[float, float]:
    """A MoE MLP per routed token of this rank (its own tokens; under ep the rows it receives
    equal those it sends, with uniform routing): the norm as above, router scores and the
    dispatch's indices; top_k gathered rows and expert outputs, each expert's w1, w3, SiLU and
    product, the shared experts' MLP."""
    moe, hidden = model_cfg.moe, _moe_hidden(model_cfg)
    k, d = moe.top_k, model_cfg.dim
    return ((2 * d + 1) / s.norm_split + moe.n_experts + 8 * k,
            d + 2 * k * d + 4 * k * hidden + 4 * hidden * moe.n_shared_experts)


def _kept_elements(model_cfg, s: Shape, moe_block: bool) -> tuple[float, float]:
    """Selective checkpointing keeps the outputs of matrix products and of attention: q, k, v, the
    attention output and log-sum-exp, the output projection's; w1, w3, w2's (a MoE: the router
    logits and the experts' products), and the block's input."""
    fp32 = s.dim / s.norm_split + s.heads
    act = 2 * s.q + 2 * s.kv + s.dim
    if not moe_block:
        return fp32, act + 2 * s.ffn + s.dim
    moe, hidden = model_cfg.moe, _moe_hidden(model_cfg)
    return (fp32 + moe.n_experts,
            act + moe.top_k * (2 * hidden + model_cfg.dim)
            + (2 * hidden * moe.n_shared_experts + model_cfg.dim if moe.n_shared_experts else 0))


def block_elements(model_cfg, layer: int, s: Shape, mode: str = "none") -> tuple[float, float]:
    """(fp32, compute-dtype) elements one block keeps per token of this rank for its backward."""
    return _kind_elements(model_cfg, is_moe_block(model_cfg, layer), s, mode)


def _kind_elements(model_cfg, moe_block: bool, s: Shape, mode: str) -> tuple[float, float]:
    if mode == "full":
        return s.dim / s.norm_split, 0.0
    if mode == "selective":
        return _kept_elements(model_cfg, s, moe_block)
    a32, a = _attention_elements(s)
    m32, m = _moe_elements(model_cfg, s) if moe_block else _mlp_elements(s)
    return a32 + m32, a + m


def block_bytes(model_cfg, layer: int, s: Shape, mode: str = "none", act_bytes: int = 4) -> float:
    fp32, act = block_elements(model_cfg, layer, s, mode)
    return 4 * fp32 + act_bytes * act


def activations(model_cfg, blocks: list[int], s: Shape, tokens: int, in_flight: float,
                mode: str, act_bytes: int = 4) -> dict:
    """Bytes of a pipeline rank's activations: its `blocks`, `in_flight` micro-batches alive per
    block at the peak (with several chunks per rank, the schedule's chunk-micro-batches in flight
    spread over the chunks), `tokens` per micro-batch on this rank. Also the working set of the
    backward of one block (`backward_bytes`)."""
    if not blocks:
        return {"kept_bytes": 0, "backward_bytes": 0}
    # Blocks come in two kinds (dense, MoE), each kind the same size: count each once.
    moe_count = moe_blocks_among(model_cfg, blocks)
    counts = {kind: n for kind, n in ((False, len(blocks) - moe_count), (True, moe_count)) if n}

    def nbytes(kind, m):
        fp32, act = _kind_elements(model_cfg, kind, s, m)
        return 4 * fp32 + act_bytes * act

    kept = sum(n * nbytes(kind, mode) for kind, n in counts.items()) * in_flight
    # Checkpointing: the block whose backward runs holds what it recomputed meanwhile, and any
    # block's backward the gradients of its MLP's hidden layer and of its output.
    recompute = max(nbytes(kind, "none") - nbytes(kind, mode) for kind in counts)
    hidden = max([s.ffn] + ([model_cfg.moe.top_k * _moe_hidden(model_cfg)] if moe_count else []))
    return {"kept_bytes": kept * tokens,
            "backward_bytes": (recompute + (hidden + s.dim) * act_bytes) * tokens}


def loss_bytes(model_cfg, tp: int, tokens: int, act_bytes: int, compiled: bool = False) -> int:
    """The loss at its peak, in the backward of a micro-batch. Vocabulary-parallel (tp > 1), per
    vocabulary / tp entry of a token: the fp32 softmax kept by the forward, its gradient and the
    fp32 logits' gradient, 12 bytes. Otherwise models/loss.py's chunked cross-entropy: the logits
    it keeps and their gradient, in the compute dtype, and one chunk's fp32 softmax (4 bytes an
    entry of the chunk; 8 while a compute-dtype chunk's fp32 copy is made); compiled
    (train.compile), the logits and their gradient alone."""
    vocab = model_cfg.vocab_size // tp
    if tp > 1:
        return 12 * vocab * tokens
    if compiled:
        return 2 * act_bytes * vocab * tokens
    chunk = min(tokens, max(1, CHUNK_ELEMENTS // vocab))
    return 2 * act_bytes * vocab * tokens + (4 if act_bytes == 4 else 8) * vocab * chunk


def pipeline_buffer_bytes(dim: int, tokens: int, buffers: int) -> int:
    """The pipeline executor's p2p buffers at their peak (`schedules.peak_buffers`: sends not
    yet released, receives posted early and not yet waited for), each one micro-batch's
    activation between stages in fp32."""
    return buffers * tokens * dim * 4


def expert_slice_params(model_cfg, blocks, ep: int) -> int:
    """Parameters of the routed experts' slices a rank holds among `blocks` under ep > 1 (its
    1/ep of each MoE block's experts), which ZeRO shards over their own dp / ep x cp ranks; 0
    without ep."""
    if ep <= 1 or not getattr(model_cfg, "moe", None):
        return 0
    return moe_blocks_among(model_cfg, blocks) * (model_cfg.moe.n_experts // ep) \
        * expert_params(model_cfg)


def model_state(cfg, dims, params: int, blocks: list[int], dtype: str) -> dict:
    """Weights, gradients and optimizer state of a rank's `params` at the ZeRO stage. ZeRO
    shards over dp x cp; under ep > 1 the routed experts' slices (blocks' MoE layers, 1/ep of
    the experts each) are DeepSpeed's expert parameters, sharded over their own dp/ep x cp ranks."""
    p, m = cfg.parallel, cfg.model
    experts = expert_slice_params(m, blocks, dims.ep)
    engine = getattr(p, "zero_backend", "deepspeed")
    moments = optimizer_state_bytes(getattr(cfg, "optim", None))
    # HSDP: a replica's dp / dp_replicate ranks (and their cp ranks) share the shards.
    replicate = getattr(p, "dp_replicate", 1) or 1
    dense = zero_memory(p.zero_stage, params - experts, dims.dp * dims.cp // replicate, dtype,
                        engine, dims.pp > 1, moments)
    if not experts:
        return {**dense, "dense_grad_bytes": dense["grad_bytes"]}
    sliced = zero_memory(p.zero_stage, experts, dims.dp // dims.ep * dims.cp, dtype, engine,
                         dims.pp > 1, moments)
    return {**{k: dense[k] + sliced[k]
               for k in ("param_bytes", "grad_bytes", "optim_bytes", "total")},
            "dense_grad_bytes": dense["grad_bytes"]}


def memory_per_stage(cfg, dims, stages: list[dict], dtype: str, simulate: bool = True) -> list[dict]:
    """Peak bytes of a rank of each pipeline stage (plan's `stages`: blocks, parameters per
    rank, embedding and head): model state at the ZeRO stage, the activations its schedule keeps
    in flight, pipeline sends, and the larger transient (the loss's on the last stage, or a
    block's backward)."""
    p, t = cfg.parallel, cfg.train
    act_bytes = 4 if dtype == "fp32" else 2
    s = shape(cfg.model, dims.tp, dims.tp > 1 and p.sequence_parallel,
              dims.cp > 1 and p.cp_method == "ring")
    tokens = t.micro_batch_size * t.seq_len // dims.cp
    v = p.pp_virtual_stages if dims.pp > 1 else 1
    in_flight, buffers = _schedule_peaks(cfg, dims, v, simulate)
    # ZeRO-Offload keeps the optimizer's state (and its fp32 master weights) in host memory: off
    # the GPU's count. On a CPU run the host is the device, so it stays.
    on_host = (p.zero_stage >= 1 and p.offload_optimizer != "none"
               and cfg.launcher.device != "cpu")
    # ZeRO-Infinity's parameter offload (ZeRO-3) keeps the weights' shards there too.
    params_on_host = (p.zero_stage == 3 and getattr(p, "offload_params", "none") != "none"
                      and cfg.launcher.device != "cpu")
    out = []
    for rank in range(dims.pp):
        own = [st for st in stages if st["pp_rank"] == rank]
        blocks = [i for st in own if st["blocks"]
                  for i in range(st["blocks"][0], st["blocks"][1] + 1)]
        state = model_state(cfg, dims, sum(st["params_per_rank"] for st in own), blocks, dtype)
        # in_flight counts chunk-micro-batches: per block, spread over the rank's v chunks.
        acts = activations(cfg.model, blocks, s, tokens, in_flight[rank] / v,
                           t.activation_checkpointing, act_bytes)
        last = any(st["head"] for st in own)
        # (the layout search prices bare layouts: no train.compile there)
        loss = (loss_bytes(cfg.model, dims.tp, tokens, act_bytes,
                           getattr(t, "compile", False)) if last else 0)
        seq_split = dims.tp if s.norm_split > 1 else 1
        sends = pipeline_buffer_bytes(cfg.model.dim, tokens // seq_split,
                                      buffers[rank]) if dims.pp > 1 else 0
        # DDP (no ZeRO, no pp, dp x cp > 1) with several micro-batches: under no_sync they
        # accumulate into fresh .grad tensors beside DDP's buckets, which become the gradients
        # (bucket views) only at the last micro-batch's reduction: a second copy of the
        # gradients DDP reduces (not the expert slices it ignores) until then. Measured: dp2,
        # 2 micro-batches, 10-13% above the plan without it.
        ddp_copy = (p.zero_stage == 0 and dims.pp == 1 and dims.dp * dims.cp > 1
                    and t.micro_batches > 1)
        parts = {"param_bytes": 0 if params_on_host else state["param_bytes"],
                 "grad_bytes": state["grad_bytes"],
                 "gathered_bytes": gathered_bytes(cfg, dims, blocks, dtype),
                 "accumulation_bytes": state["dense_grad_bytes"] if ddp_copy else 0,
                 "optim_bytes": 0 if on_host else state["optim_bytes"],
                 "activation_bytes": acts["kept_bytes"],
                 "pipeline_buffer_bytes": sends, "loss_bytes": loss,
                 "backward_bytes": acts["backward_bytes"]}
        # The loss's buffers are gone by the time a block's backward runs. Gradients exist at
        # the peak if an earlier micro-batch made them, or DDP's buckets or DeepSpeed hold them;
        # one micro-batch alone makes them as its backward frees the activations.
        grads_live = t.micro_batches > 1 or dims.dp * dims.cp > 1 or p.zero_stage > 0
        total = (sum(parts.values()) - loss - acts["backward_bytes"]
                 + max(loss, acts["backward_bytes"])
                 - (0 if grads_live else state["grad_bytes"]))
        out.append({"pp_rank": rank, "in_flight": in_flight[rank], **parts, "total": total,
                    "largest": max(parts, key=parts.get), "optim_on_host": on_host,
                    "params_on_host": params_on_host,
                    "grads_at_peak": grads_live})
    return out


def gathered_bytes(cfg, dims, blocks: list[int], dtype: str) -> float:
    """ZeRO-3's working set beside its shards on a rank holding `blocks`: the largest block's
    weights gathered whole twice (the block computing and the next one, prefetched: FSDP2's
    default, DeepSpeed's prefetch bucket) in the compute dtype, and its gradients whole once in
    the backward until they are reduce-scattered (FSDP2 reduces in fp32; DeepSpeed in the compute
    dtype). 0 below stage 3, and under FSDP2 with pp, whose stage keeps its blocks whole
    through the step (counted in its weights)."""
    p = cfg.parallel
    fsdp = getattr(p, "zero_backend", "deepspeed") == "fsdp"
    if p.zero_stage != 3 or not blocks or fsdp and dims.pp > 1:
        return 0
    w = 4 if dtype == "fp32" else 2
    # Dense blocks are all one size, as are MoE blocks (arith): the larger of the two kinds.
    kinds = {is_moe_block(cfg.model, i): i for i in blocks}
    block = max(count_params_per_rank(cfg.model, dims.tp, [i], first=False, last=False,
                                      ep=dims.ep) for i in kinds.values())
    return block * (2 * w + (4 if fsdp else w))


def _schedule_peaks(cfg, dims, v: int, simulate: bool) -> tuple[list[int], tuple[int, ...]]:
    """Per pp rank, the chunk-micro-batches in flight at the schedule's peak and the p2p buffers
    its executor holds at once (none without pp)."""
    from partrain.parallel.schedules import (
        SIMULATED_MAX_ACTIONS,
        build_schedule,
        in_flight_rule,
        peak_buffers,
    )
    from partrain.parallel.schedules import simulate as run_schedule

    p, t = cfg.parallel, cfg.train
    if dims.pp <= 1:
        return [1] * dims.pp, (0,) * dims.pp  # each micro-batch's backward follows its forward
    # gloo (CPU runs) posts receives a compute early; NCCL posts them in place.
    buffers = peak_buffers(p.pp_schedule, dims.pp, t.micro_batches, v,
                           early=cfg.launcher.device == "cpu")
    # The schedule's simulation where it is small enough (and asked for), else its rule.
    small = simulate and 2 * t.micro_batches * v * dims.pp <= SIMULATED_MAX_ACTIONS
    in_flight = (run_schedule(build_schedule(p.pp_schedule, dims.pp, t.micro_batches, v))
                 .peak_in_flight if small
                 else in_flight_rule(p.pp_schedule, dims.pp, t.micro_batches, v))
    return in_flight, buffers

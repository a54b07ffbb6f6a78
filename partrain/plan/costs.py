"""The planner's cost formulas, by the arithmetic of each parallelism, with no torch: what tp, cp
and ep send per micro-batch, the activations a block keeps, ZeRO's bytes per rank and a
checkpoint's size. The runtime modules in partrain.parallel do what these formulas count; the
scripts in scripts/ measure both and compare."""

from partrain.models.arith import head_dim


def tp_collectives(model_cfg, micro_tokens: int, tp: int, sequence_parallel: bool,
                   low_precision: bool = False) -> list[dict]:
    """Every tp collective of one micro-batch (forward and backward) of the Llama plan above:
    where, op, calls and the full payload per call in elements and bytes. `low_precision`
    (bf16 autocast) makes the row-parallel outputs 2-byte; the residual stream, embedding and
    loss stay fp32."""
    if tp == 1:
        return []
    L, act = model_cfg.n_layers, micro_tokens * model_cfg.dim
    row_bytes = 2 if low_precision else 4
    if sequence_parallel:
        rows = [("embedding output (fwd)", "reduce_scatter", 1, act, 4),
                ("attention/MLP inputs (fwd)", "all_gather", 2 * L, act, 4),
                ("attention/MLP outputs (fwd)", "reduce_scatter", 2 * L, act, row_bytes),
                ("output head input (fwd)", "all_gather", 1, act, 4),
                ("attention/MLP outputs (bwd)", "all_gather", 2 * L, act, row_bytes),
                ("attention/MLP inputs (bwd)", "reduce_scatter", 2 * L, act, 4),
                ("output head input (bwd)", "reduce_scatter", 1, act, 4),
                ("embedding output (bwd)", "all_gather", 1, act, 4)]
    else:
        rows = [("embedding output (fwd)", "all_reduce", 1, act, 4),
                ("attention/MLP outputs (fwd)", "all_reduce", 2 * L, act, row_bytes),
                ("attention/MLP inputs (bwd)", "all_reduce", 2 * L, act, 4),
                ("output head input (bwd)", "all_reduce", 1, act, 4)]
    rows.append(("loss: max, target logit, sum exp (fwd)", "all_reduce", 3, micro_tokens, 4))
    if getattr(model_cfg, "qk_norm", False):  # each rank's part of the shared per-head gains
        rows.append(("q/k norm gains (bwd)", "all_reduce", 2 * L, head_dim(model_cfg), 4))
    return [_row(w, op, n, e, n * e * b, tp) for w, op, n, e, b in rows]


def _row(where: str, op: str, calls: int, elements: int, payload: int, tp: int) -> dict:
    """`bytes` is the full payload; `wire_bytes` what each rank sends with ring algorithms: an
    all-reduce 2(tp-1)/tp of it, an all-gather or reduce-scatter (tp-1)/tp."""
    share = (2 if op == "all_reduce" else 1) * (tp - 1) / tp
    return {"where": where, "op": op, "calls": calls, "elements": elements, "bytes": payload,
            "wire_bytes": round(payload * share)}


def tp_step_collectives(model_cfg, tp: int, sequence_parallel: bool) -> list[dict]:
    """The tp collectives of an optimizer step outside the micro-batches."""
    if tp == 1:
        return []
    rows = [_row("gradient norm", "all_reduce", 1, 1, 4, tp)]
    if sequence_parallel:
        norms = (2 * model_cfg.n_layers + 1) * model_cfg.dim
        rows.append(_row("norm gradients (sequence parallel)", "all_reduce", 1, norms, 4 * norms,
                         tp))
    return rows


# ---- accounting (no process group: `partrain plan` and scripts/bench_cp.py) ------------------
def cp_traffic(model_cfg, micro_batch: int, seq_len: int, cp: int, tp: int, method: str,
               layers: int, act_bytes: int = 4) -> list[dict]:
    """What one rank sends over its cp group for one micro-batch, forward and backward, in the
    attention of `layers` blocks (each rank holds heads/tp of them and seq_len/cp tokens).

    ring: the key/value block (k and v of the rank's tokens) goes around the ring cp-1 times in
    the forward and again in the backward, and the fp32 key/value gradients travel cp times.
    all_to_all: each of q, k, v and the output (and their gradients in the backward) is
    exchanged once, a rank keeping 1/cp of it and sending the rest."""
    if cp == 1:
        return []
    width = head_dim(model_cfg)
    tokens = micro_batch * seq_len // cp
    q = tokens * model_cfg.n_heads // tp * width
    kv = 2 * tokens * model_cfg.n_kv_heads // tp * width
    if method == "ring":
        rows = [("key/value blocks (fwd)", "send/recv", layers * (cp - 1), kv * act_bytes),
                ("key/value blocks (bwd)", "send/recv", layers * (cp - 1), kv * act_bytes),
                ("key/value gradients (bwd)", "send/recv", layers * cp, kv * 4)]
    else:
        moved = (cp - 1) / cp
        per_layer = (2 * q + kv) * act_bytes * moved  # q, k and v in, the output back
        rows = [("q, k, v and output (fwd)", "all_to_all", layers * 4, round(per_layer / 4)),
                ("their gradients (bwd)", "all_to_all", layers * 4, round(per_layer / 4))]
    return [{"where": w, "op": op, "calls": n, "bytes_each": b, "bytes": n * b}
            for w, op, n, b in rows]


def moe_traffic(model_cfg, tokens_per_rank: int, micro_batches: int, ep: int,
                n_moe_blocks: int, bytes_per_element: int = 4) -> dict:
    """What one rank sends to other ranks per step, by the formula: under uniform, dropless
    routing each of its tokens_per_rank * top_k rows goes to another rank with probability
    (ep-1)/ep, out and back, forward and backward (4 exchanges of dim elements), in every MoE
    block; and per micro-batch and block the counts, 8 bytes per expert of other ranks."""
    if ep == 1 or not n_moe_blocks:
        return {"rows_sent": 0, "bytes_sent": 0, "count_bytes": 0}
    moe = model_cfg.moe
    rows = tokens_per_rank * moe.top_k * (ep - 1) / ep * 4 * n_moe_blocks
    counts = 8 * moe.n_experts * (ep - 1) // ep * micro_batches * n_moe_blocks
    return {"rows_sent": round(rows), "bytes_sent": round(rows * model_cfg.dim * bytes_per_element),
            "count_bytes": counts}


def optimizer_state_bytes(optim_cfg) -> int:
    """Bytes per parameter of the optimizer's own fp32 state, beside any master copy: AdamW's and
    Adam's two moments (8), SGD's momentum buffer (4; none at momentum 0). No optim section (the
    layout search's view): AdamW's."""
    if optim_cfg is None or optim_cfg.name != "sgd":
        return 8
    return 4 if optim_cfg.momentum > 0 else 0


def checkpoint_state_bytes(optim_cfg) -> int:
    """Bytes per parameter of the optimizer's state in a checkpoint: AdamW's and Adam's two
    moments (8), SGD's momentum buffer (4, saved as zeros at momentum 0: state.py)."""
    return 4 if optim_cfg is not None and optim_cfg.name == "sgd" else 8


def zero_memory(stage: int, psi: int, nd: int, dtype: str, engine: str = "deepspeed",
                pipeline: bool = False, moments: int = 8) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state for Ψ = `psi` parameters per
    model replica shard, Nd = `nd` dp ranks and compute dtype fp32, bf16 or fp16 (ZeRO paper,
    section 3), with `moments` bytes per parameter of the optimizer's own state
    (`optimizer_state_bytes`: AdamW's and Adam's M = 8, the figures below; SGD's 4 or 0):

    - stage 0 (partrain's DDP): fp32 weights and gradients and the fp32 state: 4+4+M, AdamW's
      16Ψ (autocast computes in bf16 but keeps fp32 weights, so there is no master copy).
    - stages 1-3 (DeepSpeed): w bytes of weights and of gradients per parameter and K = 4 + M
      bytes of optimizer state (fp32 master weights + the state; AdamW's K = 12): with bf16/fp16
      w = 2, the paper's 4Ψ + 12Ψ/Nd, 2Ψ + 14Ψ/Nd, 16Ψ/Nd; in fp32 (CPU) w = 4 and DeepSpeed
      still keeps its own fp32 master copy, so 8Ψ + 12Ψ/Nd, 4Ψ + 16Ψ/Nd, 20Ψ/Nd.
    - FSDP2 (`engine="fsdp"`, stages 2-3): fp32 shards of the weights and of their gradients (it
      reduces in fp32 into the weights' dtype) and the state, (8 + M)Ψ/Nd, AdamW's 16Ψ/Nd, in
      any dtype (the shards are the master weights); stage 2 adds the gathered weights (w bytes
      each), held from a block's forward to its backward: wΨ + 16Ψ/Nd at its peak. Under pp
      (`pipeline`) a stage keeps its gathered weights and its fp32 gradients whole through the
      step (one reduce-scatter a step): (w + 4)Ψ + (4 + M)Ψ/Nd, at either stage.
    """
    if engine == "fsdp" and stage >= 2:
        return _fsdp_memory(stage, psi, nd, dtype, pipeline, moments)
    w, k = (4, moments) if stage == 0 else ((4 if dtype == "fp32" else 2), 4 + moments)
    shard = {"param": stage >= 3, "grad": stage >= 2, "optim": stage >= 1}
    per = {"param": w, "grad": w, "optim": k}
    out = {f"{kind}_bytes": per[kind] * psi / (nd if shard[kind] else 1) for kind in per}
    out["total"] = sum(out.values())
    whole = sum(per[kind] for kind in per if not shard[kind])
    parts = sum(per[kind] for kind in per if shard[kind])
    out["formula"] = " + ".join(x for x in (f"{whole}Ψ" if whole else "",
                                            f"{parts}Ψ/Nd" if parts else "") if x)
    return out


def _fsdp_memory(stage: int, psi: int, nd: int, dtype: str, pipeline: bool, moments: int) -> dict:
    w = 4 if dtype == "fp32" else 2
    gathered = w if stage == 2 or pipeline else 0
    grads_whole = 4 if pipeline else 0
    out = {"param_bytes": (gathered + 4 / nd) * psi,
           "grad_bytes": (grads_whole or 4 / nd) * psi, "optim_bytes": moments * psi / nd}
    out["total"] = sum(out.values())
    whole = gathered + grads_whole
    out["formula"] = (f"{whole}Ψ + " if whole else "") + f"{(4 if pipeline else 8) + moments}Ψ/Nd"
    return out


def true_size(model_cfg, tp: int = 1, optim_cfg=None) -> int:
    """Bytes of the state a checkpoint holds, each tensor once: fp32 weights and the optimizer's
    state (checkpoint_state_bytes: AdamW's two moments, 12 bytes per parameter in all; SGD's
    momentum buffer, 8) and, where it counts steps (Adam, not SGD), one 8-byte step per
    parameter tensor."""
    from partrain.models.arith import count_params, moe_block_count, vocab_matrices

    # embedding and head (one when tied), final norm; 9 per dense block; a MoE block has a
    # router and 3 stacked expert matrices (and 3 shared) for the 3 MLP matrices, and its expert
    # bias (4 bytes per expert, no moments)
    moe = moe_block_count(model_cfg)
    per_moe = 1 + (3 if moe and model_cfg.moe.n_shared_experts else 0)
    tensors = vocab_matrices(model_cfg) + 9 * model_cfg.n_layers + 1 + per_moe * moe
    bias = 4 * model_cfg.moe.n_experts * moe if moe else 0
    counts_steps = optim_cfg is None or optim_cfg.name != "sgd"
    return ((4 + checkpoint_state_bytes(optim_cfg)) * count_params(model_cfg)
            + (8 * tensors if counts_steps else 0) + bias)


def human_bytes(n: float) -> str:
    """A byte count as people read it: 1,536 -> 1.5 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""

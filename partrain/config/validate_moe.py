"""The rules of a mixture-of-experts config (model.moe, parallel.ep), checked with the others
before any process starts (partrain.config.validate calls `check_moe` once dp is known)."""

from omegaconf import DictConfig

from partrain.config.keys import divisors, shown
from partrain.errors import ConfigError
from partrain.models.arith import BALANCE


def check_moe(cfg: DictConfig, dp: int) -> None:
    p, m = cfg.parallel, cfg.model
    moe = m.moe
    if not moe.n_experts >= 0:
        raise ConfigError(f"model.moe.n_experts={moe.n_experts} must be >= 0 (0 = a dense model)")
    if moe.n_experts == 0:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} splits the experts of a mixture of experts, but "
                              "model.moe.n_experts=0 (a dense model): set model.moe.n_experts or "
                              "parallel.ep=1")
        return
    if not 1 <= moe.top_k <= moe.n_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.n_experts="
                          f"{moe.n_experts}")
    for key in ("n_shared_experts", "first_dense"):
        if not moe[key] >= 0:
            raise ConfigError(f"model.moe.{key}={moe[key]} must be >= 0")
    for key in ("every", "expert_ffn_dim"):
        if moe[key] is not None and moe[key] < 1:
            raise ConfigError(f"model.moe.{key}={moe[key]} must be at least 1")
    if moe.first_dense >= m.n_layers:
        raise ConfigError(f"model.moe.first_dense={moe.first_dense} leaves no MoE block among "
                          f"model.n_layers={m.n_layers}: it must be below n_layers")
    if moe.balance not in BALANCE:
        raise ConfigError(f"model.moe.balance={shown(moe.balance)} is not one of: "
                          f"{', '.join(BALANCE)}")
    for key in ("aux_loss_coef", "bias_update_rate", "capacity_factor"):
        if not moe[key] >= 0:
            raise ConfigError(f"model.moe.{key}={moe[key]} must be >= 0"
                              + (" (0 = dropless)" if key == "capacity_factor" else ""))
    if moe.capacity_factor and (p.cp > 1 or (p.sequence_parallel and p.tp > 1)):
        split = (f"parallel.cp={p.cp}" if p.cp > 1
                 else f"sequence parallelism (parallel.tp={p.tp})")
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} drops tokens by their place in "
            f"the sequence, and {split} splits each sequence over ranks: not supported yet; use "
            "dropless routing (model.moe.capacity_factor=0) with it")
    if p.ep > 1 and dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide parallel.dp={dp}: experts are split "
                          f"over groups of ep data-parallel ranks (try ep in {divisors(dp)})")
    if moe.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.n_experts={moe.n_experts} "
                          f"(try ep in {divisors(moe.n_experts)})")
    if p.ep > 1 and p.zero_stage == 3 and p.zero_backend == "deepspeed":
        raise ConfigError(
            f"parallel.ep={p.ep} with parallel.zero_stage=3 is not supported: DeepSpeed's ZeRO-3 "
            "does not take expert-parallel slices (its MoE support is ZeRO-1/2); use "
            "parallel.zero_stage=1 or 2 with ep, or parallel.ep=1 (ZeRO-3 shards the experts "
            "too)")
    _check_experts_on_every_stage(cfg)
    if m.init_from and str(m.init_from).startswith("hf:"):
        raise ConfigError(f"model.init_from={m.init_from}: Hugging Face imports are Llama models; "
                          "a mixture of experts (model.moe.n_experts="
                          f"{moe.n_experts}) cannot start from one")


def _check_experts_on_every_stage(cfg: DictConfig) -> None:
    """DeepSpeed's ZeRO-1/2 with ep and pp: each rank reduces its expert gradients' norm over the
    pipeline's ranks, but only a rank that holds experts does; one whose stage has no MoE block
    (model.moe.first_dense past it) skips that collective and the others wait for it forever (a
    reviewer's ZeRO-1 ep2 x pp2 run with first_dense=2 hung at step 1). DDP and FSDP2 have no
    such collective."""
    from partrain.models.arith import is_moe_block, stage_layers

    p, m = cfg.parallel, cfg.model
    if not (p.ep > 1 and p.pp > 1 and p.zero_stage in (1, 2) and p.zero_backend == "deepspeed"):
        return
    v = p.pp_virtual_stages
    stages = stage_layers(m.n_layers, p.pp, v, p.get("pp_layers"))
    for rank in range(p.pp):
        blocks = [b for chunk in range(v) for b in stages[chunk * p.pp + rank]]
        if not any(is_moe_block(m, b) for b in blocks):
            runs = []  # its blocks as ranges: "blocks 0-1, 4-5" (interleaved), "block 1"
            for b in blocks:
                if runs and b == runs[-1][1] + 1:
                    runs[-1][1] = b
                else:
                    runs.append([b, b])
            held = ("block " if len(blocks) == 1 else "blocks ") + ", ".join(
                str(a) if a == z else f"{a}-{z}" for a, z in runs)
            raise ConfigError(
                f"parallel.ep={p.ep} with DeepSpeed's ZeRO-{p.zero_stage} and parallel.pp="
                f"{p.pp}: pp rank {rank} holds no MoE block ({held}; "
                f"model.moe.first_dense={m.moe.first_dense}, every={m.moe.every}), and DeepSpeed "
                "reduces the expert gradients' norm over the pipeline only on ranks with "
                "experts: the others would wait for it forever. Give every pipeline stage a MoE "
                "block (model.moe.first_dense / every, or parallel.pp_layers), or use "
                "parallel.zero_backend=fsdp or zero_stage=0")

"""`partrain plan` for a model without the built-in shape arithmetic: a user's own model
(model.target), or a registered family that counts its parameters otherwise
(partrain.models.family.shape_modeled). Its parameters are the family's count from the config,
else counted by building the model on the meta device; the model state per rank follows the ZeRO
formulas for an even split over tp and pp (the plan says so). The activations, the step's time
and the layout search need the built-in family's shape arithmetic, and the plan says that too
rather than guess."""

from omegaconf import DictConfig

from partrain.config.resolve import World, compute_dtype
from partrain.models.family import count_params, family_of, probe
from partrain.plan.costs import human_bytes, optimizer_state_bytes, zero_memory

NOT_MODELED = ("activations, buffers and the step's time are not modeled for this model "
               "(they need the built-in family's shape arithmetic, partrain.models.arith)")


def build_user_plan(cfg: DictConfig, world: World, warnings: list[str]) -> dict:
    p, t = cfg.parallel, cfg.train
    family = family_of(cfg.model)
    found = probe(cfg.model)
    params = count_params(cfg.model)
    flops = (family.flops_per_token(cfg.model, t.seq_len)
             if family is not None and family.flops_per_token is not None else None)
    dtype = compute_dtype(t.dtype, cfg.launcher.device != "cpu")
    per_rank = params // (p.tp * p.pp)
    nd = p.dp * p.cp // p.dp_replicate
    memory = zero_memory(p.zero_stage, per_rank, nd, dtype, p.zero_backend, p.pp > 1,
                         optimizer_state_bytes(cfg.optim))
    return {
        "name": cfg.name,
        "world_size": world.size,
        "degrees": {"pp": p.pp, "dp": p.dp, "cp": p.cp, "tp": p.tp, "ep": p.ep,
                    "zero_stage": p.zero_stage, "zero_backend": p.zero_backend},
        "batch": {"global_batch_size": t.global_batch_size,
                  "micro_batch_size": t.micro_batch_size, "micro_batches": t.micro_batches,
                  "seq_len": t.seq_len},
        "model": {"name": cfg.model.name, "target": cfg.model.target,
                  "family": family.name if family is not None else None,
                  "args": dict(cfg.model.args), "params": params,
                  "params_per_rank": per_rank, "blocks": found.blocks,
                  "tensor_parallel_plan": found.tensor_parallel_plan,
                  "pipeline_split": found.pipeline_split,
                  "flops_per_token_declared": found.flops_per_token or flops is not None,
                  "flops_per_token": flops},
        "memory": {**memory, "dtype": dtype,
                   "assumes": "the parameters split evenly over tp and pp"},
        "not_modeled": NOT_MODELED,
        "warnings": warnings,
    }


def print_user_plan(plan: dict, out) -> None:
    m, d, mem = plan["model"], plan["degrees"], plan["memory"]
    which = f"your model {m['target']}" if m["target"] else f"model.family={m['family']}"
    out.print(f"{plan['name']}: {which} ({m['params']:,} parameters, "
              f"{m['blocks']} blocks) on {plan['world_size']} ranks: pp {d['pp']} x dp {d['dp']} "
              f"x tp {d['tp']}, zero_stage {d['zero_stage']}")
    flops = (f"{m['flops_per_token'] / 1e9:.2f} GFLOP per token" if m["flops_per_token"]
             else "yes" if m["flops_per_token_declared"]
             else "no (MFU counts 6 x parameters)")
    out.print(f"declares: tensor_parallel_plan {'yes' if m['tensor_parallel_plan'] else 'no'}, "
              f"pipeline split {'yes' if m['pipeline_split'] else 'no'}, flops_per_token "
              f"{flops}")
    b = plan["batch"]
    out.print(f"batch: {b['global_batch_size']} = micro_batch_size({b['micro_batch_size']}) * "
              f"micro_batches({b['micro_batches']}) * dp({d['dp']}), {b['seq_len']} tokens each")
    out.print(f"model state per rank ({mem['dtype']}, {mem['formula']}, {mem['assumes']}): "
              f"parameters {human_bytes(mem['param_bytes'])}, gradients "
              f"{human_bytes(mem['grad_bytes'])}, optimizer {human_bytes(mem['optim_bytes'])} = "
              f"{human_bytes(mem['total'])}")
    out.print(f"not modeled: {plan['not_modeled']}")
    for warning in plan["warnings"]:
        out.print(f"warning: {warning}")

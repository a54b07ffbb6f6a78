"""The checks around `partrain plan --search` (search.py): of its request and its config before it
runs (the rules no layout changes), and of its best layouts after, by partrain's own validation
as `launch` would compose them."""

from partrain.models.family import shape_modeled
from partrain.plan.hardware import Hardware
from partrain.plan.search import Candidate


def world_overrides(gpus: int, hw: Hardware) -> list[str]:
    """The launcher keys of N GPUs in nodes of hw.gpus_per_node (one partial node if fewer)."""
    per_node = min(gpus, hw.gpus_per_node)
    return ["launcher.device=cuda", f"launcher.nnodes={gpus // per_node}",
            f"launcher.nproc_per_node={per_node}"]


def check_request(gpus: int, hw: Hardware) -> None:
    from partrain.config.resolve import MAX_WORLD_SIZE
    from partrain.errors import ConfigError

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    if gpus > MAX_WORLD_SIZE:
        raise ConfigError(f"--gpus {gpus} must be at most {MAX_WORLD_SIZE:,}, the most ranks "
                          "partrain plans for")
    if gpus > hw.gpus_per_node and gpus % hw.gpus_per_node:
        raise ConfigError(f"--gpus {gpus} must be a multiple of --gpus-per-node "
                          f"{hw.gpus_per_node} (whole nodes), or at most one node")


def check_config(cfg) -> None:
    """The rules that no layout changes, before the search: each key on its own (a whole number,
    finite, in its range), the model's shape and its experts, the sequence against the model's
    rotary tables. The search reads these keys as they are; a model that no layout can run is
    named here by its keys, not found later as "nothing fits"."""
    import copy

    from omegaconf import open_dict

    from partrain.errors import ConfigError

    if cfg.parallel.offload_params != "none":
        raise ConfigError(
            f"parallel.offload_params={cfg.parallel.offload_params}: plan --search does not try "
            "parameter offload, and would write it into layouts that cannot take it (it needs "
            "ZeRO-3); leave it out (the search tries the optimizer's offload, "
            "parallel.offload_optimizer=cpu), then `partrain plan RECIPE "
            "parallel.offload_params=cpu` prices a ZeRO-3 layout with it")
    if not shape_modeled(cfg.model):
        from partrain.plan.user import NOT_MODELED

        which = (f"model.target={cfg.model.target} is your own model" if cfg.model.get("target")
                 else f"model.family={cfg.model.family} counts its parameters without it")
        raise ConfigError(f"plan --search prices layouts by the model's shape arithmetic, and "
                          f"{which}: {NOT_MODELED}; "
                          "`partrain plan` without --search shows its parameters and model state")
    # validate.py has no public name for its layout-free rules; they run here on a copy of the
    # config whose parallel and micro-batch keys (which the search sets) are the plainest.
    from partrain.config.validate_keys import check_each_key, check_model_shape
    from partrain.config.validate_layout import check_seq_len
    from partrain.config.validate_moe import check_moe

    view = copy.deepcopy(cfg)
    with open_dict(view):
        for key in ("dp", "tp", "pp", "cp", "ep", "pp_virtual_stages"):
            view.parallel[key] = 1
        view.parallel.pp_layers = None
        view.train.micro_batch_size, view.train.micro_batches = 1, None
    check_each_key(view)
    check_model_shape(view.model)
    check_moe(view, 1)
    check_seq_len(view)


def validated(result: dict, config: str | None, overrides: list[str], gpus: int, hw: Hardware,
              show: int = 10) -> dict:
    """Keep the best candidates that partrain's own validation accepts, as `launch` would
    compose and check them (each with its reason if refused), up to `show` of them."""
    from partrain.config.compose import compose_config
    from partrain.config.resolve import resolve_world
    from partrain.config.validate import resolve_and_validate
    from partrain.errors import ConfigError

    def refusal(cand: Candidate) -> str | None:
        keys = [*overrides, *world_overrides(gpus, hw), *cand.overrides()]
        try:
            cfg = compose_config(config, keys)
            world = resolve_world(cfg, None, None, 0)
            resolve_and_validate(cfg, world)
        except ConfigError as e:
            return str(e)
        cand.config = cfg
        return None

    kept, refused = [], []
    for cand in result["best"]:
        if len(kept) == show:
            break
        reason = refusal(cand)
        if reason is None:
            kept.append(cand)
        else:
            refused.append((cand, reason))
    if refused and not kept:
        reasons = {reason for _, reason in refused}
        raise ConfigError(
            f"none of the {len(refused)} best layouts that fit passes partrain's validation"
            + (f": {reasons.pop()}" if len(reasons) == 1 else
               f"; the first, {refused[0][0].describe()}: {refused[0][1]}"))
    too_big = result["smallest_that_does_not_fit"]
    if not result["best"] and too_big is not None:
        # Nothing fits: if the layout nearest to fitting breaks a rule, the rule is the news.
        reason = refusal(too_big)
        if reason is not None:
            raise ConfigError(f"no layout fits in memory, and the nearest to fitting, "
                              f"{too_big.describe()}, is refused by partrain's validation: {reason}")
    return {**result, "best": kept, "refused": refused}

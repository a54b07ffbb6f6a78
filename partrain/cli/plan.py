"""`partrain plan`: the plan of a layout (every rank's place, the groups, the batch arithmetic,
memory per stage; on a GPU target whether each stage fits and the step's time), or with
`--search` the best layouts of the config's model and batch on N GPUs. partrain.cli holds the
command's flags; this is what it does with them."""

import dataclasses
import json
import sys

from partrain.errors import ConfigError


def plan_command(args: list[str], world_size, as_json: bool, search: bool, gpus, gpus_per_node,
                 hardware, tokens_per_step, explain, write_recipe, out) -> None:
    """`partrain plan ARGS...` with its flags; prints to `out` (a rich Console) or JSON."""
    from partrain.launch.preflight import PLAN, Request, preflight
    from partrain.plan.fit import DEFAULT_HARDWARE, on_gpu, on_hardware
    from partrain.plan.hardware import load_hardware
    from partrain.plan.layout import build_plan
    from partrain.plan.render import print_plan

    if search:
        if world_size is not None:  # it was ignored: the search plans for --gpus
            raise ConfigError(f"--world-size {world_size} is not a --search option: the search "
                              "lays out --gpus N; give --gpus, or drop --search")
        _search(args, gpus, gpus_per_node, hardware, tokens_per_step, explain, write_recipe,
                as_json, out)
        return
    for flag, value in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node),
                        ("--explain", explain), ("--write-recipe", write_recipe)):
        if value is not None:
            raise ConfigError(f"{flag} is a --search option; add --search")
    hw = load_hardware(hardware) if hardware is not None else None
    if tokens_per_step is not None:
        args.append(_tokens_override(args, tokens_per_step))
    ready = preflight(Request(args, PLAN, world_size=world_size))
    if ready.cfg.model.get("target"):  # a user's own model: what partrain knows of it
        from partrain.plan.user import build_user_plan, print_user_plan

        result = build_user_plan(ready.cfg, ready.world, ready.warnings)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            print_user_plan(result, out)
        return
    # With --hardware the whole plan is the GPU's (its dtype, offload on the host), as its fit
    # line is: a CPU config's body said fp32's 102.4 GiB beside the fit line's bf16 60.3.
    result = build_plan(on_gpu(ready.cfg) if hw is not None else ready.cfg, ready.world,
                        ready.warnings)
    if hw is not None or ready.cfg.launcher.device == "cuda":
        on_hardware(result, ready.cfg, ready.world, hw or load_hardware(DEFAULT_HARDWARE),
                    "--hardware" if hw is not None else
                    "the default --hardware, for launcher.device=cuda")
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_plan(result, out)


def _tokens_override(args: list[str], tokens_per_step: str) -> str:
    """--tokens-per-step as the override train.global_batch_size=N, read against the config's
    train.seq_len (composed once more for it)."""
    from partrain.config.compose import compose_config
    from partrain.launch.preflight import split_args
    from partrain.plan.explain import tokens_to_sequences

    config, overrides = split_args(args)
    if any(o.lstrip("+").split("=", 1)[0] == "train.global_batch_size" for o in overrides):
        raise ConfigError(f"--tokens-per-step {tokens_per_step} and train.global_batch_size both "
                          "set the global batch; give one")
    seq_len = compose_config(config, overrides).train.seq_len
    return f"train.global_batch_size={tokens_to_sequences(tokens_per_step, seq_len)}"


def _search(args, gpus, gpus_per_node, hardware, tokens_per_step, explain, write_recipe,
            as_json, out) -> None:
    import shlex

    from partrain.config.compose import compose_config
    from partrain.launch.preflight import split_args
    from partrain.plan.explain import assumptions, parse_explain
    from partrain.plan.fit import DEFAULT_HARDWARE
    from partrain.plan.hardware import load_hardware
    from partrain.plan.recipe import check_recipe_path
    from partrain.plan.recipe import write_recipe as write
    from partrain.plan.search import why_no_layout
    from partrain.plan.search import search as run_search
    from partrain.plan.search_checks import check_config, check_request, validated
    from partrain.plan.search_render import as_json as search_json
    from partrain.plan.search_render import nothing_fits, print_search

    if gpus is None:
        raise ConfigError("--search needs --gpus N")
    wanted = parse_explain(explain) if explain is not None else None
    hw = load_hardware(hardware if hardware is not None else DEFAULT_HARDWARE)
    if gpus_per_node is not None:
        from partrain.config.validate_keys import MAX_NPROC_PER_NODE

        if gpus_per_node > MAX_NPROC_PER_NODE:
            raise ConfigError(f"--gpus-per-node={gpus_per_node} must be at most "
                              f"{MAX_NPROC_PER_NODE}, the most ranks partrain starts on one node")
        hw = dataclasses.replace(hw, gpus_per_node=gpus_per_node)
    check_request(gpus, hw)
    if write_recipe is not None:
        check_recipe_path(write_recipe)
    flags = {}
    if tokens_per_step is not None:
        args = [*args, _tokens_override(args, tokens_per_step)]
        flags[f"--tokens-per-step {tokens_per_step}"] = ("train.global_batch_size",)
    config, overrides = split_args(args)
    cfg = compose_config(config, overrides)
    check_config(cfg)
    found = run_search(cfg, gpus, hw, top=40, explain=wanted)
    if not found["candidates"]:
        raise ConfigError(why_no_layout(cfg, gpus, hw))
    result = validated(found, config, overrides, gpus, hw)
    result["assumptions"] = assumptions(
        cfg, config, overrides, hw, gpus, flags=flags,
        hw_source=("--hardware" if hardware is not None else "the default --hardware")
        + (", --gpus-per-node" if gpus_per_node is not None else ""))
    if not result["best"]:
        # Printed (the priced line, --explain's answer, the JSON), then refused: no layout to run
        if as_json:
            sys.stdout.write(json.dumps(search_json(result), indent=2) + "\n")
        else:
            print_search(result, out)
        raise ConfigError(nothing_fits(result, write_recipe))
    if write_recipe is not None:
        command = " ".join(["partrain plan --search", shlex.join(args or []), f"--gpus {gpus}",
                            f"--gpus-per-node {hw.gpus_per_node}",
                            # what was given (a YAML's path), not the name inside it
                            f"--hardware {shlex.quote(hardware or hw.name)}"])
        write(write_recipe, result, command)
    if as_json:
        sys.stdout.write(json.dumps(search_json(result), indent=2) + "\n")
    else:
        print_search(result, out)
        if write_recipe is not None and result["best"]:
            out.print(f"wrote {write_recipe}: partrain launch {write_recipe}")

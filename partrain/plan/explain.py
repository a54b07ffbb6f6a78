"""What `partrain plan --search` says besides its ranking: what it priced and where each value
came from (the first line; `--tokens-per-step` read as sequences), a batch too small to feed the
GPUs named as the limit, and `--explain 'tp=8 pp=8'`: where the best layout with those values
ranks and which parts of its step cost more than the winner's, or why none is in the ranking.

search.py enumerates, prices and ranks, and calls in here for the words; nothing here imports it
(the rules that leave a layout out of the enumeration stay beside the enumeration, in search.py,
and come in as text).
"""

from partrain.config.resolve import compute_dtype
from partrain.plan.fit import CHECKPOINTING
from partrain.plan.hardware import Hardware

# --explain: what a layout may be asked by, and the Layout field each name sets.
EXPLAIN_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero_stage",
                "zero_stage": "zero_stage", "mb": "micro_batch_size",
                "micro_batch_size": "micro_batch_size", "ckpt": "activation_checkpointing",
                "activation_checkpointing": "activation_checkpointing",
                "schedule": "pp_schedule", "pp_schedule": "pp_schedule",
                "v": "pp_virtual_stages", "pp_virtual_stages": "pp_virtual_stages",
                "offload": "offload_optimizer", "offload_optimizer": "offload_optimizer",
                "backend": "zero_backend", "zero_backend": "zero_backend"}
EXPLAIN_CHOICES = {"activation_checkpointing": CHECKPOINTING,
                   "zero_backend": ("deepspeed", "fsdp"),
                   "pp_schedule": ("1f1b", "interleaved_1f1b"),
                   "offload_optimizer": ("none", "cpu")}


def parse_explain(text: str) -> dict:
    """--explain 'tp=8 pp=8' (spaces or commas; `parallel.` and `train.` prefixes allowed) as
    Layout fields -> values."""
    from partrain.errors import ConfigError

    wanted = {}
    items = [i for i in text.replace(",", " ").split() if i]
    if not items:
        raise ConfigError(f"--explain {text!r} names no degree; give key=value pairs such as "
                          "'tp=8 pp=8'")
    for item in items:
        key, sep, value = item.partition("=")
        name = key.removeprefix("parallel.").removeprefix("train.")
        if not sep or name not in EXPLAIN_KEYS:
            raise ConfigError(f"--explain {item!r}: each item is key=value with key one of "
                              f"{', '.join(sorted(set(EXPLAIN_KEYS)))}")
        field = EXPLAIN_KEYS[name]
        if field in EXPLAIN_CHOICES:
            if value not in EXPLAIN_CHOICES[field]:
                raise ConfigError(f"--explain {item}: {key} must be one of "
                                  f"{', '.join(EXPLAIN_CHOICES[field])}")
            wanted[field] = value
        else:
            if not value.isdigit() or len(value) > 9 or int(value) < (0 if field == "zero_stage"
                                                                        else 1):
                raise ConfigError(f"--explain {item}: {key} must be a whole number, at least "
                                  f"{0 if field == 'zero_stage' else 1}")
            wanted[field] = int(value)
    return wanted


def explained(want: dict, matching: list, fits: list, budget: float, tie: float,
              not_enumerated: str | None) -> dict:
    """Where the best layout with the asked values ranks and why, or what rules it out.
    `matching`: the enumerated layouts with those values (Candidates; those that fit carry their
    time); `fits`: every layout that fits, ranked; `tie`: the ranking's tie factor;
    `not_enumerated`: the rule that leaves no layout with those values (when none matched)."""
    asked = " ".join(f"{k}={v}" for k, v in want.items())
    if not matching:
        return {"asked": asked, "verdict": "not enumerated", "reason": not_enumerated}
    fitting = [c for c in matching if c.time]
    if not fitting:
        least = min(matching, key=lambda c: c.memory_bytes)
        return {"asked": asked, "verdict": "does not fit", "variants": len(matching),
                "reason": f"none of its {len(matching):,} variants (micro-batch, checkpointing, "
                          f"ZeRO, offload) fits in {budget / 2**30:,.1f} GiB: the smallest, "
                          f"{least.describe()}, needs {least.memory_bytes / 2**30:,.1f} GiB "
                          f"(largest part: {least.memory_largest})",
                "nearest": least.describe(), "memory_bytes": least.memory_bytes}
    order = {id(c): i for i, c in enumerate(fits)}
    best = min(fitting, key=lambda c: order[id(c)])
    winner, rank = fits[0], order[id(best)] + 1
    ratio = best.time["tokens_per_s"] / winner.time["tokens_per_s"]
    costs = sorted(((best.time[k] - winner.time[k], k) for k in best.time
                    if k.endswith("_s") and k != "step_s" and not k.startswith("tokens_per")
                    and isinstance(best.time[k], float)), reverse=True)
    more = [f"{k.removesuffix('_s').replace('_', ' ')} +{d:.3g} s" for d, k in costs[:3]
            if d > 0.01 * winner.time["step_s"]]
    why = ("it is the best layout" if rank == 1 else
           f"{ratio:.1%} of the best's tokens/s ({winner.describe()}); its step is "
           f"{best.time['step_s']:.3g} s against {winner.time['step_s']:.3g} s"
           + (f", more time in: {', '.join(more)}" if more else "")
           + (f" (within {tie - 1:.0%}: ranked by simplicity)" if ratio > 1 / tie else ""))
    return {"asked": asked, "verdict": "ranked", "rank": rank, "of": len(fits),
            "variants": len(matching), "fitting_variants": len(fitting),
            "best_variant": best.as_dict(), "reason": why}


def explain_text(ex: dict) -> str:
    if ex["verdict"] == "ranked":
        b = ex["best_variant"]
        return (f"--explain {ex['asked']}: its best variant, {b['describe']}, ranks "
                f"{ex['rank']:,} of {ex['of']:,} that fit: {b['tokens_per_s_per_gpu']:,.0f} "
                f"tokens/s per GPU, MFU {b['mfu']:.1%}, {b['memory_bytes'] / 2**30:.1f} GiB, "
                f"limited by {b['limits']}; {ex['reason']}")
    return f"--explain {ex['asked']}: {ex['verdict']}: {ex['reason']}"


def tokens_to_sequences(text: str, seq_len: int) -> int:
    """--tokens-per-step TOKENS (a whole number, K = 1,024, M = 1,048,576) as sequences of
    train.seq_len tokens."""
    import re

    from partrain.errors import ConfigError

    match = re.fullmatch(r"(\d{1,15}(?:\.\d{1,6})?)([KkMm]?)", text.strip())
    if not match:
        raise ConfigError(f"--tokens-per-step {text!r} is not a number of tokens: give a whole "
                          "number, or one with K (1,024) or M (1,048,576), such as 4M")
    scale = {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
    tokens = float(match.group(1)) * scale
    if tokens != int(tokens) or tokens < 1:
        raise ConfigError(f"--tokens-per-step {text} is {tokens:g} tokens: it must be a whole "
                          "number of tokens, at least 1")
    tokens = int(tokens)
    if tokens % seq_len:
        raise ConfigError(f"--tokens-per-step {text} = {tokens:,} tokens is not a multiple of "
                          f"train.seq_len={seq_len}: the global batch is whole sequences (try "
                          f"{max(1, tokens // seq_len) * seq_len:,} or "
                          f"{(tokens // seq_len + 1) * seq_len:,})")
    return tokens // seq_len


def key_source(key: str, config: str | None, overrides: list[str],
               flags: dict | None = None) -> str:
    """Where a config key's value came from: a flag, an override, the recipe, or the defaults."""
    for flag, keys in (flags or {}).items():
        if key in keys:
            return flag
    if any(o.lstrip("+").split("=", 1)[0] == key for o in overrides):
        return "override"
    from partrain.config.compose import find_recipe, read_yaml
    from partrain.errors import ConfigError

    try:
        node = read_yaml(find_recipe(config))
        for part in key.split("."):
            node = node[part]
        return f"config {config or 'quickstart (no CONFIG given)'}"
    except (ConfigError, KeyError, TypeError):  # not in the file: the defaults' value
        return "default (configs/)"


def assumptions(cfg, config: str | None, overrides: list[str], hw: Hardware, gpus: int,
                hw_source: str, flags: dict | None = None) -> dict:
    """What the search priced and where each came from."""
    t = cfg.train
    src = {k: key_source(f"train.{k}", config, overrides, flags)
           for k in ("global_batch_size", "seq_len", "dtype")}
    return {"global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
            "tokens_per_step": t.global_batch_size * t.seq_len,
            "dtype": compute_dtype(t.dtype, True), "train_dtype": t.dtype,
            "hardware": hw.name, "gpus": gpus, "gpus_per_node": hw.gpus_per_node,
            "sources": {"train.global_batch_size": src["global_batch_size"],
                        "train.seq_len": src["seq_len"], "train.dtype": src["dtype"],
                        "hardware": hw_source}}


def assumptions_text(a: dict) -> str:
    s = a["sources"]
    return (f"priced: global batch {a['global_batch_size']:,} sequences x {a['seq_len']:,} "
            f"tokens = {a['tokens_per_step']:,} tokens per step (train.global_batch_size: "
            f"{s['train.global_batch_size']}; train.seq_len: {s['train.seq_len']}), dtype "
            f"{a['dtype']} (train.dtype={a['train_dtype']}: {s['train.dtype']}), on "
            f"{a['gpus']:,} x {a['hardware']}, {a['gpus_per_node']} per node (hardware: "
            f"{s['hardware']})")


def batch_exhausted(c) -> bool:
    """Whether a layout (a search Candidate) has used the whole batch on data parallelism: one sequence per
    micro-batch and no more micro-batches than its pipeline needs, so dp cannot grow."""
    L = c.layout
    return (L.micro_batch_size == 1 and c.time.get("micro_batches") == max(1, L.pp)
            and L.tp * L.pp * L.cp > 1)


def batch_limit(result: dict) -> str | None:
    """The batch named as the limit, when the best layout has run out of sequences to give
    data parallelism and spends the GPUs on tp, pp and cp instead."""
    if not result["best"] or not batch_exhausted(result["best"][0]):
        return None
    best, gbs, seq = result["best"][0], result["global_batch_size"], result["seq_len"]
    L, gpus = best.layout, result["gpus"]
    tokens = gbs * seq
    return (f"the global batch is the limit: {gbs:,} sequences of {seq:,} tokens ({tokens:,} "
            f"tokens per step, {tokens / gpus:,.1f} per GPU) cannot feed dp > {gbs:,}; the best "
            f"layout gives each of its dp={L.dp} replica(s) {best.time['micro_batches']} "
            f"micro-batch(es) of one sequence and puts the {gpus // L.dp:,} GPUs of a replica "
            f"into tp({L.tp}) x pp({L.pp}) x cp({L.cp}): raise train.global_batch_size (or "
            "--tokens-per-step)")

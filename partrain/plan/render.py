"""`partrain plan` on a terminal: the plan that layout.build_plan computes, as rich tables and a pipeline timeline."""

from rich.console import Console
from rich.table import Table
from rich.text import Text

from partrain.plan.costs import human_bytes as _size
from partrain.plan.layout import TIMELINE_MAX_RANKS

_F_STYLES = ("white on blue", "white on dark_cyan", "white on magenta")


_B_STYLES = ("black on green", "black on yellow", "black on red")


def _timeline_rows(timeline: list[list[dict]]) -> list[str]:
    """One line per pp rank: three characters per time unit (F = 1, B = 2 units)."""
    end = max(span["end"] for spans in timeline for span in spans)
    rows = []
    for rank, spans in enumerate(timeline):
        cells, t = [], 0.0
        for span in spans:
            if span["start"] > t:
                cells.append("[dim]" + "···" * round(span["start"] - t) + "[/dim]")
            styles = _F_STYLES if span["op"] == "F" else _B_STYLES
            style = styles[span["chunk"] % len(styles)]
            width = 3 * round(span["end"] - span["start"])
            cells.append(f"[{style}]{span['op']}{span['mb']}".ljust(len(style) + 2 + width) + "[/]")
            t = span["end"]
        if end > t:
            cells.append("[dim]" + "···" * round(end - t) + "[/dim]")
        rows.append(f"pp {rank:>2} " + "".join(cells))
    return rows


TABLE_END_ROWS = 8  # a ranks table longer than twice this shows its ends


def _group_text(first_members: list[int], size: int) -> str:
    return "[" + ",".join(map(str, first_members)) + (",...]" if size > len(first_members) else "]")


def print_plan(plan: dict, console: Console) -> None:
    """The plan, section by section: world and model, ranks and groups, batch and memory, the
    pipeline, the tp and cp traffic, then the warnings."""
    if "not_modeled" in plan:  # a model without the built-in shape arithmetic (plan.user)
        from partrain.plan.user import print_user_plan

        print_user_plan(plan, console)
        return
    _print_world(plan, console)
    _print_ranks(plan, console)
    _print_hsdp(plan, console)
    _print_memory(plan, console)
    if plan["pipeline"]:
        _print_pipeline(plan, console)
    _print_tp_collectives(plan, console)
    _print_context(plan, console)
    if plan.get("time"):
        _print_on_hardware(plan, console)
    for warning in plan["warnings"]:
        console.print(Text.assemble(("warning:", "yellow"), " ", warning))


def _print_world(plan: dict, console: Console) -> None:
    d, m = plan["degrees"], plan["model"]
    console.print(Text.assemble(
        (plan["name"], "bold"),
        f": {plan['world_size']} ranks = {plan['nnodes']} node(s) x "
        f"{plan['nproc_per_node']} per node; pp({d['pp']}) * dp({d['dp']}) * "
        + (f"cp({d['cp']}) * " if d["cp"] > 1 else "")
        + f"tp({d['tp']}) = {d['pp'] * d['dp'] * d['cp'] * d['tp']}"
        + (f"; ep {d['ep']} (experts split inside dp)" if d["ep"] > 1 else "")
        + f"; zero_stage {d['zero_stage']}"))
    ex = plan["experts"]
    console.print(f"model {m['name']}: {m['params']:,} parameters"
                  + (f" ({m['active_params']:,} active per token)" if ex else "")
                  + f", {m['params_per_rank']:,} per rank (tp={d['tp']} splits all but the norms"
                  + (f" and experts; ep={d['ep']} splits the experts" if ex else "") + "), "
                  f"{m['flops_per_token'] / 1e9:.2f} GFLOP per token (training)")
    if ex:
        a2a = ex["all_to_all"]
        console.print(
            f"experts: {ex['n_experts']} per MoE block (top-{ex['top_k']}"
            + (f", {ex['n_shared_experts']} shared" if ex["n_shared_experts"] else "")
            + f"), {ex['moe_blocks']} MoE blocks, {ex['experts_per_rank']} per rank "
            f"({_size(4 * ex['expert_params_per_rank'])} of fp32 expert weights on the busiest "
            f"rank); ep groups of {ex['ep']} consecutive dp ranks "
            + " ".join(_group_text(g, ex["ep"]) for g in ex["ep_groups"][:4])
            + (" ..." if len(ex["ep_groups"]) > 4 else "")
            + f"; all-to-all {_size(a2a['bytes_sent'] + a2a['count_bytes'])} sent per step per "
            f"rank ({ex['tokens_routed_per_rank']:,} tokens routed, uniform routing)")


def _print_hsdp(plan: dict, console: Console) -> None:
    h = plan.get("hsdp")
    if not h:
        return
    cp = plan["degrees"]["cp"]
    console.print(
        f"HSDP: dp {plan['degrees']['dp']} = dp_replicate {h['dp_replicate']} x dp_shard "
        f"{h['dp_shard']}; FSDP shards inside "
        + " ".join(_group_text(g, len(g)) for g in h["shard_groups"][:4])
        + (" ..." if len(h["shard_groups"]) > 4 else "")
        + (f" (with their cp ranks: {h['dp_shard'] * cp} per group)" if cp > 1 else "")
        + " and all-reduces gradients across "
        + " ".join(_group_text(g, len(g)) for g in h["replicate_groups"][:4])
        + (" ..." if len(h["replicate_groups"]) > 4 else "")
        + " (the dp groups of pp, cp and tp rank 0; the others alike)")


def _print_ranks(plan: dict, console: Console) -> None:
    d = plan["degrees"]
    shown = plan["ranks"] if plan["world_size"] <= 2 * TABLE_END_ROWS else (
        plan["ranks"][:TABLE_END_ROWS] + [None] + plan["ranks"][-TABLE_END_ROWS:])
    ranks = Table(title="ranks" if shown is plan["ranks"] else
                  f"ranks (the first and last {TABLE_END_ROWS} of {plan['world_size']:,})")
    cols = ("rank", "node", "local_rank", "pp", "dp", *(("cp",) if d["cp"] > 1 else ()), "tp")
    for col in cols:
        ranks.add_column(col, justify="right")
    for r in shown:
        ranks.add_row(*(["..."] * len(cols) if r is None else [str(r[c]) for c in cols]))
    console.print(ranks)

    groups = Table(title="process groups (ranks that communicate along each dimension)")
    groups.add_column("dim")
    groups.add_column("groups", justify="right")
    groups.add_column("ranks")
    for dim, pattern in plan["group_pattern"].items():
        members = (plan["groups"] or {}).get(dim)
        if members is not None and len(members) * pattern["size"] <= 64:
            text = "  ".join("[" + ",".join(map(str, g)) + "]" for g in members)
        else:
            text = (f"{pattern['groups']:,} groups of {pattern['size']:,} ranks, stride "
                    f"{pattern['stride']:,}: {_group_text(pattern['first'], pattern['size'])} "
                    f"... {_group_text(pattern['last'], pattern['size'])}")
        groups.add_row(dim, f"{pattern['groups']:,}", text)
    console.print(groups)


def _print_memory(plan: dict, console: Console) -> None:
    b = plan["batch"]
    console.print(f"batch: global_batch_size {b['rule']}; seq_len {b['seq_len']}; "
                  f"{b['tokens_per_step']:,} tokens per step")
    mem = plan["memory"]
    fsdp = mem.get("engine") == "fsdp"

    def name_of(s: int) -> str:
        return "DDP" if s == 0 else f"FSDP stage {s}" if fsdp and s >= 2 else f"ZeRO-{s}"
    name = name_of(mem["zero_stage"])
    others = ", ".join(f"{name_of(s)} {_size(total)}"
                       for s, total in mem["total_by_stage"].items() if s != mem["zero_stage"])
    shards = f"Nd = {mem['dp']}" + (
        f"; {mem['expert_params_per_rank']:,} of them expert slices, Nde = dp/ep x cp = "
        f"{mem['expert_nd']}" if mem.get("expert_params_per_rank") else "")
    console.print(f"memory per rank ({name}, {mem['dtype']}, Ψ = {mem['params_per_rank']:,} "
                  f"parameters, {shards}): parameters {_size(mem['param_bytes'])} + "
                  f"gradients {_size(mem['grad_bytes'])} + optimizer state "
                  f"{_size(mem['optim_bytes'])} = {mem['formula']} = {_size(mem['total'])}; "
                  f"other stages: {others}")
    for st in plan["memory_per_stage"]:
        state = st["param_bytes"] + st["grad_bytes"] + st["optim_bytes"]
        on_host = [what for what, off in (("the optimizer state: ZeRO-Offload",
                                             st["optim_on_host"]),
                                            ("the weights' shards: parameter offload",
                                             st.get("params_on_host"))) if off]
        parts = [f"model state {_size(state)}"
                 + (f" (on the host: {'; '.join(on_host)})" if on_host else ""),
                 f"activations {_size(st['activation_bytes'])} ({st['in_flight']} micro-batch"
                 f"{'es' if st['in_flight'] != 1 else ''} in flight)"]
        parts += [f"{label} {_size(st[key])}" for key, label in (
            ("gathered_bytes", "ZeRO-3's gathered blocks (two blocks' weights, one's "
                               "gradients, whole)"),
            ("accumulation_bytes", "gradients accumulated beside DDP's buckets"),
            ("pipeline_buffer_bytes", "pipeline p2p buffers"), ("loss_bytes", "loss"),
            ("backward_bytes", "a block's backward")) if st[key]]
        where = f"pp rank {st['pp_rank']}" if len(plan["memory_per_stage"]) > 1 else "each rank"
        grads = ("" if st.get("grads_at_peak", True) else
                 f"; the model state's gradients ({_size(st['grad_bytes'])}) are left out of "
                 "the sum: one micro-batch makes them as its backward frees the activations")
        console.print(f"peak memory, {where}: {_size(st['total'])} = " + ", ".join(parts)
                      + " (the loss's and the backward's buffers are not alive together: the "
                        f"larger counts{grads})")
    ck = plan["checkpoint"]
    when = (f"every {ck['every']} steps" if ck["every"] else "not on a schedule") + \
        (" and after the last" if ck["save_last"] else "")
    console.print(f"checkpoint: {_size(ck['bytes'])} (fp32 weights + the optimizer's state), "
                  f"about {_size(ck['bytes_per_rank'])} written per rank; {when}, newest {ck['keep']} "
                  f"kept ({_size(ck['disk_bytes'])} on disk){', in the background' if ck['async_save'] else ''}")


def _print_pipeline(plan: dict, console: Console) -> None:
    pipe = plan["pipeline"]
    stage_table = Table(title="pipeline stages")
    for col in ("stage", "pp rank", "chunk", "blocks", "also", "params per rank"):
        stage_table.add_column(col, justify="right")
    # A tied head on another stage than the embedding is a copy of it (memory there too).
    head = "norm + tied head + loss" if plan["model"]["tie_embeddings"] \
        else "norm + head + loss"
    for s in pipe["stages"]:
        also = ", ".join(x for x, on in (("embedding", s["embedding"]), (head, s["head"]))
                         if on)
        stage_table.add_row(str(s["stage"]), str(s["pp_rank"]), str(s["chunk"]),
                            f"{s['blocks'][0]}-{s['blocks'][1]}", also,
                            f"{s['params_per_rank']:,}")
    console.print(stage_table)
    m, shown = pipe["micro_batches"], pipe["timeline_micro_batches"]
    note = "" if shown == m else f" (drawn for {shown} micro-batches; the run has {m})"
    console.print(f"schedule {pipe['schedule']}, {m} micro-batches"
                  f"{', ' + str(pipe['virtual_stages']) + ' chunks per rank' if pipe['virtual_stages'] > 1 else ''}"
                  f"; timeline{note}: F/B = forward/backward of micro-batch n, a backward "
                  "taking twice a forward, ··· = idle")
    if pipe["timeline"] is None:
        console.print(f"(not drawn for more than {TIMELINE_MAX_RANKS} pp ranks)")
    for row in _timeline_rows(pipe["timeline"] or []):
        console.print(row, soft_wrap=True, highlight=False, markup=True)  # generated text only
    peak = pipe["peak_in_flight"]
    console.print(f"bubble {pipe['rule']} = {pipe['bubble_theory']:.3f} of each step idle; "
                  "peak activations in flight per rank: "
                  f"{peak if peak is not None else 'not simulated (too many micro-batches)'}")


def _print_tp_collectives(plan: dict, console: Console) -> None:
    d = plan["degrees"]
    tpc = plan["tp_collectives"]
    if tpc["per_step"]:
        stages = (f"; a pp stage's {tpc['layers_per_tp_group']} blocks, embedding rows on the "
                  "first stage, head and loss rows on the last" if d["pp"] > 1 else "")
        table = Table(title=f"tensor-parallel collectives per step, in each tp group of {d['tp']}"
                            f"{' (sequence parallel)' if tpc['sequence_parallel'] else ''}"
                            f"{stages}; payload = the full tensor, sent = per rank, ring algorithm")
        for col in ("where", "op", "calls", "elements each", "payload", "sent"):
            table.add_column(col, justify="left" if col in ("where", "op") else "right")
        for r in tpc["per_step"]:
            table.add_row(r["where"], r["op"], f"{r['calls']:,}", f"{r['elements']:,}",
                          _size(r["bytes"]), _size(r["wire_bytes"]))
        table.add_row("total", "", "", "", _size(tpc["bytes_per_step"]),
                      _size(tpc["wire_bytes_per_step"]))
        console.print(table)


def _print_context(plan: dict, console: Console) -> None:
    ctx = plan["context"]
    # What cp buys, by the memory model (the peak line's activations, one micro-batch); without
    # cp there is nothing to compare.
    if ctx["cp"] > 1:
        console.print(f"context parallelism: activations kept per micro-batch per rank "
                      f"{_size(ctx['activation_bytes_per_micro_batch'])} "
                      f"({ctx['tokens_per_rank']:,} tokens of each sequence), "
                      f"{_size(ctx['activation_bytes_per_micro_batch_cp1'])} at cp=1")
    if ctx["per_step"]:
        table = Table(title=f"context-parallel traffic per step, per rank of a cp group of "
                            f"{ctx['cp']} ({ctx['method']})")
        for col in ("where", "op", "calls", "bytes each", "sent"):
            table.add_column(col, justify="left" if col in ("where", "op") else "right")
        for r in ctx["per_step"]:
            table.add_row(r["where"], r["op"], f"{r['calls']:,}", _size(r["bytes_each"]),
                          _size(r["bytes"]))
        table.add_row("total", "", "", "", _size(ctx["bytes_per_step"]))
        console.print(table)


def _print_on_hardware(plan: dict, console: Console) -> None:
    """The fit and the step's price on the plan's GPUs (plan/fit.py), parts of 1% or more."""
    t, fit = plan["time"], plan["fit"]
    console.print(f"on {t['gpus']:,} x {t['hardware']} ({t['hardware_source']}; "
                  f"{_size(fit['device_bytes'])} each, {t['gpus_per_node']} per node as the "
                  f"plan's world), {t['dtype']}, {t['global_batch_size']:,} sequences x "
                  f"{t['seq_len']:,} tokens = {t['tokens_per_step']:,} tokens per step:")
    peaks = ", ".join(f"pp rank {s['pp_rank']} {_size(s['peak_bytes'])}" for s in fit["stages"])
    console.print(f"  memory: {peaks}; "
                  + (f"fits in {fit['usable_fraction']:.0%} of the GPU ({_size(fit['usable_bytes'])})"
                     if fit["fits"] else "does NOT fit (see the warnings)"))
    parts = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {t[k]:.3g} s"
                      for k in t if k.endswith("_s") and k != "step_s"
                      and not k.startswith("tokens_per") and isinstance(t[k], float) and t[k] >= 0.01 * t["step_s"])
    console.print(f"  step {t['step_s']:.3g} s ({parts}): {t['tokens_per_s_per_gpu']:,.0f} "
                  f"tokens/s per GPU, {t['tokens_per_s_per_job']:,.0f} tokens/s per job, MFU "
                  f"{t['mfu']:.1%}; limited by {t['limits']} (partrain's time model, the "
                  "search's own)")

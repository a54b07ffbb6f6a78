"""`partrain plan --search`'s result for people and programs: the table of the best layouts,
with the assumptions first and the batch limit named, and the same as JSON."""

from partrain.plan.costs import human_bytes
from partrain.plan.explain import assumptions_text, batch_exhausted, batch_limit, explain_text
from partrain.plan.search import MEMORY_MARGIN


def as_json(result: dict) -> dict:
    too_big = result["smallest_that_does_not_fit"]
    return {"assumptions": result.get("assumptions"), "gpus": result["gpus"],
            "hardware": result["hardware"], "candidates": result["candidates"],
            "fit": result["fit"], "seconds": round(result["seconds"], 3),
            "batch_limit": batch_limit(result), "explain": result["explain"],
            "best": [c.as_dict() | {"overrides": c.overrides()} for c in result["best"]],
            "refused": [{"describe": c.describe(), "reason": r} for c, r in result["refused"]],
            "smallest_that_does_not_fit": too_big and {
                "describe": too_big.describe(), "memory_bytes": too_big.memory_bytes,
                "memory_largest": too_big.memory_largest}}


def print_search(result: dict, console) -> None:
    from rich.table import Table

    hw = result["hardware"]
    if result.get("assumptions"):
        console.print(assumptions_text(result["assumptions"]))
    console.print(f"{result['candidates']:,} layouts of {result['gpus']} x {hw['name']} "
                  f"({hw['gpus_per_node']} per node, {hw['memory_gib']:g} GiB each); "
                  f"{result['fit']:,} fit in {MEMORY_MARGIN:.0%} of the memory "
                  f"({result['seconds']:.1f} s)")
    if not result["best"]:  # nothing fits: the error that follows says it (nothing_fits)
        if result["explain"]:
            console.print(explain_text(result["explain"]))
        return
    limit = batch_limit(result)
    if limit:
        console.print(limit)
    table = Table(title="best predicted layouts (partrain's memory and time models)")
    numbers = ("#", "memory/GPU", "tokens/s per GPU", "tokens/s per job", "MFU")
    for col in ("#", "layout", "memory/GPU", "largest part", "tokens/s per GPU",
                "tokens/s per job", "MFU", "limited by"):
        table.add_column(col, justify="right" if col in numbers else "left")
    for i, c in enumerate(result["best"], 1):
        limits = c.time["limits"]
        if batch_exhausted(c):
            limits = f"batch ({result['global_batch_size']:,} sequences), {limits}"
        table.add_row(str(i), c.describe(), human_bytes(c.memory_bytes),
                      c.memory_largest.removesuffix("_bytes").replace("_", " "),
                      f"{c.per_gpu():,.0f}", f"{c.time['tokens_per_s']:,.0f}",
                      f"{c.time['mfu']:.1%}", limits)
    console.print(table)
    if result["explain"]:
        console.print(explain_text(result["explain"]))
    for c, reason in result["refused"]:
        console.print(f"refused by validation: {c.describe()}: {reason}")


def nothing_fits(result: dict, written: str | None) -> str:
    """The refusal of a search whose layouts all exceed the memory (exit 2)."""
    hw, too_big = result["hardware"], result["smallest_that_does_not_fit"]
    smallest = (f": the smallest, {too_big.describe()}, needs {human_bytes(too_big.memory_bytes)} "
                f"per GPU (largest part: {too_big.memory_largest.removesuffix('_bytes').replace('_', ' ')})"
                if too_big is not None else "")
    return (f"no layout of --gpus {result['gpus']} fits in {MEMORY_MARGIN:.0%} of "
            f"{hw['name']}'s {hw['memory_gib']:g} GiB{smallest}; give more GPUs (--gpus), or a "
            "smaller model, train.seq_len or batch per GPU"
            + (f" (nothing written to {written})" if written is not None else ""))

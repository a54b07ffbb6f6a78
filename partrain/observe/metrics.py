"""What rank 0 reports: metrics.jsonl (one object per optimizer step, plus eval lines), the live
progress display on a terminal (plain lines otherwise), MFU on CUDA, and the final summary."""

import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from partrain.observe.console import PipeSafeConsole as Console
from partrain.observe.width import width_for

# Dense bf16 peak FLOP/s per GPU, by a substring of torch.cuda.get_device_name(), the first
# that matches (the PCIe and NVL cards run at lower clocks than the SXM ones, whose names
# carry no form factor: "NVIDIA H100 80GB HBM3").
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H200": 989e12,
                   "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def strict(record: dict) -> dict:
    """The record with each non-finite number (a skipped step's NaN loss or infinite gradient
    norm) as null: JSON has no NaN, and Python's `NaN` token broke jq and strict parsers. The
    step's `skipped` says why; the curves get the numbers as they were."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl and hands each record to the
    curves (TensorBoard, W&B: partrain.observe.curves); a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool, curves=None):
        self.file = path.open("a", buffering=1) if enabled else None
        self.curves = curves

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(strict(record), allow_nan=False) + "\n")
        if self.curves is not None:
            self.curves.write(record)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.curves is not None:
            self.curves.close()


def recorded_losses(run_dir: Path) -> Iterator[tuple[int, float]]:
    """(step, loss) of each training step that RUN_DIR/metrics.jsonl records, in its order (a
    restart may write a step again: the later line is the newer); eval and checkpoint lines, and
    a line cut short, are passed over. Nothing if the file cannot be read."""
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if (isinstance(record, dict) and isinstance(record.get("step"), int)
                        and "loss" in record and (record["loss"] is None or
                                                  isinstance(record["loss"], (int, float)))):
                    # null: not finite (strict() wrote it so)
                    loss = record["loss"]
                    yield record["step"], math.nan if loss is None else float(loss)
    except OSError:
        return


class ProgressDisplay:
    """Rank 0's view of the run: a live bar with step, loss, lr, tokens/s and ETA on a terminal,
    a plain line every `log_every` steps when stdout is a file or a pipe, with the ETA."""

    def __init__(self, max_steps: int, log_every: int, enabled: bool):
        self.enabled, self.log_every, self.max_steps = enabled, log_every, max_steps
        # Paths and names print as typed: no markup, no :emoji: codes. A step's line is one line
        # in a file or a pipe (soft_wrap), and the summary table is not fit to 80 columns there.
        self.console = Console(file=sys.stdout, markup=False, emoji=False, soft_wrap=True,
                               width=width_for(sys.stdout))
        self.live = enabled and self.console.is_terminal
        self.progress = None
        self._timed: list[tuple[int, float]] = []  # (step, when it was reported)

    def _start_live(self) -> None:
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("lr {task.fields[lr]}"),
                TextColumn("{task.fields[tps]} tok/s"), TextColumn("{task.fields[moe]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console)
            self.task = self.progress.add_task("train", total=self.max_steps, loss="-", lr="-",
                                               tps="-", moe="")
            self.progress.start()

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.live:
            self._start_live()
            self.progress.update(self.task, completed=rec["step"], loss=f"{rec['loss']:.4f}",
                                 lr=f"{rec['lr']:.2e}", tps=f"{rec['tokens_per_s']:,.0f}",
                                 moe=_moe_text(rec) if "moe_load_balance" in rec else "")
        self._timed.append((rec["step"], time.monotonic()))
        if rec.get("skipped"):  # always said, also between the live display's refreshes
            self.print(format_step(rec))
        elif not self.live and (rec["step"] % self.log_every == 0
                                or rec["step"] in (1, self.max_steps)):
            self.print(format_step(rec) + self._eta(rec["step"]))

    def _eta(self, step: int) -> str:
        """The time the steps left take at the pace since the first step of this launch (the
        first, which may compile or build ops, not counted)."""
        (first, t0), (last, t1) = self._timed[0], self._timed[-1]
        if last <= first or step >= self.max_steps:
            return ""
        left = (self.max_steps - step) * (t1 - t0) / (last - first)
        return f"  eta {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def format_step(rec: dict) -> str:
    text = (f"step {rec['step']:>6}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
            f"lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s  {rec['step_time_s'] * 1e3:.0f} ms")
    if "mfu" in rec:
        text += f"  mfu {rec['mfu']:.1%}"
    if "epoch" in rec:  # data.sampling=epochs or data.blend: one, or one per source
        epoch = rec["epoch"]
        text += (f"  epoch {epoch:.2f}" if not isinstance(epoch, list)
                 else "  epochs " + "/".join(f"{e:.2f}" for e in epoch))
    if "moe_load_balance" in rec:
        text += f"  {_moe_text(rec)}"
    if rec.get("skipped"):
        text += (f"  skipped (non-finite; {rec['skipped_in_a_row']} in a row"
                 + (f", first in {rec['nonfinite_param']}" if rec.get("nonfinite_param") else "")
                 + ")")
    return text


def _moe_text(rec: dict) -> str:
    """The router's state: max/mean tokens per expert (1.00 = perfectly balanced), the
    auxiliary loss (with balance=aux_loss) and the share of tokens dropped (with a capacity)."""
    text = f"load max/mean {rec['moe_load_balance']:.2f}"
    if "moe_aux_loss" in rec:
        text += f"  aux {rec['moe_aux_loss']:.4f}"
    if "moe_dropped" in rec:
        text += f"  dropped {rec['moe_dropped']:.1%}"
    return text


def summary_table(history: list[dict], val_losses: list[tuple[int, float]], wall_s: float,
                  run_dir: Path, checkpoint=None) -> Table:
    """The final summary: where the loss went, how fast, and where the results are."""
    table = Table(title="partrain: run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    first, last = history[0], history[-1]
    steady = history[1:] or history  # step 1 carries warm-up costs
    table.add_row("steps", f"{last['step']}")
    table.add_row("loss", f"{first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                          f"(step {last['step']})")
    if val_losses:
        table.add_row("val_loss", "  ".join(f"{v:.4f}@{s}" for s, v in val_losses))
    table.add_row("tokens", f"{last['tokens']:,}")
    # Over the steady steps' whole time (their tokens / their seconds), not a mean of per-step
    # rates, which a few slow steps pull the wrong way: up, past what the run delivered.
    seconds = sum(r["step_time_s"] for r in steady)
    over = (f"steps {steady[0]['step']}-{steady[-1]['step']}" if len(steady) > 1
            else f"step {steady[0]['step']}")
    tokens_per_s = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / seconds
    table.add_row("tokens/s", f"{tokens_per_s:,.0f} (over {over})")
    if "mfu" in last:
        mfu = sum(r["mfu"] * r["step_time_s"] for r in steady) / seconds
        table.add_row("MFU", f"{mfu:.1%} (over {over})")
    table.add_row("wall time", time.strftime("%H:%M:%S", time.gmtime(wall_s)))
    table.add_row("run dir", str(run_dir))
    if checkpoint is not None:
        table.add_row("checkpoint", f"{checkpoint.path} (step {checkpoint.step})")
    return table

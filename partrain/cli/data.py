"""`partrain data prepare`: tokenize text into a token dir. partrain.cli registers this group;
the work is partrain.data.prepare's."""

from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.consoles import err, out
from partrain.cli.parsers import number_flag, whole_flag
from partrain.data.format import SHARD_MB

data_app = typer.Typer(add_completion=False, help="Prepare training data.")


@data_app.command("prepare")
def data_prepare(
    inputs: List[Path] = typer.Argument(..., metavar="INPUTS...",
                                        help="Text, JSON Lines (.jsonl), Parquet and Arrow files, "
                                        "Hugging Face datasets saved with save_to_disk, or "
                                        "directories of them (recursively), in the given order"),
    out_dir: Path = typer.Option(..., "--out", help="New directory for the token dir: shard files "
                                 "train-00000.bin, ..., val-00000.bin, ..., their document indexes "
                                 "train.idx.npy and val.idx.npy, meta.json"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", metavar="PATH",
                                             help="A tokenizer.json (tokenizers library) or a "
                                             "directory holding one; default: a token per byte"),
    field: str = typer.Option("text", "--field", help="The field of each JSON Lines record or "
                              "Parquet or Arrow row that holds the document"),
    eot: Optional[str] = typer.Option(None, "--eot", metavar="TOKEN",
                                      help="The token after each document (default: the "
                                      "tokenizer's eos_token, or <|endoftext|> and kin)"),
    workers: Optional[int] = typer.Option(None, "--workers", metavar="N",
                                          parser=whole_flag("--workers"),
                                          help="Tokenizer processes (default: one per core; at "
                                          "most 4 per core)"),
    val_fraction: Optional[float] = typer.Option(None, "--val-fraction", metavar="F",
                                                 parser=number_flag("--val-fraction"),
                                                 help="Share of the tokens held out for "
                                                 "validation, in (0, 1) (default 0.05; not with "
                                                 "--val)"),
    val_inputs: Optional[List[Path]] = typer.Option(None, "--val", metavar="INPUT",
                                                    help="Make the val split of this input (a "
                                                    "file or directory, as INPUTS; repeat --val "
                                                    "for more) instead of a fraction of INPUTS"),
    shard_mb: int = typer.Option(SHARD_MB, "--shard-mb", metavar="MB", parser=whole_flag("--shard-mb"),
                                 help="MiB of token ids per shard file at most"),
) -> None:
    """Tokenize text into a token dir for data=tokens data.path=DIR."""
    import time

    from partrain.data.prepare import default_workers, prepare_token_dir, summary

    workers = workers or default_workers()
    start = time.perf_counter()
    meta = prepare_token_dir(inputs, out_dir, val_fraction, tokenizer, field, eot, workers, err,
                             val_inputs=list(val_inputs or []) or None, shard_bytes=shard_mb << 20)
    for line in summary(meta, out_dir, time.perf_counter() - start, workers):
        out.print(line)

"""Benchmark: `partrain plan`'s time model (partrain/plan/time_model.py) against published throughput.

The table: Megatron-LM's weak-scaling runs of GPT models from 1.7B to 1T parameters on up to 3072
A100-80GB GPUs (Narayanan et al., SC'21, Table 1; the Megatron-LM README's 2021 table): sequence
2048, vocabulary 51,200, mixed precision, activation recomputation on, tp x pp x dp as listed,
the micro-batch sizes of that run. Its TFLOP/s per GPU count the paper's Eq. 3,

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))   FLOPs per step,

which includes the recomputed forward. Each row is fed to the time model as partrain would run it
(a Llama-shaped block of the same size: SwiGLU with ffn = 8h/3, so the same parameters and FLOPs
as GPT's 4h GELU MLP; tied embeddings as GPT's; full activation checkpointing; DDP with fp32
gradients, as Megatron 2021), on the A100-80GB preset; the prediction is F / predicted step time
/ GPUs, against the table's figure (goal: within 20%).

The 2024 H100 table of the README (GPT 2B to 462B on up to 6144 H100s) is published only as an
image; its numbers are not in this row list.

    python scripts/bench_time_model.py           # a table
    python scripts/bench_time_model.py --json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partrain.plan.hardware import PRESETS  # noqa: E402
from partrain.plan.time_model import Implementation, Layout, step_time  # noqa: E402

# Megatron-LM as of those runs: the data-parallel all-reduce after the backward (no overlap),
# fp16 pipeline sends, each tp rank sending 1/tp of them (its scatter/gather optimization).
MEGATRON_2021 = Implementation(dp_overlap=False, send_bytes=2, send_split_tp=True)

SEQ, VOCAB = 2048, 51200
# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, micro-batch, global batch,
#  TFLOP/s per GPU in the table)
MEGATRON_A100_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 16, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 16, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 16, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 8, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 4, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 2, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 1, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 1, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 1, 3072, 163),
]


def gpt_as_llama(heads: int, hidden: int, layers: int, tp: int):
    """A partrain model config of a GPT row's size (see the module docstring)."""
    from omegaconf import OmegaConf

    from partrain.config.schema import ModelConfig

    ffn = round(8 * hidden / 3 / (64 * tp)) * 64 * tp  # divisible by tp, as partrain requires
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "name": f"gpt-{hidden}x{layers}", "n_layers": layers, "n_heads": heads,
        "n_kv_heads": heads, "dim": hidden, "ffn_dim": ffn, "vocab_size": VOCAB,
        "max_seq_len": SEQ, "tie_embeddings": True}))


def megatron_flops(batch: int, hidden: int, layers: int) -> float:
    return 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden)
                                                      + VOCAB / (16 * layers * hidden))


def rows() -> list[dict]:
    hw = PRESETS["A100-80GB"]
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, mb, gbs, table in MEGATRON_A100_2021:
        dp = gpus // (tp * pp)
        layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=mb, activation_checkpointing="full")
        model = gpt_as_llama(heads, hidden, layers, tp)
        t = step_time(model, layout, gbs, SEQ, hw, impl=MEGATRON_2021)
        predicted = megatron_flops(gbs, hidden, layers) / t["step_s"] / gpus / 1e12
        out.append({"params_b": size, "tp": tp, "pp": pp, "dp": dp, "gpus": gpus,
                    "micro_batch": mb, "global_batch": gbs, "table_tflops": table,
                    "predicted_tflops": predicted, "ratio": predicted / table,
                    "step_s": t["step_s"], "limits": t["limits"],
                    "parts": {k: t[k] for k in t if k.endswith("_s") and k != "step_s"}})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = rows()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{'params':>8} {'tp':>3} {'pp':>3} {'dp':>3} {'GPUs':>5} {'mb':>3} {'batch':>6} "
          f"{'table':>6} {'model':>6} {'ratio':>6}  limited by")
    for r in result:
        print(f"{r['params_b']:>7}B {r['tp']:>3} {r['pp']:>3} {r['dp']:>3} {r['gpus']:>5} "
              f"{r['micro_batch']:>3} {r['global_batch']:>6} {r['table_tflops']:>6} "
              f"{r['predicted_tflops']:>6.1f} {r['ratio']:>6.3f}  {r['limits']}")
    worst = max(result, key=lambda r: abs(r["ratio"] - 1))
    print(f"worst: {worst['params_b']}B at {worst['ratio']:.3f} (TFLOP/s per GPU, model / table)")


if __name__ == "__main__":
    main()

"""Published training throughput that partrain's layouts can express, row by row with its source,
for scripts/bench_time_model.py. Each row: where it comes from, whether the time model's
constants were fitted on it ("fit") or it is held out ("held-out"), the model's shape, the
layout, the batch, the hardware and the published figure with its unit.

Fit rows (chosen before any tuning): Megatron-LM's 2021 A100 table and the Llama 3 paper's
Table 4 (H100). Every other row is held out: the model's constants never saw them.
Rows left out, and why: Float8 runs (torchtitan's 405B tables, NeMo's H100 Llama rows: partrain
computes in bf16), MegaScale's tables (parallel blocks and sliding-window attention, and its
tables were not found in text), Megatron-LM's 2024 H100 table (published as an image).
"""

# Model shapes: (layers, hidden, heads, kv heads, ffn, vocabulary, tied).
LLAMA3_8B = (32, 4096, 32, 8, 14336, 128256, False)
LLAMA3_70B = (80, 8192, 64, 8, 28672, 128256, False)
LLAMA3_405B = (126, 16384, 128, 8, 53248, 128256, False)
LLAMA2_13B = (40, 5120, 40, 40, 13824, 32000, False)
LLAMA2_70B = (80, 8192, 64, 8, 28672, 32000, False)


def gpt(heads: int, hidden: int, layers: int) -> tuple:
    """A GPT row as partrain runs it: a Llama block of the same size (SwiGLU with ffn = 8h/3 has
    GPT's 4h GELU MLP's parameters and FLOPs), tied embeddings, vocabulary 51,200."""
    return (layers, hidden, heads, heads, round(8 * hidden / 3 / 512) * 512, 51200, True)


MEGATRON_2021 = "Narayanan et al., SC'21 (arXiv 2104.04473), Table 1; Megatron-LM README 2021 table"
MEGATRON_2022 = ("Korthikanti et al. 2022 (arXiv 2205.05198): MFU in the Megatron-LM README's "
                 "2022 table, layouts from the paper's Table 3 (dp=1)")
LLAMA3_T4 = "Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
TITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TITAN_A100 = "pytorch/torchtitan docs/performance.md (2024, 64 A100s, FSDP2)"

_MEGATRON_2021 = [  # params, heads, hidden, layers, tp, pp, GPUs, micro-batch, batch, TFLOP/s
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
_MEGATRON_2022 = [  # params, heads, hidden, layers, tp, pp, GPUs, batch, MFU
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 0.415),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 0.514),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 0.560),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 0.563),
]


def rows() -> list[dict]:
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, mb, gbs, tflops in _MEGATRON_2021:
        out.append({
            "name": f"GPT {size}B", "source": MEGATRON_2021, "split": "fit", "impl": "megatron_2021",
            "shape": gpt(heads, hidden, layers), "hardware": "A100-80GB", "seq": 2048, "batch": gbs,
            "layout": {"dp": gpus // (tp * pp), "tp": tp, "pp": pp, "micro_batch_size": mb,
                        "activation_checkpointing": "full"},
            "published": tflops, "unit": "TFLOP/s/GPU", "flops": "megatron_2021"})
    for size, heads, hidden, layers, tp, pp, gpus, gbs, mfu in _MEGATRON_2022:
        out.append({
            "name": f"GPT {size}", "source": MEGATRON_2022, "split": "held-out", "impl": "megatron_2022",
            "shape": gpt(heads, hidden, layers), "hardware": "A100-80GB", "seq": 2048, "batch": gbs,
            "layout": {"dp": gpus // (tp * pp), "tp": tp, "pp": pp, "micro_batch_size": 1,
                        "sequence_parallel": True, "activation_checkpointing": "selective"},
            "published": mfu, "unit": "MFU", "flops": "megatron_2022"})
    # Llama 3 405B pre-training: bf16, sequence parallel; the interleaved schedule's chunks per
    # rank are not in the table: 4 assumed (2 of the ~8 layers a stage holds per chunk).
    for gpus, cp, dp, seq, per_dp, tflops in ((8192, 1, 64, 8192, 32, 430),
                                              (16384, 1, 128, 8192, 16, 400),
                                              (16384, 16, 8, 131072, 16, 380)):
        out.append({
            "name": f"Llama 3 405B, {gpus} GPUs{', cp16' if cp > 1 else ''}", "source": LLAMA3_T4,
            "split": "fit", "impl": "llama3", "shape": LLAMA3_405B, "hardware": "H100-SXM", "seq": seq,
            "batch": dp * per_dp,
            "layout": {"dp": dp, "tp": 8, "pp": 16, "cp": cp, "micro_batch_size": 1, "zero_stage": 1,
                        "sequence_parallel": True, "pp_schedule": "interleaved_1f1b",
                        "pp_virtual_stages": 4},
            "published": tflops, "unit": "TFLOP/s/GPU", "flops": "6N+attention"})
    # torchtitan, H100 (500 W power limit: peak between SXM and NVL, its footnote), bf16,
    # torch.compile, seq 8192; FSDP2 = ZeRO-3 with prefetch; one micro-batch per step.
    for name, shape, gpus, dp, tp, local, ckpt, tps, src in (
            ("Llama 3.1 8B FSDP8, compiled", LLAMA3_8B, 8, 8, 1, 2, "selective", 6667,
             TITAN_H100 + ", Table 1"),
            ("Llama 3.1 8B FSDP128, compiled", LLAMA3_8B, 128, 128, 1, 2, "selective", 6514,
             TITAN_H100 + ", Table 3"),
            ("Llama 3 8B FSDP8 x TP8, vanilla TP", LLAMA3_8B, 64, 8, 8, 12, "selective", 4378,
             TITAN_ASYNC),
            ("Llama 3 70B FSDP32 x TP8, vanilla TP", LLAMA3_70B, 256, 32, 8, 16, "full", 597.3,
             TITAN_ASYNC)):
        out.append({
            "name": name, "source": src, "split": "held-out", "impl": "torchtitan", "shape": shape,
            "hardware": "H100-500W", "seq": 8192, "batch": dp * local,
            "layout": {"dp": dp, "tp": tp, "zero_stage": 3, "micro_batch_size": local,
                        "sequence_parallel": tp > 1, "activation_checkpointing": ckpt},
            "published": tps, "unit": "tokens/s/GPU", "flops": None})
    # torchtitan on 64 A100s, FSDP2, local batch as listed, eager (2024).
    for name, shape, seq, local, ckpt, tps in (
            ("Llama 3 8B, selective op", LLAMA3_8B, 8192, 1, "selective", 2973),
            ("Llama 3 70B, full", LLAMA3_70B, 8192, 1, "full", 331),
            ("Llama 2 13B, none", LLAMA2_13B, 4096, 2, "none", 2162),
            ("Llama 2 13B, selective op", LLAMA2_13B, 4096, 2, "selective", 1904),
            ("Llama 2 70B, full", LLAMA2_70B, 4096, 2, "full", 353)):
        out.append({
            "name": name + " (64 A100)", "source": TITAN_A100, "split": "held-out", "impl": "torchtitan",
            "shape": shape, "hardware": "A100-80GB", "seq": seq, "batch": 64 * local,
            "layout": {"dp": 64, "zero_stage": 3, "micro_batch_size": local,
                        "activation_checkpointing": ckpt},
            "published": tps, "unit": "tokens/s/GPU", "flops": None})
    return out

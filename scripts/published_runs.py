"""Published training throughput that partrain's layouts can express, row by row with its source,
for scripts/bench_time_model.py. Each row: where it comes from, whether the time model's
constants were fitted on it ("fit") or it is held out ("held-out"), the model's shape, the
layout, the batch, the hardware and the published figure with its unit.

Fit rows: Megatron-LM's 2021 A100 table and the Llama 3 paper's Table 4 (H100), on which the
presets' GEMM efficiency is fitted (chosen before any tuning); and for each other trainer whose
kernels get their own constants (Implementation.gemm_scale, attention_peak_fraction in
scripts/bench_time_model.py), a few rows of its own tables, chosen by a rule, not by their ratio:
of each MPT table, the smallest model at 2,048 tokens and the 1B model at its shortest and longest
sequence, on 8 GPUs (the July 2023 version of MPT's A100 table is held out whole); of
torchtitan's H100 runs, its first (8B, FSDP on 8 GPUs). Every other row is held out: the
model's constants never saw them.
Rows left out, and why: Float8 runs (torchtitan's 405B tables, NeMo's H100 Llama rows, MPT's
H100 FP8 table: partrain computes in bf16), MegaScale's tables (parallel blocks and sliding-window
attention, and its tables were not found in text), Megatron-LM's 2024 H100 table (published as an
image), torchtitan's "selective layer" A100 row (every other block recomputed: not a layout
partrain expresses), MPT's A100 40GB table (no A100-40GB preset: its HBM is 1,555 GB/s, not the
80 GB part's 2,039).
"""

# Model shapes: (layers, hidden, heads, kv heads, ffn, vocabulary, tied).
LLAMA3_8B = (32, 4096, 32, 8, 14336, 128256, False)
LLAMA3_70B = (80, 8192, 64, 8, 28672, 128256, False)
LLAMA3_405B = (126, 16384, 128, 8, 53248, 128256, False)
LLAMA2_13B = (40, 5120, 40, 40, 13824, 32000, False)
LLAMA2_70B = (80, 8192, 64, 8, 28672, 32000, False)


def gpt(heads: int, hidden: int, layers: int, vocab: int = 51200) -> tuple:
    """A GPT row as partrain runs it: a Llama block of the same size (SwiGLU with ffn = 8h/3 has
    GPT's 4h GELU MLP's parameters and FLOPs), tied embeddings, vocabulary 51,200 (Megatron's)."""
    return (layers, hidden, heads, heads, round(8 * hidden / 3 / 512) * 512, vocab, True)


# MPT (mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): heads, hidden, layers; a
# GPT block (4h GELU MLP, no biases), tied embeddings, vocabulary 50,368.
MPT = {"125m": (12, 768, 12), "350m": (16, 1024, 24), "760m": (12, 1536, 24),
       "1b": (16, 2048, 24), "3b": (20, 2560, 32), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
       "30b": (56, 7168, 48), "70b": (64, 8192, 80)}


MEGATRON_2021 = "Narayanan et al., SC'21 (arXiv 2104.04473), Table 1; Megatron-LM README 2021 table"
MEGATRON_2022 = ("Korthikanti et al. 2022 (arXiv 2205.05198): MFU in the Megatron-LM README's "
                 "2022 table, layouts from the paper's Table 3 (dp=1)")
LLAMA3_T4 = "Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
TITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_H100_FIT = "Llama 3.1 8B FSDP8, compiled"
TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TITAN_A100 = "pytorch/torchtitan docs/performance.md (2024, 64 A100s, FSDP2)"
TITAN_405B = ("pytorch/torchtitan docs/performance.md as of August 2024 (commit b5642d6a2), "
              "'Llama 3.1 performance numbers': 405B on 128 H100s, no optimizations")
MPT_H100 = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit c90b9b312), "
            "tables 'H100 80GB BF16 (Large Scale, >= 128 GPUs)' and 'H100 80GB BF16'")
MPT_A100 = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit c90b9b312), "
            "table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'")

MPT_A100_2023 = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit c6cfb4284, "
                 "July 2023: the same table before its re-measurement), table 'A100 80GB with "
                 "1600 Gbps node-node interconnect (RoCE)', bf16 PURE")

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


# MPT's training benchmarks, every bf16 row of its H100 and A100-80GB tables as printed (Composer's
# FSDP: FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2; activation checkpointing = whole blocks):
# model, seq, GPUs, micro-batch, micro-batches per step, tokens/s/GPU, ZeRO stage, checkpointing,
# FSDP mixed precision (DEFAULT: bf16 weights, fp32 gradient reduction; PURE: bf16 both).
_MPT_H100 = [
    ("70b", 2048, 512, 8, 1, 1007, 3, True, "DEFAULT"),
    ("70b", 2048, 256, 8, 1, 1035, 3, True, "DEFAULT"),
    ("70b", 2048, 128, 8, 1, 1058, 3, True, "DEFAULT"),
    ("30b", 2048, 512, 8, 1, 2115, 3, True, "DEFAULT"),
    ("30b", 2048, 256, 8, 1, 2148, 3, True, "DEFAULT"),
    ("30b", 2048, 128, 8, 1, 2199, 3, True, "DEFAULT"),
    ("13b", 2048, 512, 16, 1, 4952, 3, True, "DEFAULT"),
    ("13b", 2048, 256, 16, 1, 4989, 3, True, "DEFAULT"),
    ("13b", 2048, 128, 16, 1, 5080, 3, True, "DEFAULT"),
    ("7b", 2048, 512, 6, 1, 9670, 3, False, "DEFAULT"),
    ("7b", 2048, 256, 6, 1, 10119, 3, False, "DEFAULT"),
    ("7b", 2048, 128, 6, 1, 10475, 3, False, "DEFAULT"),
    ("3b", 2048, 512, 8, 1, 21664, 2, False, "DEFAULT"),
    ("3b", 2048, 256, 8, 1, 22772, 2, False, "DEFAULT"),
    ("3b", 2048, 128, 8, 1, 23422, 2, False, "DEFAULT"),
    ("1b", 2048, 512, 12, 1, 39837, 2, False, "DEFAULT"),
    ("1b", 2048, 256, 12, 1, 42555, 2, False, "DEFAULT"),
    ("1b", 2048, 128, 12, 1, 44123, 2, False, "DEFAULT"),
    ("70b", 2048, 64, 8, 4, 1039, 3, True, "DEFAULT"),
    ("70b", 2048, 32, 2, 16, 882, 3, True, "DEFAULT"),
    ("30b", 8192, 8, 1, 21, 1384, 3, True, "DEFAULT"),
    ("30b", 4096, 8, 1, 21, 1802, 3, True, "DEFAULT"),
    ("30b", 2048, 32, 14, 3, 2308, 3, True, "DEFAULT"),
    ("30b", 2048, 16, 10, 3, 2263, 3, True, "DEFAULT"),
    ("30b", 2048, 8, 3, 21, 2002, 3, True, "DEFAULT"),
    ("30b", 1024, 8, 6, 21, 2084, 3, True, "DEFAULT"),
    ("13b", 32768, 8, 1, 3, 1976, 3, True, "DEFAULT"),
    ("13b", 16384, 8, 3, 3, 2985, 3, True, "DEFAULT"),
    ("13b", 4096, 8, 10, 3, 4717, 3, True, "DEFAULT"),
    ("13b", 2048, 64, 2, 1, 4800, 3, False, "DEFAULT"),
    ("13b", 2048, 32, 2, 1, 4811, 3, False, "DEFAULT"),
    ("13b", 2048, 16, 2, 1, 4767, 3, False, "DEFAULT"),
    ("13b", 2048, 8, 2, 1, 4792, 3, False, "DEFAULT"),
    ("13b", 1024, 8, 40, 3, 5502, 3, True, "DEFAULT"),
    ("7b", 65536, 8, 1, 2, 1956, 3, True, "DEFAULT"),
    ("7b", 32768, 8, 2, 2, 3318, 3, True, "DEFAULT"),
    ("7b", 8192, 8, 8, 2, 6935, 3, True, "DEFAULT"),
    ("7b", 4096, 8, 16, 2, 8611, 3, True, "DEFAULT"),
    ("7b", 2048, 8, 6, 1, 10643, 3, False, "DEFAULT"),
    ("7b", 1024, 8, 64, 2, 10203, 3, True, "DEFAULT"),
    ("3b", 65536, 8, 1, 2, 3262, 3, True, "DEFAULT"),
    ("3b", 32768, 8, 3, 6, 5873, 3, True, "DEFAULT"),
    ("3b", 16384, 8, 1, 6, 11152, 3, False, "DEFAULT"),
    ("3b", 8192, 8, 3, 6, 16578, 3, False, "DEFAULT"),
    ("3b", 4096, 8, 5, 6, 20964, 3, False, "DEFAULT"),
    ("3b", 2048, 64, 6, 3, 22525, 3, False, "DEFAULT"),
    ("3b", 2048, 32, 6, 3, 23021, 3, False, "DEFAULT"),
    ("3b", 2048, 16, 10, 3, 24142, 3, False, "DEFAULT"),
    ("3b", 1024, 8, 20, 6, 27046, 3, False, "DEFAULT"),
    ("3b", 512, 8, 40, 6, 27965, 3, False, "DEFAULT"),
    ("1b", 65536, 8, 1, 2, 5506, 3, True, "DEFAULT"),
    ("1b", 32768, 8, 1, 4, 12025, 3, False, "DEFAULT"),
    ("1b", 16384, 8, 2, 4, 19649, 3, False, "DEFAULT"),
    ("1b", 8192, 8, 3, 4, 29157, 3, False, "DEFAULT"),
    ("1b", 4096, 8, 7, 4, 38535, 3, False, "DEFAULT"),
    ("1b", 2048, 64, 20, 1, 44402, 3, False, "DEFAULT"),
    ("1b", 2048, 32, 20, 1, 45130, 3, False, "DEFAULT"),
    ("1b", 2048, 16, 20, 1, 46037, 3, False, "DEFAULT"),
    ("1b", 2048, 8, 14, 1, 45455, 3, False, "DEFAULT"),
    ("1b", 1024, 8, 18, 4, 48910, 3, False, "DEFAULT"),
    ("1b", 512, 8, 56, 4, 52275, 3, False, "DEFAULT"),
    ("760m", 32768, 8, 1, 2, 16291, 3, False, "DEFAULT"),
    ("760m", 16384, 8, 3, 2, 27815, 3, False, "DEFAULT"),
    ("760m", 8192, 8, 6, 2, 41825, 3, False, "DEFAULT"),
    ("760m", 4096, 8, 12, 2, 55459, 3, False, "DEFAULT"),
    ("760m", 2048, 32, 24, 1, 67971, 3, False, "DEFAULT"),
    ("760m", 2048, 16, 24, 1, 68551, 3, False, "DEFAULT"),
    ("760m", 2048, 8, 24, 2, 63147, 3, False, "DEFAULT"),
    ("760m", 1024, 8, 48, 2, 78581, 3, False, "DEFAULT"),
    ("760m", 512, 8, 96, 2, 83749, 3, False, "DEFAULT"),
]
_MPT_A100 = [
    ("70b", 2048, 64, 8, 4, 410, 3, True, "PURE"),
    ("70b", 2048, 32, 2, 16, 373, 3, True, "PURE"),
    ("30b", 8192, 8, 1, 21, 574, 3, True, "DEFAULT"),
    ("30b", 4096, 8, 1, 21, 814, 3, True, "DEFAULT"),
    ("30b", 2048, 8, 3, 21, 916, 3, True, "DEFAULT"),
    ("30b", 1024, 8, 6, 21, 946, 3, True, "DEFAULT"),
    ("30b", 512, 8, 12, 21, 967, 3, True, "DEFAULT"),
    ("13b", 32768, 8, 1, 3, 1016, 3, True, "DEFAULT"),
    ("13b", 16384, 8, 3, 3, 1431, 3, True, "DEFAULT"),
    ("13b", 8192, 8, 5, 3, 1795, 3, True, "DEFAULT"),
    ("13b", 4096, 8, 10, 3, 2060, 3, True, "DEFAULT"),
    ("13b", 2048, 8, 2, 3, 2262, 3, False, "DEFAULT"),
    ("13b", 1024, 8, 40, 3, 2330, 3, True, "DEFAULT"),
    ("7b", 65536, 8, 1, 2, 1013, 3, True, "DEFAULT"),
    ("7b", 32768, 8, 2, 2, 1672, 3, True, "DEFAULT"),
    ("7b", 16384, 8, 4, 2, 2453, 3, True, "DEFAULT"),
    ("7b", 8192, 8, 8, 2, 3206, 3, True, "DEFAULT"),
    ("7b", 4096, 8, 16, 2, 3684, 3, True, "DEFAULT"),
    ("7b", 2048, 8, 6, 2, 4641, 3, False, "DEFAULT"),
    ("7b", 1024, 8, 64, 2, 4357, 3, True, "DEFAULT"),
    ("3b", 65536, 8, 1, 2, 1767, 3, True, "DEFAULT"),
    ("3b", 32768, 8, 3, 6, 3029, 3, True, "DEFAULT"),
    ("3b", 16384, 8, 1, 6, 5529, 3, False, "DEFAULT"),
    ("3b", 8192, 8, 3, 6, 7695, 3, False, "DEFAULT"),
    ("3b", 4096, 8, 5, 6, 9457, 3, False, "DEFAULT"),
    ("3b", 2048, 8, 10, 2, 10811, 3, False, "DEFAULT"),
    ("3b", 1024, 8, 20, 6, 11580, 3, False, "DEFAULT"),
    ("3b", 512, 8, 40, 6, 12127, 3, False, "DEFAULT"),
    ("1b", 65536, 8, 1, 2, 3044, 3, True, "DEFAULT"),
    ("1b", 32768, 8, 1, 4, 6275, 3, False, "DEFAULT"),
    ("1b", 16384, 8, 2, 4, 9956, 3, False, "DEFAULT"),
    ("1b", 8192, 8, 3, 4, 13814, 3, False, "DEFAULT"),
    ("1b", 4096, 8, 7, 4, 17807, 3, False, "DEFAULT"),
    ("1b", 2048, 8, 14, 4, 20513, 3, False, "DEFAULT"),
    ("1b", 1024, 8, 18, 4, 22112, 3, False, "DEFAULT"),
    ("1b", 512, 8, 56, 4, 23148, 3, False, "DEFAULT"),
    ("760m", 65536, 8, 1, 2, 4143, 3, True, "DEFAULT"),
    ("760m", 32768, 8, 1, 2, 8802, 3, False, "DEFAULT"),
    ("760m", 16384, 8, 3, 2, 14274, 3, False, "DEFAULT"),
    ("760m", 8192, 8, 6, 2, 20933, 3, False, "DEFAULT"),
    ("760m", 4096, 8, 12, 2, 27351, 3, False, "DEFAULT"),
    ("760m", 2048, 8, 24, 2, 32434, 3, False, "DEFAULT"),
    ("760m", 1024, 8, 48, 2, 29765, 3, False, "DEFAULT"),
    ("760m", 512, 8, 96, 2, 29446, 3, False, "DEFAULT"),
    ("350m", 65536, 8, 1, 2, 7524, 3, False, "DEFAULT"),
    ("350m", 32768, 8, 2, 2, 13652, 3, False, "DEFAULT"),
    ("350m", 16384, 8, 4, 2, 23559, 3, False, "DEFAULT"),
    ("350m", 8192, 8, 8, 2, 36569, 3, False, "DEFAULT"),
    ("350m", 4096, 8, 16, 2, 49555, 3, False, "DEFAULT"),
    ("350m", 2048, 8, 32, 2, 58782, 3, False, "DEFAULT"),
    ("350m", 1024, 8, 64, 2, 64813, 3, False, "DEFAULT"),
    ("350m", 512, 8, 128, 2, 69330, 3, False, "DEFAULT"),
    ("125m", 65536, 8, 1, 2, 20368, 3, False, "DEFAULT"),
    ("125m", 32768, 8, 2, 2, 36407, 3, False, "DEFAULT"),
    ("125m", 16384, 8, 4, 2, 60040, 3, False, "DEFAULT"),
    ("125m", 8192, 8, 8, 2, 90392, 3, False, "DEFAULT"),
    ("125m", 4096, 8, 16, 2, 118396, 3, False, "DEFAULT"),
    ("125m", 2048, 8, 40, 2, 142830, 3, False, "DEFAULT"),
    ("125m", 2048, 8, 32, 2, 141737, 3, False, "DEFAULT"),
    ("125m", 1024, 8, 64, 2, 156468, 3, False, "DEFAULT"),
    ("125m", 512, 8, 128, 2, 165681, 3, False, "DEFAULT"),
]

# The A100 80GB table as llm-foundry published it from May to July 2023 (commit c6cfb4284, bf16
# PURE throughout), before the re-measurement above replaced it: held out whole (the A100 constants
# are fitted on the newer table's rows); rows the newer table repeats unchanged, and its rows at
# the newer table's fit layouts, are left out (rows()).
_MPT_A100_2023 = [
    ("70b", 2048, 64, 8, 4, 410, 3, True, "PURE"),
    ("70b", 2048, 32, 2, 16, 373, 3, True, "PURE"),
    ("30b", 8192, 8, 1, 21, 622, 3, True, "PURE"),
    ("30b", 4096, 8, 1, 21, 778, 3, True, "PURE"),
    ("30b", 2048, 64, 16, 3, 876, 3, True, "PURE"),
    ("30b", 2048, 32, 14, 3, 886, 3, True, "PURE"),
    ("30b", 2048, 16, 10, 3, 884, 3, True, "PURE"),
    ("30b", 2048, 8, 3, 21, 788, 3, True, "PURE"),
    ("30b", 1024, 8, 6, 21, 876, 3, True, "PURE"),
    ("30b", 512, 8, 12, 21, 844, 3, True, "PURE"),
    ("13b", 32768, 8, 1, 3, 974, 3, True, "PURE"),
    ("13b", 16384, 8, 3, 3, 1369, 3, True, "PURE"),
    ("13b", 8192, 8, 5, 3, 1691, 3, True, "PURE"),
    ("13b", 4096, 8, 10, 3, 1917, 3, True, "PURE"),
    ("13b", 2048, 64, 32, 1, 1994, 3, True, "PURE"),
    ("13b", 2048, 32, 32, 1, 2007, 3, True, "PURE"),
    ("13b", 2048, 16, 24, 1, 2018, 3, True, "PURE"),
    ("13b", 2048, 8, 20, 3, 2065, 3, True, "PURE"),
    ("13b", 1024, 8, 40, 3, 2164, 3, True, "PURE"),
    ("13b", 512, 8, 80, 3, 2190, 3, True, "PURE"),
    ("7b", 65536, 8, 1, 2, 919, 3, True, "PURE"),
    ("7b", 32768, 8, 2, 2, 1629, 3, True, "PURE"),
    ("7b", 16384, 8, 4, 2, 2337, 3, True, "PURE"),
    ("7b", 8192, 8, 8, 2, 2985, 3, True, "PURE"),
    ("7b", 4096, 8, 16, 2, 3496, 3, True, "PURE"),
    ("7b", 2048, 64, 32, 1, 3670, 3, True, "PURE"),
    ("7b", 2048, 32, 32, 1, 3697, 3, True, "PURE"),
    ("7b", 2048, 16, 32, 1, 3728, 3, True, "PURE"),
    ("7b", 2048, 8, 32, 2, 3824, 3, True, "PURE"),
    ("7b", 1024, 8, 64, 2, 4030, 3, True, "PURE"),
    ("7b", 512, 8, 128, 2, 4099, 3, True, "PURE"),
    ("3b", 65536, 8, 1, 2, 1771, 3, True, "PURE"),
    ("3b", 32768, 8, 3, 6, 3000, 3, True, "PURE"),
    ("3b", 16384, 8, 1, 6, 5544, 3, False, "PURE"),
    ("3b", 8192, 8, 3, 6, 7610, 3, False, "PURE"),
    ("3b", 4096, 8, 5, 6, 9298, 3, False, "PURE"),
    ("3b", 2048, 64, 12, 3, 10158, 3, False, "PURE"),
    ("3b", 2048, 32, 12, 3, 10308, 3, False, "PURE"),
    ("3b", 2048, 16, 10, 3, 10283, 3, False, "PURE"),
    ("3b", 2048, 8, 10, 6, 10403, 3, False, "PURE"),
    ("3b", 1024, 8, 20, 6, 11363, 3, False, "PURE"),
    ("3b", 512, 8, 40, 6, 11819, 3, False, "PURE"),
    ("1b", 65536, 8, 1, 2, 2985, 3, True, "PURE"),
    ("1b", 32768, 8, 1, 4, 6332, 3, False, "PURE"),
    ("1b", 16384, 8, 2, 4, 9823, 3, False, "PURE"),
    ("1b", 8192, 8, 3, 4, 13739, 3, False, "PURE"),
    ("1b", 4096, 8, 7, 4, 17595, 3, False, "PURE"),
    ("1b", 2048, 64, 20, 1, 19423, 3, False, "PURE"),
    ("1b", 2048, 32, 20, 1, 19446, 3, False, "PURE"),
    ("1b", 2048, 16, 20, 1, 19694, 3, False, "PURE"),
    ("1b", 2048, 8, 14, 4, 20276, 3, False, "PURE"),
    ("1b", 1024, 8, 18, 4, 21682, 3, False, "PURE"),
    ("1b", 512, 8, 56, 4, 23033, 3, False, "PURE"),
    ("760m", 65536, 8, 1, 2, 4156, 3, True, "PURE"),
    ("760m", 32768, 8, 1, 2, 8788, 3, False, "PURE"),
    ("760m", 16384, 8, 3, 2, 14422, 3, False, "PURE"),
    ("760m", 8192, 8, 6, 2, 20866, 3, False, "PURE"),
    ("760m", 4096, 8, 12, 2, 26937, 3, False, "PURE"),
    ("760m", 2048, 64, 24, 1, 29565, 3, False, "PURE"),
    ("760m", 2048, 32, 24, 1, 30390, 3, False, "PURE"),
    ("760m", 2048, 16, 24, 1, 30554, 3, False, "PURE"),
    ("760m", 2048, 8, 24, 2, 31763, 3, False, "PURE"),
    ("760m", 1024, 8, 48, 2, 34888, 3, False, "PURE"),
    ("760m", 512, 8, 96, 2, 36719, 3, False, "PURE"),
    ("350m", 65536, 8, 1, 2, 7479, 3, False, "PURE"),
    ("350m", 32768, 8, 2, 2, 12349, 3, False, "PURE"),
    ("350m", 16384, 8, 4, 2, 23441, 3, False, "PURE"),
    ("350m", 8192, 8, 8, 2, 36174, 3, False, "PURE"),
    ("350m", 4096, 8, 16, 2, 48766, 3, False, "PURE"),
    ("350m", 2048, 64, 32, 1, 54384, 3, False, "PURE"),
    ("350m", 2048, 32, 32, 1, 55321, 3, False, "PURE"),
    ("350m", 2048, 16, 32, 1, 57537, 3, False, "PURE"),
    ("350m", 2048, 8, 32, 2, 58911, 3, False, "PURE"),
    ("350m", 1024, 8, 64, 2, 65799, 3, False, "PURE"),
    ("350m", 512, 8, 128, 2, 70107, 3, False, "PURE"),
    ("125m", 65536, 8, 1, 2, 20434, 3, False, "PURE"),
    ("125m", 32768, 8, 2, 2, 36710, 3, False, "PURE"),
    ("125m", 16384, 8, 4, 2, 61197, 3, False, "PURE"),
    ("125m", 8192, 8, 8, 2, 90998, 3, False, "PURE"),
    ("125m", 4096, 8, 16, 2, 119792, 3, False, "PURE"),
    ("125m", 2048, 64, 32, 1, 130026, 3, False, "PURE"),
    ("125m", 2048, 32, 32, 1, 131438, 3, False, "PURE"),
    ("125m", 2048, 16, 32, 1, 133689, 3, False, "PURE"),
    ("125m", 2048, 8, 32, 2, 140438, 3, False, "PURE"),
    ("125m", 1024, 8, 64, 2, 156820, 3, False, "PURE"),
    ("125m", 512, 8, 128, 2, 165628, 3, False, "PURE"),
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
            "name": name, "source": src, "split": "fit" if name == TITAN_H100_FIT else "held-out",
            "impl": "torchtitan_h100", "shape": shape,
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
    # The same H100s as torchtitan's H100 tables (its footnote: "HBM2e based lower TDP SXM H100"),
    # Llama 3.1 405B, bf16, FSDP 16 x TP 8 (vanilla TP: async TP is the table's third row), local
    # batch 2 at seq 8192 (train_configs/llama3_405b.toml of that commit), full checkpointing.
    out.append({
        "name": "Llama 3.1 405B FSDP16 x TP8", "source": TITAN_405B, "split": "held-out",
        "impl": "torchtitan_h100", "shape": LLAMA3_405B, "hardware": "H100-500W", "seq": 8192,
        "batch": 32, "layout": {"dp": 16, "tp": 8, "zero_stage": 3, "micro_batch_size": 2,
                                "sequence_parallel": True, "activation_checkpointing": "full"},
        "published": 109, "unit": "tokens/s/GPU", "flops": None})
    def fit_rule(table) -> set:
        return {(min(table, key=lambda r: MPT[r[0]][1])[0], 2048), ("1b", 512), ("1b", 65536)}

    # The July 2023 table, less the rows the newer one repeats unchanged and the newer one's fit
    # layouts measured again (not independent of the fit).
    newer, fitted = {row[:6] for row in _MPT_A100}, fit_rule(_MPT_A100)
    older = [row for row in _MPT_A100_2023
             if row[:6] not in newer and not (row[2] == 8 and row[:2] in fitted)]
    for table, hw, source in ((_MPT_H100, "H100-SXM", MPT_H100), (_MPT_A100, "A100-80GB", MPT_A100),
                              (older, "A100-80GB", MPT_A100_2023)):
        calibration = fit_rule(table) if source != MPT_A100_2023 else set()
        for size, seq, gpus, mb, accum, tps, zero, ckpt, precision in table:
            fit = gpus == 8 and (size, seq) in calibration
            calibration.discard((size, seq) if fit else None)  # one row each
            out.append({
                "name": f"MPT {size} seq {seq}, {gpus} GPUs", "source": source,
                "split": "fit" if fit else "held-out",
                "impl": ("mpt_h100" if hw == "H100-SXM" else "mpt") + ("_pure" if precision == "PURE" else ""),
                "shape": gpt(*MPT[size], vocab=50368), "hardware": hw, "seq": seq,
                "batch": gpus * mb * accum,
                "layout": {"dp": gpus, "zero_stage": zero, "micro_batch_size": mb,
                           "activation_checkpointing": "full" if ckpt else "none"},
                "published": tps, "unit": "tokens/s/GPU", "flops": None})
    return out

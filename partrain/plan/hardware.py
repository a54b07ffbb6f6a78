"""What a cluster can do, for `partrain plan`'s time model and its search (`--hardware`).

A preset by name, or a YAML file the user writes with the same keys:

    name: my-cluster
    gpus_per_node: 8
    memory_gib: 80                  # per GPU
    peak_tflops: 989                # dense bf16, per GPU
    intra_node_gbps: 450            # GB/s one way per GPU over the node's links (NVLink)
    inter_node_gbps: 50             # GB/s one way per GPU across nodes (its share of the NICs)
    matmul_efficiency: 0.62         # the fraction of peak that large bf16 GEMMs attain
    hbm_gbps: 3350                  # GB/s of GPU memory bandwidth (optional: peak / 295 FLOP/B)
    fp32_tflops: 67                 # dense fp32 without tensor cores, per GPU (optional:
                                    # peak_tflops x 67 / 989, an H100-SXM's ratio)

Bandwidths are per GPU and one way, what a ring collective's step moves at. The presets are the
vendors' figures for the SXM/OAM parts in their usual 8-GPU nodes:
- A100-80GB: 312 TFLOP/s dense bf16, NVLink 3 at 300 GB/s one way, 8 x 200 Gb/s HDR InfiniBand;
- H100-SXM, H200: 989 TFLOP/s dense bf16, NVLink 4 at 450 GB/s one way, 8 x 400 Gb/s NDR;
- B200 (HGX B200 datasheet): 180 GB HBM3e, 2.25 PFLOP/s dense bf16 (4.5 with sparsity), NVLink 5
  at 900 GB/s one way (1.8 TB/s both ways), 8 x 400 Gb/s ConnectX-7;
- MI300X (AMD's datasheet): 192 GB HBM3, 1307 TFLOP/s dense bf16, Infinity Fabric to each of the
  seven other GPUs at 64 GB/s one way (448 GB/s in all), 8 x 400 Gb/s NICs.
fp32 (the vendors' datasheets, FP32 without tensor cores): A100-80GB 19.5 TFLOP/s, H100-SXM 67,
H200 67, B200 75 (the HGX B200 datasheet's 600 for 8 GPUs), MI300X 163.4. A run at
train.dtype=fp32 does its GEMMs at this peak, not the tensor cores': partrain never enables TF32
(torch's default leaves `allow_tf32` off for matmuls), so an fp32 GEMM on an H100 runs at 67
TFLOP/s, not 989. A file without `fp32_tflops` gets the H100-SXM's ratio (peak_tflops x 67 /
989); give it for any other part (an L40S: 91.6 against 362).
Memory bandwidth (HBM, the vendors' datasheets): A100-80GB 2039 GB/s, H100-SXM 3350, H200 4800,
B200 8000, MI300X 5300; it prices the element-wise work (norms, activations, the loss) and the
optimizer step. The efficiency is not a vendor figure: it is what a dense transformer's large
GEMMs reach in a training step, the limit that thinner ones approach (time_model.GEMM_HALF_DIM:
a hidden size of 4096 reaches 0.91 of it). A100 0.77 and H100 0.80 are fitted with that scale
(`python scripts/bench_time_model.py --fit`) on the fit rows of published runs only
(Megatron-LM's 2021 A100 table, the Llama 3 paper's Table 4, and a few rows of the other
trainers, whose own kernels get constants of their own); H200 and B200 take the H100's (not
fitted on them); MI300X 0.50: independent GEMM
benchmarks of it, such as SemiAnalysis's of December 2024, found large bf16 GEMMs at about half
of its peak.

Presets are found by their common names: case, `-SXM`/`-80GB` and punctuation do not matter
(`h100`, `H100`, `h100-sxm`); an unknown name that is close to one gets a did-you-mean.

Every number of a file must be finite and in RANGES (gpus_per_node a whole number): a NaN or an
infinity would flow through the memory and time models into a table of "nan GiB".
"""

import difflib
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

from partrain.config.paths import what_is
from partrain.config.validate_keys import MAX_NPROC_PER_NODE
from partrain.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    memory_gib: float
    peak_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    matmul_efficiency: float = 0.6
    hbm_gbps: float = 0.0  # GB/s of GPU memory; 0: peak_tflops / 295 FLOP per byte (an H100's)
    fp32_tflops: float = 0.0  # dense fp32, no tensor cores; 0: peak_tflops x 67 / 989 (an H100's)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def fp32_peak_flops(self) -> float:
        """FLOP/s of an fp32 GEMM: the CUDA cores', as partrain never enables TF32."""
        return (self.fp32_tflops or self.peak_tflops * H100_FP32_RATIO) * 1e12

    def compute_peak_flops(self, low_precision: bool) -> float:
        """The peak a GEMM of the compute dtype runs at: bf16/fp16 on the tensor cores, fp32
        on the CUDA cores."""
        return self.peak_flops if low_precision else self.fp32_peak_flops

    @property
    def hbm_bandwidth(self) -> float:
        """Bytes/s of the GPU's memory."""
        return (self.hbm_gbps or self.peak_tflops * 1e3 / H100_FLOP_PER_BYTE) * 1e9

    def bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes/s one way per GPU on the links a group uses."""
        return (self.inter_node_gbps if crosses_nodes else self.intra_node_gbps) * 1e9


H100_FLOP_PER_BYTE = 989e12 / 3350e9  # a machine's balance when a file gives no hbm_gbps
H100_FP32_RATIO = 67 / 989  # fp32 against bf16 when a file gives no fp32_tflops

PRESETS = {
    "A100-80GB": Hardware("A100-80GB", 8, 80, 312, 300, 25, 0.77, 2039, fp32_tflops=19.5),
    "H100-SXM": Hardware("H100-SXM", 8, 80, 989, 450, 50, 0.80, 3350, fp32_tflops=67),
    "H200": Hardware("H200", 8, 141, 989, 450, 50, 0.80, 4800, fp32_tflops=67),
    "B200": Hardware("B200", 8, 180, 2250, 900, 50, 0.80, 8000, fp32_tflops=75),
    "MI300X": Hardware("MI300X", 8, 192, 1307, 448, 50, 0.50, 5300, fp32_tflops=163.4),
}


def _plain(name: str) -> str:
    """A preset's name as people write it: no case, no punctuation, no form factor or memory
    (H100-SXM, h100 sxm5, H100 -> h100; A100-80GB, a100 -> a100)."""
    plain = re.sub(r"[^a-z0-9]", "", name.lower())
    return re.sub(r"(sxm\d?|oam|80gb|141gb)$", "", plain) or plain


def find_preset(name: str) -> Hardware | None:
    wanted = _plain(name)
    for preset in PRESETS.values():
        if _plain(preset.name) == wanted:
            return preset
    return None


# What a file's numbers may be: finite, and within what any machine could have, so that the
# models' arithmetic stays finite (a peak of 1e-300 TFLOP/s would make every step take forever).
# (lowest, highest, unit); gpus_per_node is a whole number, as many as one node may start.
RANGES = {
    "gpus_per_node": (1, MAX_NPROC_PER_NODE, "GPUs"),
    "memory_gib": (1e-3, 1e6, "GiB per GPU"),
    "peak_tflops": (1e-3, 1e6, "TFLOP/s per GPU"),
    "intra_node_gbps": (1e-3, 1e6, "GB/s per GPU"),
    "inter_node_gbps": (1e-3, 1e6, "GB/s per GPU"),
    "matmul_efficiency": (1e-3, 1, "a fraction of the peak"),
    "hbm_gbps": (1e-3, 1e7, "GB/s per GPU"),
    "fp32_tflops": (1e-3, 1e6, "TFLOP/s per GPU"),
}


OPTIONAL = ("name", "matmul_efficiency", "hbm_gbps", "fp32_tflops")  # a file may leave these out


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by its common name (find_preset), or a YAML file of Hardware's keys."""
    preset = find_preset(name_or_path)
    if preset is not None:
        return preset
    path = Path(name_or_path)
    found = what_is(path)
    if found != "is a regular file":
        close = difflib.get_close_matches(_plain(name_or_path), [_plain(p) for p in PRESETS],
                                          n=1, cutoff=0.6)
        guess = (f"; did you mean {find_preset(close[0]).name}?" if close and
                 not any(c in name_or_path for c in "/.") else "")
        raise ConfigError(f"--hardware {name_or_path}: neither a preset "
                          f"({', '.join(PRESETS)}) nor a YAML file: {name_or_path} {found}{guess}")
    from partrain.config.compose import read_yaml

    try:  # what no config file may be, too: huge, not UTF-8, a key twice, an alias bomb
        raw = read_yaml(path, "--hardware")
    except ConfigError as e:
        detail = str(e).removeprefix(f"--hardware {path} ").removeprefix("is ")
        raise ConfigError(f"--hardware {path}: not YAML that partrain reads ({detail})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--hardware {path}: must be a mapping of "
                          f"{', '.join(f.name for f in fields(Hardware))}")
    known = {f.name: f for f in fields(Hardware)}
    unknown = sorted(map(str, set(raw) - set(known)))
    if unknown:
        raise ConfigError(f"--hardware {path}: unknown key {unknown[0]} (keys: {', '.join(known)})")
    missing = [k for k, f in known.items() if k not in raw and k not in OPTIONAL]
    if missing:
        raise ConfigError(f"--hardware {path}: {missing[0]} is required")
    values = {"name": path.stem, **raw}
    if not isinstance(values["name"], (str, int, float)) or isinstance(values["name"], bool):
        raise ConfigError(f"--hardware {path}: name={values['name']!r} must be a plain name")
    for key, (low, high, unit) in RANGES.items():
        if key in values:
            values[key] = _number(f"--hardware {path}: {key}={values[key]}", key, values[key],
                                  low, high, unit)
    return Hardware(**{**values, "name": str(values["name"])})


def _number(where: str, key: str, value, low: float, high: float, unit: str):
    """A number of the file, checked: a number, finite, in [low, high], whole for a count."""
    if isinstance(value, str):  # YAML 1.1 reads 1e3 (no dot) as a string: read it as a number
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where} must be a positive number, not text") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a positive number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number")
    if value <= 0:
        raise ConfigError(f"{where} must be a positive number")
    if key == "gpus_per_node" and value != int(value):
        raise ConfigError(f"{where} must be a whole number")
    if not low <= value <= high:
        raise ConfigError(f"{where} must be at most {high:g} ({unit})" if value > high else
                          f"{where} must be at least {low:g} ({unit})")
    return int(value) if key == "gpus_per_node" else float(value)

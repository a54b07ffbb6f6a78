"""What a cluster can do, for `partrain plan`'s time model and its search (`--hardware`).

A preset by name, or a YAML file the user writes with the same keys:

    name: my-cluster
    gpus_per_node: 8
    memory_gib: 80                  # per GPU
    peak_tflops: 989                # dense bf16, per GPU
    intra_node_gbps: 450            # GB/s one way per GPU over the node's links (NVLink)
    inter_node_gbps: 50             # GB/s one way per GPU across nodes (its share of the NICs)
    matmul_efficiency: 0.62         # the fraction of peak that large bf16 GEMMs attain

Bandwidths are per GPU and one way, what a ring collective's step moves at. The presets are the
vendors' figures for the SXM parts in their usual 8-GPU nodes (NVLink 3 at 300 GB/s and 8 x 200
Gb/s HDR InfiniBand for the A100; NVLink 4 at 450 GB/s and 8 x 400 Gb/s NDR for H100 and H200).
The efficiency is not a vendor figure: it is what a dense transformer's GEMMs reach in practice.
"""

from dataclasses import dataclass, fields
from pathlib import Path

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

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes/s one way per GPU on the links a group uses."""
        return (self.inter_node_gbps if crosses_nodes else self.intra_node_gbps) * 1e9


PRESETS = {
    "A100-80GB": Hardware("A100-80GB", 8, 80, 312, 300, 25, 0.60),
    "H100-SXM": Hardware("H100-SXM", 8, 80, 989, 450, 50, 0.55),
    "H200": Hardware("H200", 8, 141, 989, 450, 50, 0.55),
}


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name (case-insensitive), or a YAML file of Hardware's keys."""
    for name, preset in PRESETS.items():
        if name.lower() == name_or_path.lower():
            return preset
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--hardware {name_or_path}: neither a preset "
                          f"({', '.join(PRESETS)}) nor a YAML file")
    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # a YAML syntax error: name the file and the parser's words
        raise ConfigError(f"--hardware {path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--hardware {path}: must be a mapping of "
                          f"{', '.join(f.name for f in fields(Hardware))}")
    known = {f.name: f for f in fields(Hardware)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"--hardware {path}: unknown key {unknown[0]} (keys: {', '.join(known)})")
    missing = [k for k, f in known.items() if k not in raw and k not in ("name", "matmul_efficiency")]
    if missing:
        raise ConfigError(f"--hardware {path}: {missing[0]} is required")
    values = {"name": path.stem, **raw}
    for key, value in values.items():
        if key == "name":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"--hardware {path}: {key}={value} must be a positive number")
    if values.get("matmul_efficiency", 0.6) > 1:
        raise ConfigError(f"--hardware {path}: matmul_efficiency={values['matmul_efficiency']} "
                          "must be at most 1")
    if int(values["gpus_per_node"]) != values["gpus_per_node"]:
        raise ConfigError(f"--hardware {path}: gpus_per_node={values['gpus_per_node']} must be "
                          "a whole number")
    return Hardware(**{**values, "name": str(values["name"]),
                       "gpus_per_node": int(values["gpus_per_node"])})

"""The parallel layout as arithmetic (ParallelDims) and as a torch DeviceMesh.

Rank order, outermost to innermost: pp, dp, cp, tp. Global rank =
((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, so a tp group is consecutive ranks (one
node), a cp group the next closest (its ring exchanges every layer), and a pp group is spread the
widest. Gradients are reduced over dp x cp: cp ranks hold the same parameters and see different
tokens of the same sequences, exactly as dp ranks see different sequences. The arithmetic needs
no process group, so `partrain plan` and the unit tests use it directly.
"""

import itertools
from dataclasses import dataclass

DIM_NAMES = ("pp", "dp", "cp", "tp")
FLATTENED = "_partrain_flattened"  # a built mesh's attribute: {name: its flattened 1-D mesh}


def flattened(mesh, name: str):
    """The 1-D mesh that a build_*mesh below flattened under `name` ("dp_cp", "dp_shard_cp",
    "edp_cp"), as `_flatten` returned it: torch 2.10 and later warn on slicing a flattened dim
    from the root mesh ("users need to bookkeep the flattened mesh directly") and mean to stop
    allowing it. A mesh built elsewhere (a test's own) is sliced as before."""
    kept = getattr(mesh, FLATTENED, {})
    return kept[name] if name in kept else mesh[name]


def _flatten(mesh, dims: tuple[str, ...], name: str):
    """Flatten mesh[dims] under name, keep the result on mesh (flattened), return mesh."""
    kept = getattr(mesh, FLATTENED, None)
    if kept is None:
        kept = {}
        setattr(mesh, FLATTENED, kept)
    kept[name] = mesh[dims]._flatten(name)
    return mesh


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp: int
    tp: int
    zero_stage: int = 0  # 0 = DDP over dp x cp; 1-3 = ZeRO over dp x cp
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    ep: int = 1  # expert parallelism: experts split over groups of ep consecutive dp ranks
    zero_backend: str = "deepspeed"  # what shards at zero_stage >= 1: deepspeed | fsdp
    dp_replicate: int = 1  # HSDP: FSDP shards inside dp / dp_replicate consecutive dp ranks

    @property
    def zero_enabled(self) -> bool:
        """Sharded data parallelism, by either engine (each keeps its own precision)."""
        return self.zero_stage > 0

    @property
    def deepspeed_enabled(self) -> bool:
        return self.zero_enabled and self.zero_backend == "deepspeed"

    @property
    def fsdp_enabled(self) -> bool:
        return self.zero_enabled and self.zero_backend == "fsdp"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp(self) -> int:
        """The ranks that reduce gradients together (and that ZeRO shards over)."""
        return self.dp * self.cp

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def coords(self, rank: int) -> dict[str, int]:
        """The (pp, dp, cp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return {"pp": rank // (self.dp * self.cp * self.tp),
                "dp": rank // (self.cp * self.tp) % self.dp,
                "cp": rank // self.tp % self.cp, "tp": rank % self.tp}

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of one dimension: the ranks that differ only in that coordinate, ordered
        by the other coordinates (outermost first)."""
        size = dict(zip(DIM_NAMES, self.shape))
        others = [d for d in DIM_NAMES if d != dim]
        groups = []
        for fixed in itertools.product(*(range(size[d]) for d in others)):
            at = dict(zip(others, fixed))
            groups.append([self.rank(**at, **{dim: i}) for i in range(size[dim])])
        return groups

    def build_mesh(self, device_type: str):
        """The 4-D DeviceMesh named ("pp", "dp", "cp", "tp"), with "dp_cp", dp and cp flattened
        (the gradient-reduction group); needs an initialised default group."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)
        return _flatten(mesh, ("dp", "cp"), "dp_cp")

    def build_hsdp_mesh(self, device_type: str):
        """The same ranks as (pp, dp_replicate, dp_shard, cp, tp), dp split into dp_replicate
        groups of dp / dp_replicate consecutive dp ranks (inside a node when they fit): FSDP
        shards over "dp_shard_cp" (dp_shard and cp flattened) and replicates over
        "dp_replicate"."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        shape = (self.pp, self.dp_replicate, self.dp // self.dp_replicate, self.cp, self.tp)
        mesh = DeviceMesh(device_type, torch.arange(self.world_size).view(shape),
                          mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        return _flatten(mesh, ("dp_shard", "cp"), "dp_shard_cp")

    def build_expert_mesh(self, device_type: str):
        """The same ranks as (pp, edp, ep, cp, tp), dp split into dp/ep groups of ep consecutive
        dp ranks: "ep" holds different experts, "edp_cp" (edp and cp flattened) the same ones."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        shape = (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)
        mesh = DeviceMesh(device_type, torch.arange(self.world_size).view(shape),
                          mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        return _flatten(mesh, ("edp", "cp"), "edp_cp")

    def build_expert_shard_mesh(self, device_type: str):
        """The expert mesh's ranks as (pp, ep, edp, cp, tp): FSDP shards an ep rank's experts
        over "edp_cp" (edp and cp flattened: the ranks holding the same experts), and a
        checkpoint records each rank's piece over ("ep", "edp_cp"), ep the outer split of the
        experts and edp_cp the inner one."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.world_size).view(self.pp, self.dp // self.ep, self.ep,
                                                   self.cp, self.tp)
        mesh = DeviceMesh(device_type, ranks.transpose(1, 2).contiguous(),
                          mesh_dim_names=("pp", "ep", "edp", "cp", "tp"))
        return _flatten(mesh, ("edp", "cp"), "edp_cp")

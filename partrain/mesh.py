"""The parallel layout as arithmetic (ParallelDims) and as a torch DeviceMesh.

Rank order, outermost to innermost: pp, dp, tp. Global rank = (pp_rank * dp + dp_rank) * tp +
tp_rank, so a tp group is consecutive ranks (one node) and a pp group is spread the widest.
The arithmetic needs no process group, so `partrain plan` and the unit tests use it directly.
"""

from dataclasses import dataclass

DIM_NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp: int
    tp: int
    zero_stage: int = 0  # 0 = DDP over dp; 1-3 = DeepSpeed ZeRO over dp

    @property
    def zero_enabled(self) -> bool:
        return self.zero_stage > 0

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def coords(self, rank: int) -> dict[str, int]:
        """The (pp, dp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp,
                "tp": rank % self.tp}

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of one dimension: the ranks that differ only in that coordinate."""
        size = dict(zip(DIM_NAMES, self.shape))
        others = [d for d in DIM_NAMES if d != dim]
        groups = []
        for a in range(size[others[0]]):
            for b in range(size[others[1]]):
                fixed = {others[0]: a, others[1]: b}
                groups.append([self.rank(**fixed, **{dim: i}) for i in range(size[dim])])
        return groups

    def build_mesh(self, device_type: str):
        """The 3-D DeviceMesh named ("pp", "dp", "tp"); needs an initialised default group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)

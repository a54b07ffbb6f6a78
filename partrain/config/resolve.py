"""Values resolved from the config and the machine, shared by the launcher, the planner and the
workers: the world (how many ranks where), dp when it is `auto`, the batch triple, the compute
dtype. No torch.

Resolution refuses what it cannot resolve (a degree that is not a whole number, a world the
degrees do not fit) with the same kind of message as the rules in partrain.config.validate.
"""

from dataclasses import dataclass, field

from omegaconf import DictConfig

from partrain.config.keys import shown
from partrain.errors import ConfigError

# Bounds on what can exist, so that validation and `plan` cost the same for any input: the
# largest training jobs run ~10^5 GPUs.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class World:
    """How many processes run where: nnodes * nproc_per_node ranks."""

    nnodes: int
    nproc_per_node: int
    # Where nproc_per_node came from, for messages: a flag, a key, or the degrees' product.
    nproc_from: str = field(default="--nproc-per-node", compare=False)

    @property
    def size(self) -> int:
        return self.nnodes * self.nproc_per_node


def check_degrees(p: DictConfig) -> None:
    """dp, tp, pp and cp are whole and at least 1 (dp may be auto): checked before anything
    derives a world size from them, so that a bad degree is named as itself."""
    if p.dp != "auto" and (isinstance(p.dp, bool) or not isinstance(p.dp, int)):
        raise ConfigError(f"parallel.dp={shown(p.dp)} must be a positive integer or 'auto'")
    for key in ("dp", "tp", "pp", "cp"):
        value = p[key]
        if value != "auto" and value < 1:
            raise ConfigError(f"parallel.{key}={value} must be at least 1"
                              + (" (or 'auto')" if key == "dp" else ""))
        if value != "auto" and value > MAX_WORLD_SIZE:
            raise ConfigError(f"parallel.{key}={value} exceeds {MAX_WORLD_SIZE:,}, the most ranks "
                              "partrain plans for (no machine has more)")


def degrees_product(p: DictConfig, dp, prefix: str = "") -> str:
    """The degrees' product as a message spells it; cp only where it is used."""
    cp = f" * {prefix}cp({p.cp})" if p.cp > 1 else ""
    return f"{prefix}pp({p.pp}) * {prefix}dp({dp}){cp} * {prefix}tp({p.tp})"


def resolve_world(cfg: DictConfig, nnodes: int | None, nproc_per_node: int | None,
                  cuda_devices: int) -> World:
    """CLI flags win over launcher.* keys; nproc_per_node defaults to the GPUs, else the degrees."""
    p = cfg.parallel
    check_degrees(p)
    nodes_from = "--nnodes" if nnodes is not None else "launcher.nnodes"
    nnodes = nnodes if nnodes is not None else cfg.launcher.nnodes
    nproc_from = "--nproc-per-node" if nproc_per_node is not None else "launcher.nproc_per_node"
    nproc = nproc_per_node if nproc_per_node is not None else cfg.launcher.nproc_per_node
    if nnodes < 1:
        raise ConfigError(f"{nodes_from}={nnodes} must be at least 1")
    if nproc is None:
        if cuda_devices > 0 and cfg.launcher.device != "cpu":
            nproc, nproc_from = cuda_devices, "the visible GPUs"
        elif p.dp != "auto":
            # On CPU the degrees say how many processes: spread evenly over the nodes.
            product = p.pp * p.dp * p.cp * p.tp
            if product % nnodes:
                raise ConfigError(
                    f"{degrees_product(p, p.dp)} = {product} ranks cannot be spread evenly over "
                    f"{nodes_from}={nnodes} nodes; change the degrees or the nodes, or give "
                    "--nproc-per-node")
            nproc = product // nnodes
            nproc_from = (degrees_product(p, p.dp, "parallel.")
                          + (f" / nnodes({nnodes})" if nnodes > 1 else ""))
        else:
            raise ConfigError(
                "parallel.dp=auto needs a world size: give --nproc-per-node N (or set "
                "launcher.nproc_per_node), or set parallel.dp to a number")
    if nproc < 1:
        raise ConfigError(f"{nproc_from}={nproc} must be at least 1")
    if nproc > MAX_WORLD_SIZE:
        raise ConfigError(f"{nproc_from}={nproc:,} exceeds {MAX_WORLD_SIZE:,} ranks, the most "
                          "partrain plans for")
    if nnodes * nproc > MAX_WORLD_SIZE:
        raise ConfigError(f"nnodes({nnodes}) * nproc_per_node({nproc}) = {nnodes * nproc:,} "
                          f"ranks exceeds {MAX_WORLD_SIZE:,}, the most partrain plans for")
    return World(nnodes=nnodes, nproc_per_node=nproc, nproc_from=nproc_from)


def resolve_dp(p: DictConfig, world: World) -> int:
    """parallel.dp, with `auto` the world size over the other degrees."""
    if p.dp == "auto":
        inner = p.tp * p.pp * p.cp
        if world.size % inner:
            cp = f" * cp({p.cp})" if p.cp > 1 else ""
            raise ConfigError(
                f"parallel.dp=auto needs the world size {world.size} to be divisible by "
                f"pp({p.pp}){cp} * tp({p.tp}) = {inner}"
            )
        return world.size // inner
    check_degrees(p)
    return p.dp


def resolve_batch(t: DictConfig, dp: int, resplit: bool = False) -> tuple[int, int, int]:
    """global_batch_size = micro_batch_size * micro_batches * dp; any two fix the third.
    `resplit` (a resume that names neither micro-batch key: its split is derived again for the
    new layout): where the kept micro_batch_size does not fit the new dp, the largest one that
    does and is no larger (no more memory per micro-batch than the run had)."""
    g, b, m = t.global_batch_size, t.micro_batch_size, t.micro_batches
    if resplit and g is not None and b is not None and m is None and g % (b * dp) and not g % dp:
        b = max(d for d in range(1, b + 1) if (g // dp) % d == 0)
    given = sum(v is not None for v in (g, b, m))
    if given < 2:
        raise ConfigError(
            "set two of train.global_batch_size, train.micro_batch_size, train.micro_batches "
            f"(got global_batch_size={g}, micro_batch_size={b}, micro_batches={m}); "
            "global_batch_size = micro_batch_size * micro_batches * dp"
        )
    if g is None:
        return b * m * dp, b, m
    if b is not None and m is not None:
        if b * m * dp != g:
            raise ConfigError(
                f"train.global_batch_size={g} != micro_batch_size({b}) * micro_batches({m}) * "
                f"dp({dp}) = {b * m * dp}; set one of the three to null to derive it"
            )
        return g, b, m
    known_key, known = ("micro_batch_size", b) if b is not None else ("micro_batches", m)
    other_key = "micro_batches" if b is not None else "micro_batch_size"
    if g % (known * dp):
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by {known_key}({known}) * dp({dp}) "
            f"= {known * dp}, so train.{other_key} would not be whole"
        )
    other = g // (known * dp)
    return (g, b, other) if b is not None else (g, other, m)


def compute_dtype(dtype: str, on_cuda: bool) -> str:
    """train.dtype with `auto` resolved: bf16 on CUDA, fp32 on CPU."""
    return dtype if dtype != "auto" else ("bf16" if on_cuda else "fp32")

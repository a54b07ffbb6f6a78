"""Where a process group's ranks land on the nodes, and the bandwidth its collectives get: the
time model's links (partrain/plan/time_model.py).

partrain's mesh is (pp, dp, cp, tp), tp innermost (partrain/parallel/mesh.py): global rank =
((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, node = rank // gpus_per_node. A group
along one mesh dimension is `size` ranks `stride` apart (tp: stride 1; cp: tp; dp x cp: tp; ep, the
innermost ep of the dp ranks: cp x tp; pp: dp x cp x tp), and its groups tile blocks of
size x stride consecutive ranks. Every such group stays inside a node only if the world is one
node, or the node size is a multiple of size x stride (each block inside one node): tp=4 on
nodes of 6 puts ranks 4-7 on nodes 0 and 1, though 4 < 6. Any other arrangement has a group
that crosses: a node boundary falls inside a block, and some group of that block has ranks on
both sides of it. A group over several dimensions (the expert-data-parallel group, edp x cp)
stays inside a node only if each of its dimensions does: its ranks are joined by lines along
one dimension, each inside a node.

A collective is as fast as its slowest group: the time model prices every group of a kind at
the bandwidth of the worst one. A group that crosses moves at min(k x the per-GPU NIC share,
NVLink) per GPU, k the fewest of its ranks on one of its nodes (NCCL builds one ring channel per
NIC, and a node holding k of the ring's ranks feeds it through k NICs' shares).
"""

import functools
import math
from collections import Counter, defaultdict

from partrain.plan.hardware import Hardware

# Bus bandwidth that NCCL's ring collectives reach of the links' (nccl-tests on DGX A100/H100:
# about 80% of NVLink's and of the NICs' line rate at large messages).
BUS_EFFICIENCY = 0.8

Dim = tuple[int, int]  # one mesh dimension a group spans: (its size, the stride between ranks)


@functools.lru_cache(maxsize=4096)
def fewest_on_a_node(dims: tuple[Dim, ...], gpus_per_node: int, world: int) -> int:
    """0 when every group along `dims` lies inside one node; otherwise the fewest ranks that a
    group which crosses nodes has on one of its nodes (the bandwidth's k)."""
    dims = tuple((size, stride) for size, stride in dims if size > 1)
    if not dims or world <= gpus_per_node or \
            all(gpus_per_node % (size * stride) == 0 for size, stride in dims):
        return 0
    # Adding the outermost dimension's block changes no coordinate along `dims` (it maps groups
    # onto groups), adding a node's size maps nodes onto nodes: one period of both is enough.
    block = max(size * stride for size, stride in dims)
    span = min(world, math.lcm(block, gpus_per_node))
    nodes = defaultdict(Counter)  # a group (by its first rank) -> its ranks per node
    for rank in range(span):
        first = rank - sum((rank // stride) % size * stride for size, stride in dims)
        nodes[first][rank // gpus_per_node] += 1
    return min(min(per_node.values()) for per_node in nodes.values() if len(per_node) > 1)


def crosses_nodes(world: int, gpus_per_node: int, *dims: Dim) -> bool:
    """Whether some group along `dims` (size, stride pairs) of a world of `world` ranks has
    ranks on two nodes."""
    return fewest_on_a_node(tuple(dims), gpus_per_node, world) > 0


def group_bandwidth(hw: Hardware, world: int, *dims: Dim) -> float:
    """Bytes/s one way per GPU that a ring over the groups along `dims` moves at, the slowest
    group's: NVLink inside a node; across nodes, the NICs of its fewest ranks on a node, at most
    NVLink."""
    k = fewest_on_a_node(tuple(dims), hw.gpus_per_node, world)
    if not k:
        return hw.bandwidth(False) * BUS_EFFICIENCY
    return min(k * hw.bandwidth(True), hw.bandwidth(False)) * BUS_EFFICIENCY


def ring(op: str, payload: float, n: int, bandwidth: float) -> float:
    """Seconds of a ring collective over n ranks: 2(n-1)/n of the payload per rank for an
    all-reduce, (n-1)/n for an all-gather or reduce-scatter."""
    if n <= 1 or payload <= 0:
        return 0.0
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return factor * payload / bandwidth

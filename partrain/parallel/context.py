"""Context parallelism (cp): each sequence split along its length over the ranks of a cp group.

Every module but attention works on its own tokens; attention needs the keys and values of the
whole causal prefix, which the cp ranks exchange. Two methods:

- `ring` (RingAttention; Megatron's and torchtitan's default): the key/value blocks travel
  around the ring, point to point, the next block's transfer posted before the current block is
  computed. Each block's partial attention is merged into the running result through its
  log-sum-exp (the online softmax of FlashAttention), so no rank ever holds the full score
  matrix. The backward runs the ring again, recomputing each block's probabilities from the
  saved log-sum-exp; the key/value gradients travel with their block and arrive back at its
  owner after the last step. A block is computed by a fused kernel of torch's that returns the
  log-sum-exp (on CPU the flash kernel SDPA runs there; on CUDA the memory-efficient one, in the
  inputs' dtype, merged in fp32) and by the written-out softmax elsewhere.
- `all_to_all` (DeepSpeed-Ulysses): one all-to-all turns the sequence split into a head split,
  each rank runs ordinary causal attention over the whole sequence for 1/cp of the heads, and one
  all-to-all turns it back. Heads and kv heads must divide by cp.

Load balance: under a causal mask the rank holding the end of a sequence would do the most work,
so the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r (the zigzag of
Megatron and torchtitan): `zigzag_positions` gives each rank's global positions, which the rotary
embedding and the mask use. Under the ring, a block of chunks wholly after the queries' chunk is
skipped; the diagonal chunk pair is causal; the rest is full.
"""

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

METHODS = ("ring", "all_to_all")
# The ring's blocks on CPU go through torch's fused flash kernel; False writes the softmax out,
# as on other devices (the tests run both).
FUSED_ON_CPU = True
# On CUDA through the memory-efficient kernel (fp32, fp16 and bf16; it returns the log-sum-exp
# and its backward takes the merged output's); False writes the softmax out in fp32.
# scripts/check_cp_fused.py on an H200 (torch 2.11): the fp32 ring within 2.8e-6 of the
# written-out one, a bf16 block closer to fp32 than the same math written out in bf16, and one
# causal block's forward + backward 9-10x faster at 8k-16k tokens (at 32k the written-out
# scores no longer fit).
FUSED_ON_CUDA = True


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds: chunks rank and 2*cp-1-rank of 2*cp."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of x along `dim` (the sequence), in zigzag order."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank).to(x.device))


# Bytes this rank sends over its cp group, counted while `count_traffic` is open (the tests and
# scripts/bench_cp.py check them against `cp_traffic`).
_sent: list | None = None


@contextmanager
def count_traffic():
    """Within the block, the list it yields collects the bytes of every cp send of this rank."""
    global _sent
    _sent = []
    try:
        yield _sent
    finally:
        _sent = None


def _count(nbytes: int) -> None:
    if _sent is not None:
        _sent.append(nbytes)


# ---- ring ------------------------------------------------------------------------------------
def _exchange(tensor: torch.Tensor, group, rank: int, size: int):
    """Post: send `tensor` to the next rank of the ring, receive the previous rank's. Returns the
    receive buffer and the works to wait on. A ring of one keeps its own (cp=1 never runs the
    ring; scripts/check_cp_fused.py does, on one GPU)."""
    if size == 1:
        return tensor, []
    _count(tensor.numel() * tensor.element_size())
    buffer = torch.empty_like(tensor)
    to = dist.get_global_rank(group, (rank + 1) % size)
    frm = dist.get_global_rank(group, (rank - 1) % size)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, to, group),
                                    dist.P2POp(dist.irecv, buffer, frm, group)])
    return buffer, works


def _wait(works) -> None:
    for work in works:
        work.wait()


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads repeated for the query heads they serve (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of _expand for gradients: sum over the query heads of each kv head."""
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2)


def _pairs(rank: int, src: int, size: int):
    """(query chunk, key chunk, causal) for the chunk pairs of this step that are not masked
    out: the local query chunks are rank and 2*size-1-rank, the block's key chunks src and
    2*size-1-src (chunk index = order along the sequence)."""
    mine, theirs = (rank, 2 * size - 1 - rank), (src, 2 * size - 1 - src)
    return [(i, j, theirs[j] == mine[i]) for i in range(2) for j in range(2) if theirs[j] <= mine[i]]


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


def _fused_on_cuda(q) -> bool:
    return q.device.type == "cuda" and FUSED_ON_CUDA


def _bshd(x):
    """x (batch, heads, seq, dim) laid out as (batch, seq, heads, dim) in memory: the layout the
    CUDA memory-efficient kernel's backward assumes for its output and output gradient (it takes
    their batch and head strides and derives the sequence stride as heads x dim). A (batch, heads,
    seq, dim)-contiguous output is read out of bounds there: wrong gradients, then an illegal
    memory access at seq 8192 on an H200 (torch 2.11). The forward gets the same layout. A
    sequence slice of a tensor already so laid out is returned as it is (the ring lays q, k, v,
    the output and its gradient out once a step; its blocks are such slices)."""
    b, h, s, d = x.shape
    if x.stride(3) == 1 and x.stride(1) == d and (s == 1 or x.stride(2) == h * d):
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _step_layout(x):
    """The ring's tensors of a step as its fused CUDA blocks want them (_bshd), once a step
    rather than once a block; as they are elsewhere."""
    return _bshd(x) if _fused_on_cuda(x) else x


def _lse_padded(lse):
    """The log-sum-exp as the memory-efficient kernel's backward reads it: rows padded to a
    multiple of 32 queries (it reads whole tiles of 32), the padding +inf as its forward writes
    it (a padded query's probabilities are then zero). Unpadded, the last head's tile would read
    past the tensor's end when a chunk is no multiple of 32."""
    pad = -lse.shape[-1] % 32
    return F.pad(lse, (0, pad), value=math.inf).contiguous() if pad else lse.contiguous()


def _block_forward(q, k, v, causal: bool, scale: float):
    """One block's attention and its log-sum-exp, (out, lse), lse in fp32. On CPU torch's fused
    flash kernel (the one SDPA runs) returns both, on CUDA its memory-efficient kernel (whose
    log-sum-exp some releases pad to a multiple of 32 queries); elsewhere the softmax is written
    out."""
    if _fused_on_cuda(q):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bshd(q), _bshd(k), _bshd(v), None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]
    if q.device.type == "cpu" and FUSED_ON_CPU:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    s = _scores(q, k, causal, scale)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block, given the final output and log-sum-exp of its queries (so that
    the block's probabilities are its share of the whole row's softmax)."""
    if _fused_on_cuda(q):
        unused = torch.zeros((), dtype=torch.long, device=q.device)  # dropout's seed and offset
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bshd(dout), _bshd(q), _bshd(k), _bshd(v), None, _bshd(out), _lse_padded(lse),
            unused, unused, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    if q.device.type == "cpu" and FUSED_ON_CPU:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            lse.contiguous(), 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout


class _RingAttention(torch.autograd.Function):
    """Causal attention over the cp ring. q (batch, heads, 2c, head_dim); k, v (batch, kv_heads,
    2c, head_dim): this rank's two zigzag chunks of c tokens each."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        groups, c, scale = q.shape[1] // k.shape[1], q.shape[2] // 2, q.shape[-1] ** -0.5
        work = q.dtype if _fused_on_cuda(q) else torch.float32  # blocks' dtype; merged in fp32
        qf = _step_layout(q.to(work))
        out, lse = [None, None], [None, None]
        kv = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:
                incoming, works = _exchange(kv, group, rank, size)
            src = (rank - step) % size
            keys = _step_layout(_expand(kv[0].to(work), groups))
            values = _step_layout(_expand(kv[1].to(work), groups))
            for i, j, causal in _pairs(rank, src, size):
                block, block_lse = _block_forward(qf[:, :, i * c:(i + 1) * c],
                                                  keys[:, :, j * c:(j + 1) * c],
                                                  values[:, :, j * c:(j + 1) * c], causal, scale)
                block = block.float()
                if out[i] is None:
                    out[i], lse[i] = block, block_lse
                else:
                    merged = torch.logaddexp(lse[i], block_lse)
                    out[i] = (out[i] * torch.exp(lse[i] - merged)[..., None]
                              + block * torch.exp(block_lse - merged)[..., None])
                    lse[i] = merged
            if step < size - 1:
                _wait(works)
                kv = incoming
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        groups, c, scale = q.shape[1] // k.shape[1], q.shape[2] // 2, q.shape[-1] ** -0.5
        work = q.dtype if _fused_on_cuda(q) else torch.float32
        qf, dout, out = (_step_layout(x.to(work)) for x in (q, dout, out))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(size):
            if step < size - 1:
                incoming, works = _exchange(kv, group, rank, size)
            src = (rank - step) % size
            keys = _step_layout(_expand(kv[0].to(work), groups))
            values = _step_layout(_expand(kv[1].to(work), groups))
            dk = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
            dv = torch.zeros_like(dk)
            for i, j, causal in _pairs(rank, src, size):
                rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                dq_i, dk_j, dv_j = _block_backward(
                    dout[:, :, rows], qf[:, :, rows], keys[:, :, cols], values[:, :, cols],
                    out[:, :, rows], lse[:, :, rows], causal, scale)
                dq[:, :, rows] += dq_i
                dk[:, :, cols] += dk_j
                dv[:, :, cols] += dv_j
            dkv += torch.stack([_reduce_heads(dk, groups), _reduce_heads(dv, groups)])
            # The gradients follow their block to the next rank; after the last step they reach
            # the block's owner.
            dkv_incoming, dkv_works = _exchange(dkv, group, rank, size)
            if step < size - 1:
                _wait(works)
                kv = incoming
            _wait(dkv_works)
            dkv = dkv_incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries over the whole sequence's keys and values.
    q (batch, heads, 2c, head_dim), k and v (batch, kv_heads, 2c, head_dim)."""
    return _RingAttention.apply(q, k, v, group)


# ---- all-to-all (Ulysses) --------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Forward: scatter `scatter_dim` over the group and gather `gather_dim` (an all-to-all);
    backward: the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        size = dist.get_world_size(group)
        inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
        _count(sum(t.numel() * t.element_size() for r, t in enumerate(inputs)
                   if r != dist.get_rank(group)))
        outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
        dist.all_to_all(outputs, inputs, group=group)
        return torch.cat(outputs, dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """The same attention as ring_attention, through two all-to-alls: sequence split -> head
    split, causal attention over the whole sequence, head split -> sequence split."""
    size, local = dist.get_world_size(group), q.shape[2]
    # After the first all-to-all the sequence is every rank's zigzag chunks in rank order; this
    # puts it in position order for the causal mask, and back.
    order = torch.cat([zigzag_positions(local * size, size, r) for r in range(size)]).to(q.device)
    natural = torch.argsort(order)
    q, k, v = (_AllToAll.apply(t, group, 1, 2)[:, :, natural] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return _AllToAll.apply(out[:, :, order], group, 2, 1)


class ContextAttention:
    """What a cp model's Attention calls instead of SDPA: the method over this rank's cp group,
    and the global positions of this rank's tokens (for the rotary tables)."""

    def __init__(self, group, method: str, positions: torch.Tensor):
        self.group, self.method, self.positions = group, method, positions
        self._attend = ring_attention if method == "ring" else all_to_all_attention

    def __call__(self, q, k, v):
        return self._attend(q, k, v, self.group)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, parallel_cfg,
                           seq_len: int) -> nn.Module:
    """Make every attention of `model` attend over the cp group (parallel_cfg.cp_method), for
    sequences of seq_len tokens of which this rank holds its zigzag share (`shard_batch`)."""
    group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
    positions = zigzag_positions(seq_len, cp_mesh.size(), rank).to(next(model.parameters()).device)
    for module in model.modules():
        if hasattr(module, "context") and hasattr(module, "wq"):
            module.context = ContextAttention(group, parallel_cfg.cp_method, positions)
    return model


def shard_batch(micro: list, cp: int, rank: int) -> list:
    """This cp rank's tokens of every (inputs, targets) micro-batch: its zigzag share of each
    sequence. The targets go with their inputs, so the loss over the cp ranks' tokens together is
    the loss over the whole sequence."""
    return [(shard_sequence(x, cp, rank), shard_sequence(y, cp, rank)) for x, y in micro]

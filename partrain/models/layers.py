"""The layers a decoder is built from: RMSNorm, rotary embeddings (with Llama 3 scaling),
grouped-query causal attention, the SwiGLU feed-forward. Shared by every model family.

With train.document_masking, attention takes a mask (`document_mask`) that keeps each token to
the earlier tokens of its own document in a packed sequence.

Attention also has a generation path, `decode` with a `KVCache` (partrain.interop.sample): the
keys and values of the positions already seen are kept instead of computed again. Training never
takes it."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from partrain.models.arith import head_dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_scaling(cfg) -> dict | None:
    """Llama-3's frequency scaling from the model config, or None (plain rotary embeddings)."""
    if getattr(cfg, "rope_type", "default") != "llama3":
        return None
    return {"factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len}


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1's rule: long wavelengths (beyond the original context / low_freq_factor) are
    slowed by `factor`, short ones (under it / high_freq_factor) kept, those between blended."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by position-dependent angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed sequences: from each sequence's document ids (batch, seq),
    ascending along the sequence, True where a query (row) may attend to a key (column): the
    same document, not later. Shape (batch, 1, seq, seq), broadcast over the heads.

    Positions are not restarted per document: rotary embeddings make a query-key score depend on
    their distance only, so a document attends the same at any offset (up to float rounding)
    and the rotary tables need no per-token gather."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


class KVCache:
    """The keys (rotated) and values of a batch's first `length` positions, per layer, for
    generating one token at a time: tensors (layers, batch, kv_heads, max_seq_len, head_dim),
    allocated once. Grouped-query attention keeps its kv heads, not the query heads they serve."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions filled

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        # Head counts are the ones this module computes; tensor parallelism lowers them per rank.
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = head_dim(cfg)  # dim / n_heads unless model.head_dim sets it (Qwen3)
        bias = bool(getattr(cfg, "qkv_bias", False))  # Qwen2's q/k/v biases; never on wo
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Qwen3's q/k norms: one RMSNorm gain of head_dim shared by every head, applied to each
        # head's query and key before the rotary embedding.
        self.q_norm = self.k_norm = None
        if getattr(cfg, "qk_norm", False):
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        # Context parallelism (parallel/context.py) sets a ContextAttention here: x is then this
        # rank's tokens of each sequence, at the global positions it names.
        self.context = None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values (batch, seq, heads, head_dim) of x, q and k normed per head
        where model.qk_norm asks (before the rotation, as Qwen3)."""
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (batch, seq, dim); cos/sin the full rotary tables, cut here to x's positions (under
        sequence parallelism x is already gathered to the full sequence at this point); `mask`
        a document_mask (None: causal over the whole sequence)."""
        bsz, seq, _ = x.shape
        if self.context is None:
            cos, sin = cos[:seq], sin[:seq]
        else:
            cos, sin = cos[self.context.positions], sin[self.context.positions]
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.context is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=self.n_heads != self.n_kv_heads)
        elif mask is not None:  # validation refuses it (config/validate.py)
            raise ValueError("document masking does not go with context parallelism")
        else:
            out = self.context(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
               layer: int) -> torch.Tensor:
        """`forward` for x (batch, seq, dim) at positions cache.length onwards: their keys and
        values are written to the cache, the queries attend to every position cached so far. The
        whole model on one process (no tensor or context parallelism)."""
        bsz, seq, _ = x.shape
        start, end = cache.length, cache.length + seq
        cos, sin = cos[start:end], sin[start:end]
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.k[layer, :bsz, :, start:end] = k.transpose(1, 2)
        cache.v[layer, :bsz, :, start:end] = v.transpose(1, 2)
        keys, values = cache.k[layer, :bsz, :, :end], cache.v[layer, :bsz, :, :end]
        # One new token sees every cached one (no mask); a prompt from position 0 is the causal
        # case of `forward`; new tokens after cached ones see those and the new ones before them.
        mask = None
        if seq > 1 and start > 0:
            positions = torch.arange(end, device=x.device)
            mask = positions <= positions[start:, None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             is_causal=seq > 1 and start == 0,
                                             enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query causal attention.

Built so that the parallel wrappers can take it apart: separate q/k/v/o and w1/w3/w2 linears
(column- and row-parallel candidates), blocks in a ModuleDict keyed "0".."L-1" (a pipeline stage
deletes the blocks it does not own and keeps the names), embedding, final norm and output head
as separate modules. Weights depend only on the seed, so every layout starts from the same model.

With `tie_embeddings` the head's weight is the embedding's Parameter (Megatron's and Hugging Face's
tied input/output embeddings): one (vocab_size, dim) matrix, counted, initialised and saved once
under the embedding's name. A pipeline stage that has the head but not the embedding keeps a copy
(partrain.parallel.pipeline keeps the copies equal).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from partrain.models.moe import MoE, expert_ffn_dim, is_moe_block, moe_blocks
from partrain.models.recompute import run_block


def ffn_dim(cfg) -> int:
    """SwiGLU inner size: given, or 8/3 * dim rounded up to a multiple of `multiple_of`."""
    if cfg.ffn_dim:
        return cfg.ffn_dim
    hidden = int(8 * cfg.dim / 3)
    return cfg.multiple_of * math.ceil(hidden / cfg.multiple_of)


def expert_params(cfg) -> int:
    """Parameters of one routed (or shared) expert: a SwiGLU of the expert's hidden size."""
    return 3 * cfg.dim * expert_ffn_dim(cfg, ffn_dim(cfg))


def mlp_params(cfg, layer: int, ep: int = 1, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP: the dense SwiGLU, or a MoE's router, shared experts and
    routed experts (all of them, 1/ep of them under expert parallelism, or only the top_k a
    token uses when `active`)."""
    if not is_moe_block(cfg, layer):
        return 3 * cfg.dim * ffn_dim(cfg)
    moe = cfg.moe
    routed = moe.top_k if active else moe.n_experts // ep
    return (routed + moe.n_shared_experts) * expert_params(cfg) + cfg.dim * moe.n_experts


def _attention_params(cfg) -> int:
    head_dim = cfg.dim // cfg.n_heads
    return cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)


def count_params(cfg, active: bool = False) -> int:
    """Parameters of the full model from its shape alone (used by `plan` for models never built);
    `active`: those one token uses (a MoE's top_k experts, not all of them)."""
    blocks = sum(_attention_params(cfg) + mlp_params(cfg, i, active=active) + 2 * cfg.dim
                 for i in range(cfg.n_layers))
    return blocks + vocab_matrices(cfg) * cfg.vocab_size * cfg.dim + cfg.dim


def tied(cfg) -> bool:
    """Whether the head's weight is the embedding's (model.tie_embeddings; absent = untied)."""
    return bool(getattr(cfg, "tie_embeddings", False))


def vocab_matrices(cfg) -> int:
    """(vocab_size, dim) matrices of the full model: embedding and head, or one when tied."""
    return 1 if tied(cfg) else 2


def count_params_per_rank(cfg, tp: int = 1, blocks=None, first: bool = True,
                          last: bool = True, ep: int = 1) -> int:
    """Parameters held by one rank: `blocks` (the block ids, or a count of blocks from 0; all by
    default), the embedding if first, final norm and head if last; tensor parallelism splits
    everything but the norm gains and the MoE MLPs (replicated within tp, split over ep). A tied
    head on the embedding's rank is the same matrix; on another pipeline stage it is a copy."""
    ids = range(cfg.n_layers if blocks is None else blocks) if not isinstance(blocks, (list, range)) \
        else blocks
    vocab = (first or last) if tied(cfg) else first + last
    split = sum(_attention_params(cfg) + (0 if is_moe_block(cfg, i) else mlp_params(cfg, i))
                for i in ids) + vocab * cfg.vocab_size * cfg.dim
    replicated = sum(2 * cfg.dim + (mlp_params(cfg, i, ep) if is_moe_block(cfg, i) else 0)
                     for i in ids)
    return split // tp + replicated + (cfg.dim if last else 0)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (active params less the embedding lookup) + causal attention.
    A tied head still multiplies: its matrix counts (once) even though the lookup does not. A MoE
    counts the experts a token uses (top_k and the shared ones) and the router.

    Attention scores and the weighted sum cost 2 * 2 * seq * dim multiply-adds per layer and token
    forward; with backward (x3) and the causal half that is 6 * L * seq * dim.
    """
    dense = count_params(cfg, active=True) - (vocab_matrices(cfg) - 1) * cfg.vocab_size * cfg.dim
    return 6 * dense + 6 * cfg.n_layers * seq_len * cfg.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


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


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        # Head counts are the ones this module computes; tensor parallelism lowers them per rank.
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Context parallelism (parallel/context.py) sets a ContextAttention here: x is then this
        # rank's tokens of each sequence, at the global positions it names.
        self.context = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, dim); cos/sin the full rotary tables, cut here to x's positions (under
        sequence parallelism x is already gathered to the full sequence at this point)."""
        bsz, seq, _ = x.shape
        if self.context is None:
            cos, sin = cos[:seq], sin[:seq]
        else:
            cos, sin = cos[self.context.positions], sin[self.context.positions]
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.context is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=self.n_heads != self.n_kv_heads)
        else:
            out = self.context(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # A mixture of experts in place of the dense MLP where model.moe says so.
        self.feed_forward = (MoE(cfg, ffn_dim(cfg)) if is_moe_block(cfg, layer)
                             else FeedForward(cfg.dim, ffn_dim(cfg)))
        self.recompute = "none"  # train.activation_checkpointing (models/recompute.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return run_block(self._forward, self.recompute, x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.init_rope()

    def tie_weights(self) -> None:
        """With model.tie_embeddings, make the head's weight the embedding's Parameter (again
        after `to_empty`, which gives each module a Parameter of its own)."""
        if tied(self.cfg):
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self, device=None) -> None:
        """The rotary tables (buffers, not weights: never saved; a model built empty on the
        meta device computes them again here)."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta,
                               rope_scaling(cfg))
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Which module gets which tensor-parallel treatment (partrain.parallel.tensor.STYLES).

        Attention and MLP are tp regions entered once (one backward all-reduce each); their q/k/v
        and w1/w3 are column-parallel, wo and w2 row-parallel (one forward all-reduce each). The
        embedding and head are split over the vocabulary; the loss reads the sharded logits.
        """
        plan = {"tok_embeddings": "vocab_embedding", "norm": "norm", "output": "vocab_head"}
        for i in self.layers:
            block = f"layers.{i}"
            plan.update({
                f"{block}.attention_norm": "norm",
                f"{block}.attention": "attention",
                f"{block}.attention.wq": "colwise",
                f"{block}.attention.wk": "colwise",
                f"{block}.attention.wv": "colwise",
                f"{block}.attention.wo": "rowwise",
                f"{block}.ffn_norm": "norm",
            })
            if isinstance(self.layers[i].feed_forward, MoE):
                # Experts are replicated within tp (expert parallelism splits them over dp).
                plan[f"{block}.feed_forward"] = "replicated"
                continue
            plan.update({
                f"{block}.feed_forward": "region",
                f"{block}.feed_forward.w1": "colwise",
                f"{block}.feed_forward.w3": "colwise",
                f"{block}.feed_forward.w2": "rowwise",
            })
        return plan

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq); under tensor parallelism the
        last dimension is this rank's vocabulary shard. A pipeline chunk without the embedding
        takes hidden states, one without the head returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h
        return self.output(self.norm(h))

    def pipeline_chunk(self, layer_ids: list[int], first: bool, last: bool) -> "Transformer":
        """A pipeline stage sharing this model's modules: the given blocks (names kept), the
        embedding if first (else it takes hidden states), norm and head if last (else it returns
        hidden states). Parameter names stay those of the full model."""
        chunk = Transformer.__new__(Transformer)
        nn.Module.__init__(chunk)
        chunk.cfg = self.cfg
        chunk.tok_embeddings = self.tok_embeddings if first else None
        chunk.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in layer_ids})
        chunk.norm = self.norm if last else None
        chunk.output = self.output if last else None
        chunk.register_buffer("rope_cos", self.rope_cos, persistent=False)
        chunk.register_buffer("rope_sin", self.rope_sin, persistent=False)
        return chunk


@torch.no_grad()
def init_weights(model: Transformer, std: float, seed: int) -> None:
    """Normal(0, std) matrices, output projections of each block scaled by 1/sqrt(2 * n_layers)
    (GPT-2), norms at one. Drawn in module order from one generator: the seed fixes every weight
    (a tied head's weight is the embedding's, drawn once)."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = std / math.sqrt(2 * model.cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            scale = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
            param.copy_(torch.randn(param.shape, generator=gen) * scale)


def build_model(cfg, seed: int) -> Transformer:
    """The full model in fp32 on the CPU, its weights fixed by the seed."""
    model = Transformer(cfg)
    init_weights(model, cfg.init_std, seed)
    return model

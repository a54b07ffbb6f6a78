"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query causal attention
(the layers are partrain.models.layers; its sizes and FLOPs partrain.models.arith).

Built so that the parallel wrappers can take it apart: separate q/k/v/o and w1/w3/w2 linears
(column- and row-parallel candidates), blocks in a ModuleDict keyed "0".."L-1" (a pipeline stage
deletes the blocks it does not own and keeps the names), embedding, final norm and output head
as separate modules. Weights depend only on the seed, so every layout starts from the same model.

With `tie_embeddings` the head's weight is the embedding's Parameter (Megatron's and Hugging Face's
tied input/output embeddings): one (vocab_size, dim) matrix, counted, initialised and saved once
under the embedding's name. A pipeline stage that has the head but not the embedding keeps a copy
(partrain.parallel.pipeline keeps the copies equal).

Generation has a path of its own, `decode` with a `KVCache` from `kv_cache()` (partrain.interop.
sample): the same layers, keys and values of earlier positions read from the cache. `forward`,
the one trained, never takes it.
"""

import math

import torch
from torch import nn

from partrain.models.arith import ffn_dim, head_dim, is_moe_block, tied
from partrain.models.layers import (
    Attention,
    FeedForward,
    KVCache,
    RMSNorm,
    document_mask,
    rope_scaling,
    rope_tables,
)
from partrain.models.moe import MoE
from partrain.models.recompute import run_block


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return run_block(self._forward, self.recompute, x, cos, sin, mask)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
               layer: int) -> torch.Tensor:
        """`forward` with the attention's keys and values from the cache (`Attention.decode`);
        the MLP or MoE is per token (an MoE's capacity is not: partrain.interop.sample)."""
        h = x + self.attention.decode(self.attention_norm(x), cos, sin, cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


def _on_meta() -> bool:
    """Inside `with torch.device("meta")` (build_model, and the shape checks that build no
    memory). There the constructor draws no embedding and computes no rotary tables, which
    build_model makes again anyway: torch's meta kernels for normal_ and a float64 arange
    import torch._dynamo, 1.7 s of CPU in every rank that builds the model."""
    return torch.empty(0).is_meta


def _embedding(num: int, dim: int) -> nn.Embedding:
    if _on_meta():
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = _embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        if not _on_meta():
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
        cos, sin = rope_tables(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta,
                               rope_scaling(cfg))
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Which module gets which tensor-parallel treatment (partrain.models.tp_plan.STYLES).

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
            if self.layers[i].attention.q_norm is not None:
                # Heads split whole over tp: each rank norms its own heads with the same gains.
                plan[f"{block}.attention.q_norm"] = "head_norm"
                plan[f"{block}.attention.k_norm"] = "head_norm"
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

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq); under tensor parallelism the
        last dimension is this rank's vocabulary shard. A pipeline chunk without the embedding
        takes hidden states, one without the head returns them. `documents` (batch, seq): each
        token's document in its packed sequence (train.document_masking): attention stays
        inside a document."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = None if documents is None else document_mask(documents.to(h.device))
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin, mask)
        if self.output is None:
            return h
        return self.output(self.norm(h))

    def kv_cache(self, batch: int = 1) -> KVCache:
        """An empty cache for `decode`: every layer, model.max_seq_len positions, in the weights'
        dtype and on their device."""
        attention = next(iter(self.layers.values())).attention
        weight = self.tok_embeddings.weight
        return KVCache(len(self.layers), batch, attention.n_kv_heads, self.cfg.max_seq_len,
                       attention.head_dim, weight.dtype, weight.device)

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (batch, seq, vocab) of token ids (batch, seq) that follow the cache's `length`
        positions; their keys and values are added to the cache. What `forward` gives at those
        positions of the whole sequence (cached and new), up to float rounding (the same products
        in other shapes). The whole model on one process: no parallel wrapper applied."""
        end = cache.length + tokens.shape[1]
        if end > cache.max_seq_len:
            raise ValueError(f"{cache.length} cached + {tokens.shape[1]} new positions = {end} "
                             f"> model.max_seq_len={cache.max_seq_len}")
        h = self.tok_embeddings(tokens)
        for layer, block in enumerate(self.layers.values()):
            h = block.decode(h, self.rope_cos, self.rope_sin, cache, layer)
        cache.length = end
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
        elif name.endswith(".bias"):  # q/k/v biases start at zero and draw nothing
            param.zero_()
        else:
            scale = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
            # drawn in place: randn(shape) is normal_(0, 1) on new memory, the same numbers
            param.normal_(0.0, 1.0, generator=gen).mul_(scale)


def build_model(cfg, seed: int) -> Transformer:
    """The full model in fp32 on the CPU, its weights fixed by the seed.

    Built on the meta device and then given memory, as torchtitan does: the layers' own default
    initialisation (nn.Linear's and nn.Embedding's) would draw every weight once more only for
    `init_weights` to overwrite it, half the build's time (13.9 of 29.7 s for the 1B shape on 2
    cores). Memory from `to_empty` holds nothing, so what the constructor computed is made again:
    the tied head, the rotary tables, the MoE blocks' balancing bias (zeros) and step counters.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_rope()
    for module in model.modules():
        if isinstance(module, MoE):
            module.expert_bias.zero_()
            module.reset_stats()
    init_weights(model, cfg.init_std, seed)
    return model

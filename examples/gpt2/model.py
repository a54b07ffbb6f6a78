"""A GPT-2-style decoder as your own model for partrain: learned positions, LayerNorm, a GELU MLP,
biases on the q/k/v and MLP-in projections.

    partrain launch model.target=examples.gpt2.model:build model.args.dim=128 \
        model.args.n_layers=4 model.args.n_heads=4 parallel.dp=2 parallel.tp=2 parallel.pp=2 \
        --nproc-per-node 8 launcher.device=cpu

`build(model_cfg)` reads its keys from `model.args` and the vocabulary and longest sequence from
partrain's `model.vocab_size` and `model.max_seq_len`. What partrain asks of it
(partrain.models.family):

- `forward(tokens) -> logits`;
- `tensor_parallel_plan()`: Megatron's split. Attention and the MLP are tp regions entered once;
  q/k/v and the MLP's first matrix are column-parallel (their biases split with them), the output
  projections row-parallel; the embedding and the head split over the vocabulary (the loss reads
  the sharded logits). Row-parallel layers here have no bias (partrain's RowParallelLinear
  takes none), and the position embedding is added after the vocabulary all-reduce, so this plan
  is for tp without sequence parallelism;
- `layers`, `pipeline_chunk(...)` and `dim`: the pipeline split (stages keep the blocks' names);
- `flops_per_token(seq_len)`: the training FLOPs for MFU (6N plus attention's scores).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        # tp's "attention" style divides both by tp: each rank computes its own heads.
        self.n_heads = self.n_kv_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)),
                                             heads(self.wv(x)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, max_seq_len: int, dim: int, n_layers: int, n_heads: int):
        super().__init__()
        self.dim, self.n_heads = dim, n_heads
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(param)
            elif param.dim() > 1:
                # GPT-2's: 0.02, the residual projections scaled by 1/sqrt(2 * n_layers).
                scale = (2 * n_layers) ** -0.5 if name.endswith(("wo.weight", "down.weight")) else 1
                nn.init.normal_(param, std=0.02 * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:  # the first pipeline stage takes tokens
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(positions)
        for block in self.layers.values():
            x = block(x)
        if self.output is None:  # not the last stage: hidden states go on
            return x
        return self.output(self.norm(x))

    def tensor_parallel_plan(self) -> dict[str, str]:
        plan = {"tok_embeddings": "vocab_embedding", "pos_embeddings": "replicated",
                "norm": "norm", "output": "vocab_head"}
        for i in self.layers:
            block = f"layers.{i}"
            plan.update({f"{block}.ln_1": "norm", f"{block}.ln_2": "norm",
                         f"{block}.attn": "attention", f"{block}.attn.wq": "colwise",
                         f"{block}.attn.wk": "colwise", f"{block}.attn.wv": "colwise",
                         f"{block}.attn.wo": "rowwise",
                         f"{block}.mlp": "region", f"{block}.mlp.up": "colwise",
                         f"{block}.mlp.down": "rowwise"})
        return plan

    def pipeline_chunk(self, layer_ids: list[int], first: bool, last: bool) -> "GPT":
        chunk = GPT.__new__(GPT)
        nn.Module.__init__(chunk)
        chunk.dim, chunk.n_heads = self.dim, self.n_heads
        chunk.tok_embeddings = self.tok_embeddings if first else None
        chunk.pos_embeddings = self.pos_embeddings if first else None
        chunk.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in layer_ids})
        chunk.norm = self.norm if last else None
        chunk.output = self.output if last else None
        return chunk

    def flops_per_token(self, seq_len: int) -> float:
        params = sum(p.numel() for p in self.parameters()) - self.pos_embeddings.weight.numel()
        return 6 * params + 6 * len(self.layers) * self.dim * seq_len


def build(model_cfg) -> GPT:
    args = model_cfg.args
    return GPT(vocab_size=model_cfg.vocab_size, max_seq_len=model_cfg.max_seq_len,
               dim=args.get("dim", 128), n_layers=args.get("n_layers", 4),
               n_heads=args.get("n_heads", 4))

"""Builders a test names as model.target (tests.unit.models.user_models:NAME)."""

import torch
from torch import nn


class Plain(nn.Module):
    """A model that declares nothing: no tp plan, no pipeline split, no blocks."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def plain(model_cfg) -> nn.Module:
    return Plain(model_cfg.vocab_size, model_cfg.args.get("dim", 16))


def half(model_cfg) -> nn.Module:
    """Built in bf16, against the contract (built in fp32; train.dtype is the compute's)."""
    return plain(model_cfg).to(torch.bfloat16)


def broken(model_cfg) -> nn.Module:
    raise ValueError("dim must be even")


def not_a_module(model_cfg):
    return 42


def frozen(model_cfg) -> nn.Module:
    """A fine-tuning habit: the embedding frozen (requires_grad=False), the head trained."""
    model = plain(model_cfg)
    model.embed.weight.requires_grad_(False)
    return model


class Counted(Plain):
    """A persistent buffer the output reads: a count of training forwards that sharpens the
    logits, so a resume that restarted it from the builder's 0 would train another model."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(tokens) * (1 + 0.05 * self.calls)


def counted(model_cfg) -> nn.Module:
    return Counted(model_cfg.vocab_size, model_cfg.args.get("dim", 16))


class Dropped(Plain):
    """Dropout between the embedding and the head: its masks come from torch's generator."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.dropout = nn.Dropout(0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embed(tokens)))


def dropped(model_cfg) -> nn.Module:
    return Dropped(model_cfg.vocab_size, model_cfg.args.get("dim", 16))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    """Embedding, blocks and head with a tp plan and a pipeline split; `embedding` and `head`
    are the names of the first and last modules (GPT-2's in Hugging Face are wte and lm_head)."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, embedding: str = "tok_embeddings",
                 head: str = "output"):
        super().__init__()
        self.dim, self.names = dim, (embedding, head)
        setattr(self, embedding, nn.Embedding(vocab_size, dim))
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(n_layers)})
        setattr(self, head, nn.Linear(dim, vocab_size, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding, head = (getattr(self, name, None) for name in self.names)
        if embedding is not None:
            x = embedding(x)
        for block in self.layers.values():
            x = block(x)
        return x if head is None else head(x)

    def tensor_parallel_plan(self) -> dict[str, str]:
        plan = {self.names[0]: "vocab_embedding", self.names[1]: "vocab_head"}
        for i in self.layers:
            plan.update({f"layers.{i}.norm": "norm", f"layers.{i}.mlp": "region",
                         f"layers.{i}.mlp.up": "colwise", f"layers.{i}.mlp.down": "rowwise"})
        return plan

    def pipeline_chunk(self, layer_ids, first: bool, last: bool) -> nn.Module:
        chunk = Stack.__new__(Stack)
        nn.Module.__init__(chunk)
        chunk.dim, chunk.names = self.dim, self.names
        if first:
            setattr(chunk, self.names[0], getattr(self, self.names[0]))
        chunk.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in layer_ids})
        if last:
            setattr(chunk, self.names[1], getattr(self, self.names[1]))
        return chunk


def _stack(model_cfg, **names) -> Stack:
    return Stack(model_cfg.vocab_size, model_cfg.args.get("dim", 16),
                 model_cfg.args.get("n_layers", 2), **names)


def stack(model_cfg) -> nn.Module:
    return _stack(model_cfg)


def shared_block(model_cfg) -> nn.Module:
    """ALBERT-style sharing: block 1's mlp.up (weight and bias) is block 0's."""
    model = _stack(model_cfg)
    model.layers["1"].mlp.up.weight = model.layers["0"].mlp.up.weight
    model.layers["1"].mlp.up.bias = model.layers["0"].mlp.up.bias
    return model


def tied(model_cfg) -> nn.Module:
    """The input embedding tied to the head by partrain's names (tok_embeddings, output)."""
    model = _stack(model_cfg)
    model.output.weight = model.tok_embeddings.weight
    return model


def tied_hf(model_cfg) -> nn.Module:
    """The same tie by Hugging Face GPT-2's names (wte, lm_head)."""
    model = _stack(model_cfg, embedding="wte", head="lm_head")
    model.lm_head.weight = model.wte.weight
    return model


class Misplanned(Stack):
    """A Stack whose tp plan carries the mistakes users make (each failed inside the ranks):
    an unknown style, a module that is not there, a bias on a rowwise layer."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int):
        super().__init__(vocab_size, dim, n_layers)
        self.layers["0"].mlp.down = nn.Linear(4 * dim, dim)  # with a bias

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {**super().tensor_parallel_plan(), "layers.1.mlp.up": "columnwise",
                "layers.0.ghost": "colwise"}


def misplanned(model_cfg) -> nn.Module:
    return Misplanned(model_cfg.vocab_size, model_cfg.args.get("dim", 16),
                      model_cfg.args.get("n_layers", 2))


class Unplanned(Stack):
    def tensor_parallel_plan(self):
        return None


def unplanned(model_cfg) -> nn.Module:
    return Unplanned(model_cfg.vocab_size, 16, 2)


class HeadWhole(Stack):
    """A Stack whose plan keeps the head whole ("replicated"): every tp rank makes all the
    logits, which the loss would read as a vocabulary shard (trained log(tp) too high)."""

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {**super().tensor_parallel_plan(), "output": "replicated"}


def head_whole(model_cfg) -> nn.Module:
    return HeadWhole(model_cfg.vocab_size, 16, 2)


class HeadColwise(Stack):
    """The head split colwise: its output features are the vocabulary, which is a split of it."""

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {**super().tensor_parallel_plan(), "output": "colwise"}


def head_colwise(model_cfg) -> nn.Module:
    return HeadColwise(model_cfg.vocab_size, 16, 2)


class Unpartnered(Stack):
    """layers.1's MLP splits `up` colwise but keeps `down` whole: up's outputs are each rank's
    1/tp, which the whole `down` cannot read (a shape error at the first step); layers.0's
    `down` is rowwise with a whole `up` before it."""

    def tensor_parallel_plan(self) -> dict[str, str]:
        plan = super().tensor_parallel_plan()
        del plan["layers.1.mlp.down"], plan["layers.0.mlp.up"]
        return plan


def unpartnered(model_cfg) -> nn.Module:
    return Unpartnered(model_cfg.vocab_size, 16, 2)


def wrong_vocab(model_cfg) -> nn.Module:
    """Logits of three classes more than model.vocab_size."""
    return Plain(model_cfg.vocab_size + 3, 16)


class Masked(Plain):
    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens)


def masked(model_cfg) -> nn.Module:
    return Masked(model_cfg.vocab_size, 16)


class Output:
    """What a transformers model returns: an object holding the logits."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class HFLike(Plain):
    def forward(self, tokens: torch.Tensor) -> Output:
        return Output(super().forward(tokens))


def hf_like(model_cfg) -> nn.Module:
    return HFLike(model_cfg.vocab_size, 16)


def lazy(model_cfg) -> nn.Module:
    """An nn.LazyLinear head: its weight's shape comes from the first forward."""
    model = Plain(model_cfg.vocab_size, 16)
    model.head = nn.LazyLinear(model_cfg.vocab_size)
    return model


class MadeInForward(Plain):
    """A bias module made at the first forward: no optimizer ever sees it."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "late"):
            self.late = nn.Linear(16, 16, device=self.embed.weight.device)
        return self.head(self.late(self.embed(tokens)))


def made_in_forward(model_cfg) -> nn.Module:
    return MadeInForward(model_cfg.vocab_size, 16)


def exits(model_cfg) -> nn.Module:
    """A builder that ends the process with exit code 0, as if all went well."""
    import sys

    sys.exit(0)


def _unbiased(model: Stack) -> Stack:
    for block in model.layers.values():
        block.mlp.up = nn.Linear(model.dim, 4 * model.dim, bias=False)
    return model


def stack_unbiased(model_cfg) -> nn.Module:
    """The stack without the MLP's colwise bias: tp-split weights only (FSDP2 with tp cannot
    shard a tp-split bias)."""
    return _unbiased(_stack(model_cfg))


def tied_unbiased(model_cfg) -> nn.Module:
    """`tied` without the MLP's colwise bias."""
    return _unbiased(tied(model_cfg))

"""`partrain sample`: text from a checkpoint, on one process, streamed as it is generated.

The tokenizer is the run's (partrain.data.tokenizer): the byte-level one of the built-in corpus and
of `data prepare` (a token is a byte; the text is UTF-8, decoded incrementally so that a character
split over tokens prints whole), or the tokenizer.json of `data prepare --tokenizer`, kept in
RUN_DIR/tokenizer/ (decoded with the tokenizers library's DecodeStream); its end-of-text token
ends the sample. Each new token is drawn from the last position's logits over the newest
max_seq_len tokens, after temperature and top-k; temperature 0 is greedy, and any other within
float32's range, 1e-45 to 3.4e38 (the logits are divided by it in float32). A seed fixes the draw,
so the same command prints the same text. A checkpoint whose weights hold a nan, or a run dir whose
tokenizer has more tokens than the model's vocabulary, is refused before anything is printed.

The logits come from a KV cache (`Transformer.decode`, as Hugging Face's and gpt-fast's generation
do): the prompt runs once (the prefill), then each new token alone, its attention reading the keys
(rotated at their positions) and values of the tokens before it from the cache of each layer.
Once the text fills max_seq_len positions, the window moves by one token per step and every
position in it changes (rotary positions are absolute, and every hidden state depends on the token
the window dropped), so from there each step runs the whole window from an empty cache: what the
forward without a cache computes, at its cost. An MoE with a capacity (model.moe.capacity_factor)
drops tokens by their place in the whole sequence, so its earlier positions change as the text
grows: it is sampled without the cache. `kv_cache=False` is the full forward over the window for
every token, kept to compare with: the same tokens (tested, greedy and seeded), the logits equal to
float32 rounding, not bit for bit (the same products in other shapes sum in another order).
"""

import math
from typing import Callable

import torch

from partrain.errors import ConfigError
from partrain.interop.finite import non_finite
from partrain.models.moe import MoE

# The logits are divided by the temperature in float32, whose smallest positive number is
# 1.4e-45 (a subnormal): a temperature below 1e-45 rounds to 0 there (and 0 / 0 is nan), one
# above float32's largest number to inf. Within, a tiny one is the greedy draw, as it should be.
TEMPERATURE_MIN = 1e-45
TEMPERATURE_MAX = float(torch.finfo(torch.float32).max)  # 3.4028234663852886e+38


def check_options(prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                  seed: int) -> None:
    if seed >= 2**64:
        raise ConfigError(f"--seed={seed} does not fit in 64 bits")
    if not prompt:
        raise ConfigError("--prompt '' has no tokens: give some text to continue")
    if not (temperature == 0 or TEMPERATURE_MIN <= temperature <= TEMPERATURE_MAX):
        raise ConfigError(
            f"--temperature={temperature} must be a finite number >= 0: 0 (always the most "
            f"likely token) or from {TEMPERATURE_MIN:g} to {TEMPERATURE_MAX:.8g} (float32's "
            "range, in which the logits are divided by it: it rounds a smaller one to 0, a "
            "larger one to inf)")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} must be at least 1")
    if top_k < 0:
        raise ConfigError(f"--top-k={top_k} must be >= 0 (0 = no limit)")


def check_weights(model, checkpoint) -> None:
    """Every weight of the checkpoint's model is a finite number: checked before anything is
    printed, where a nan would otherwise end the sample after its prompt."""
    for name, param in model.named_parameters():
        problem = non_finite(param.detach())
        if problem:
            raise ConfigError(f"{checkpoint}: weight {name} holds {problem}; the model would "
                              "give non-finite logits: nothing to sample from")


def check_vocab(tokenizer, vocab_size: int) -> None:
    """The run's tokenizer has no more tokens than the model has rows: else it is not the
    tokenizer the run trained with (export and sample both refuse it)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the run's tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} "
                          f"tokens, more than the model's model.vocab_size={vocab_size:,}: it is "
                          "not the tokenizer the run trained with; put that one back")


def encode(tokenizer, prompt: str, vocab_size: int) -> list[int]:
    """The prompt's ids under the run's tokenizer, each one a row of the model's embedding."""
    check_vocab(tokenizer, vocab_size)
    if tokenizer.directory is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes of the command line that are not UTF-8
            raise ConfigError(
                f"--prompt {prompt!r} holds bytes that are not UTF-8 text (at character "
                f"{e.start}); the run's tokenizer ({tokenizer.name}) reads text") from None
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} has no tokens under the run's tokenizer "
                          f"({tokenizer.name}): give some text to continue")
    if max(ids) >= vocab_size:
        raise ConfigError(f"--prompt holds token {max(ids)}, which the model's vocabulary "
                          f"(model.vocab_size={vocab_size}) does not have")
    return ids


def next_token(logits: torch.Tensor, temperature: float, top_k: int,
               generator: torch.Generator) -> int:
    """One token from the last position's logits (vocab,)."""
    if not torch.isfinite(logits).all():
        raise ConfigError("the checkpoint's model gives non-finite logits (its weights hold "
                          "inf or nan): nothing to sample from")
    if temperature == 0:
        return int(logits.argmax())
    # Shifted before scaling: a tiny temperature then sends the others to -inf, not inf - inf.
    logits = (logits.float() - logits.max()) / temperature
    if 0 < top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, -math.inf)
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def cache_exact(model) -> bool:
    """Whether the KV cache computes what the full forward does: not for an MoE block with a
    capacity, whose choice of dropped tokens depends on the whole sequence."""
    return not any(isinstance(m, MoE) and m.capacity_factor for m in model.modules())


class Recompute:
    """The last position's logits from the full forward over the newest max_seq_len tokens."""

    def __init__(self, model, max_seq_len: int, device):
        self.model, self.max_seq_len, self.device = model, max_seq_len, device

    def __call__(self, out: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([out[-self.max_seq_len:]], device=self.device))[0, -1]


class Cached:
    """The same logits from a KV cache: only the tokens not yet seen run through the model,
    unless they would pass max_seq_len positions; then the newest max_seq_len tokens are run from
    an empty cache (the window has moved: no cached key or value is still valid)."""

    def __init__(self, model, max_seq_len: int, device):
        self.model, self.max_seq_len, self.device = model, max_seq_len, device
        self.cache = model.kv_cache()
        self.seen = 0  # tokens of `out` run through the model so far

    def __call__(self, out: list[int]) -> torch.Tensor:
        new = out[self.seen:]
        if self.cache.length + len(new) > self.max_seq_len:
            self.cache.length = 0
            new = out[-self.max_seq_len:]
        self.seen = len(out)
        return self.model.decode(torch.tensor([new], device=self.device), self.cache)[0, -1]


@torch.no_grad()
def generate(model, tokenizer, ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
             seed: int, max_seq_len: int, emit: Callable[[str], None],
             kv_cache: bool = True) -> list[int]:
    """Extend `ids` by up to max_new_tokens tokens, passing the decoded text to `emit` as it
    comes; the tokenizer's end-of-text token ends the text early. `kv_cache=False` runs the full
    forward for every token (the same tokens, slower)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    step, flush = tokenizer.decoder(ids)
    use_cache = kv_cache and cache_exact(model)
    logits_of = (Cached if use_cache else Recompute)(model, max_seq_len, device)
    out = list(ids)
    for _ in range(max_new_tokens):
        # Rows past the tokenizer's vocabulary (model.vocab_size padded for tp) are never drawn.
        token = next_token(logits_of(out)[:tokenizer.vocab_size], temperature, top_k, generator)
        out.append(token)
        if token == tokenizer.eot_id:
            break
        text = step(token)
        if text:
            emit(text)
    tail = flush()
    if tail:
        emit(tail)
    return out[len(ids):]

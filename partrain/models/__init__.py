"""Models partrain trains. One for now: a Llama-style decoder (partrain.models.llama)."""

from partrain.models.llama import Transformer, build_model, count_params, flops_per_token

__all__ = ["Transformer", "build_model", "count_params", "flops_per_token"]

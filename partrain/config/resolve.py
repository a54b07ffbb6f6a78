"""Values resolved from the config and the machine, shared by the launcher, the planner and the
workers; no torch."""


def compute_dtype(dtype: str, on_cuda: bool) -> str:
    """train.dtype with `auto` resolved: bf16 on CUDA, fp32 on CPU."""
    return dtype if dtype != "auto" else ("bf16" if on_cuda else "fp32")

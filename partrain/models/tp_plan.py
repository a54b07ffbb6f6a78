"""A user's tensor-parallel plan (model.tensor_parallel_plan(): module name -> style), checked
on the model built on the meta device before anything starts; partrain.parallel.tensor applies
it. The styles are the plan's vocabulary (docs/models.md)."""

from torch import nn

STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "region", "attention", "norm",
          "head_norm", "replicated")

# Where each style splits its module over tp: (attribute holding the split size, its name).
SPLITS = {"colwise": ("out_features", "output features"), "rowwise": ("in_features",
          "input features"), "vocab_head": ("out_features", "vocabulary rows"),
          "vocab_embedding": ("num_embeddings", "vocabulary rows")}


def plan_problems(model: nn.Module, tp: int) -> list[str]:
    """What a model's tensor_parallel_plan() asks that tp ranks cannot do, read from the model
    built on the meta device (partrain's checks, before anything starts): a plan that is no
    mapping, an unknown style, a name that is no module, a split size tp does not divide, a
    bias where only colwise keeps one, heads tp does not divide. Each failed inside the ranks."""
    plan = model.tensor_parallel_plan()
    if not isinstance(plan, dict):
        return [f"tensor_parallel_plan() returned {type(plan).__name__}, not a mapping of module "
                "name -> style"]
    problems = []
    for name, style in plan.items():
        if style not in STYLES:
            problems.append(f"{name}: unknown style {style!r} (styles: {', '.join(STYLES)})")
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            problems.append(f"{name}: the model has no such module")
            continue
        if style in SPLITS:
            attr, what = SPLITS[style]
            size = getattr(module, attr, None)
            if not isinstance(size, int):
                problems.append(f"{name} ({style}): a {type(module).__name__}, not the "
                                f"{'nn.Embedding' if style == 'vocab_embedding' else 'nn.Linear'} "
                                "the style splits")
            elif size % tp:
                problems.append(f"{name} ({style}): its {size} {what} do not split into "
                                f"parallel.tp={tp} equal parts")
            if style != "colwise" and getattr(module, "bias", None) is not None:
                problems.append(f"{name} ({style}): a bias, which only colwise layers keep "
                                "under tp")
        if style == "attention":
            for attr in ("n_heads", "n_kv_heads"):
                heads = getattr(module, attr, None)
                if not isinstance(heads, int):
                    problems.append(f"{name} (attention): no {attr} to split")
                elif heads % tp:
                    problems.append(f"{name} (attention): its {attr}={heads} do not split into "
                                    f"parallel.tp={tp} equal parts")
    return problems

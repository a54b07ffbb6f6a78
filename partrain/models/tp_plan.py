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


def plan_problems(model: nn.Module, tp: int, vocab_size: int | None = None) -> list[str]:
    """What a model's tensor_parallel_plan() asks that tp ranks cannot do, read from the model
    built on the meta device (partrain's checks, before anything starts): a plan that is no
    mapping, an unknown style, a name that is no module, a split size tp does not divide, a
    bias where only colwise keeps one, heads tp does not divide; and no head split over the
    vocabulary (`vocab_size`: model.vocab_size): under tp the loss reads each rank's logits as
    its shard of the vocabulary, and a whole head on every rank trained with a loss log(tp) too
    high and wrong gradients, silently. Each failed inside the ranks, or trained wrong."""
    try:
        plan = model.tensor_parallel_plan()
    except (Exception, SystemExit) as e:  # the user's code raised: name it, partrain's own not
        return [f"tensor_parallel_plan() failed: {type(e).__name__}: {e}"]
    if not isinstance(plan, dict):
        return [f"tensor_parallel_plan() returned {type(plan).__name__}, not a mapping of module "
                "name -> style"]
    problems, vocab_heads, splits = [], [], {}  # over the vocabulary; colwise and rowwise
    for name, style in plan.items():
        if style not in STYLES:
            problems.append(f"{name}: unknown style {style!r} (styles: {', '.join(STYLES)})")
            continue
        if style == "vocab_head":
            vocab_heads.append(name)
        try:
            module = model.get_submodule(name)
        except AttributeError:
            problems.append(f"{name}: the model has no such module")
            continue
        if style in ("colwise", "rowwise"):
            splits[name] = (style, style == "colwise" and vocab_size is not None
                            and getattr(module, "out_features", None) == vocab_size)
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
                count = getattr(module, attr, None)
                if not isinstance(count, int):
                    problems.append(f"{name} (attention): no {attr} to split")
                elif count % tp:
                    problems.append(f"{name} (attention): its {attr}={count} do not split into "
                                    f"parallel.tp={tp} equal parts")
    unpartnered = _unpartnered(plan, splits)
    for name, style in unpartnered:
        if splits[name][1]:  # a colwise head over the vocabulary: the loss reads its split
            vocab_heads.append(name)
        elif style == "colwise":
            problems.append(
                f"{name} (colwise): each rank makes 1/{tp} of its outputs, and no rowwise layer "
                f"{_where(name, plan)} reads them: plan the layer that reads {name}'s outputs "
                f"rowwise, or {name} replicated")
        else:
            problems.append(
                f"{name} (rowwise): it reads each rank's 1/{tp} of its inputs, and no colwise "
                f"layer {_where(name, plan)} makes them: plan the layer before it colwise, or "
                f"{name} replicated")
    if vocab_size is not None and not vocab_heads:
        problems.append(f"no module is planned \"vocab_head\": under tp the loss reads each "
                        f"rank's logits as its 1/{tp} of the vocabulary (model.vocab_size="
                        f"{vocab_size}), so the module that makes the logits must be split over "
                        "it; a whole head on every rank trains with a wrong loss")
    return problems


def _unpartnered(plan: dict, splits: dict[str, tuple[str, bool]]) -> list[tuple[str, str]]:
    """Split linears without their partner, (name, style): a colwise layer's outputs are each
    rank's 1/tp of them, which only a rowwise layer reads (or the loss: a colwise head over the
    vocabulary, `splits`' flag), and a rowwise layer reads nothing else. Each looks for its
    partner in its scope: under its nearest module planned `region` or `attention`, else among
    its siblings.
    Unpartnered, the ranks failed at the first step with a shape error, or where the shapes
    happened to fit, trained wrong. A colwise layer as wide as the vocabulary inside an MLP
    (4 x 64 = 256 bytes) is an MLP's layer, partnered."""
    found = []
    for name, (style, _) in splits.items():
        scope = _scope(name, plan)
        region = plan.get(scope) in ("region", "attention")
        partner = "rowwise" if style == "colwise" else "colwise"
        # inside a region: anywhere under it; else a sibling (the model's own head at the top
        # has no rowwise sibling: it is the head, not an MLP's layer)
        if not any(other_style == partner and (other.startswith(scope + ".") if region else
                                               other.rpartition(".")[0] == scope)
                   for other, (other_style, _) in splits.items()):
            found.append((name, style))
    return found


def _where(name: str, plan: dict) -> str:
    scope = _scope(name, plan)
    return f"in {scope}" if scope else "in the model"


def _scope(name: str, plan: dict) -> str:
    """The nearest module above `name` the plan calls a region (or attention), else its parent
    ("" for the model itself)."""
    parent = name.rpartition(".")[0]
    above = parent
    while above:
        if plan.get(above) in ("region", "attention"):
            return above
        above = above.rpartition(".")[0]
    return parent


def fsdp_sharded(model: nn.Module) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """What FSDP2 must shard again of a plan's tp splits, for a check against its shard count:
    ((name, size), ...) of the weights tp splits by rows (colwise, vocab_head, vocab_embedding),
    which FSDP2 shards on their second dimension (`size`), evenly only; and the names of the
    colwise biases, 1-D and split by tp, which it cannot shard at all. Empty for a plan that
    plan_problems refuses."""
    try:
        plan = model.tensor_parallel_plan()
    except (Exception, SystemExit):
        return (), ()
    rows, biases = [], []
    for name, style in (plan.items() if isinstance(plan, dict) else ()):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        weight = getattr(module, "weight", None)
        if style in ("colwise", "vocab_head", "vocab_embedding") and getattr(
                weight, "ndim", 0) == 2:
            rows.append((name, int(weight.shape[1])))
        if style == "colwise" and getattr(module, "bias", None) is not None:
            biases.append(f"{name}.bias")
    return tuple(rows), tuple(biases)

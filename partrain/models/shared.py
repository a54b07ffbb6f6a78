"""Parameters a user's model shares between modules (one nn.Parameter under two or more names:
GPT-2's input embedding and head by Hugging Face's names wte and lm_head, ALBERT's blocks),
checked against the layout before anything starts, on the model built on the meta device.

Every layout builds the full model and then takes it apart; a shared parameter stays one only
where the parts that hold it stay together, and otherwise becomes copies trained apart (a
silently different model), so such a layout is refused:

- pp: each pp rank keeps its own chunks, so a parameter that the chunks of two ranks hold is a
  copy on each. The exception is the input embedding tied to the head by partrain's names
  (`tok_embeddings.weight` is `output.weight`): partrain.parallel.pipeline keeps its copies on
  the first and last stage equal (their gradients summed).
- tp: a module the plan splits (colwise, rowwise, vocab_embedding, vocab_head) gets new, sharded
  Parameters; partrain.parallel.tensor ties again the `weight`s of planned modules that shared
  one, split on one dimension. So a shared parameter stays one if it is such a weight, or if no
  module holding it is split (a split module's bias is always its own copy).
- FSDP: each block is a unit of its own and the rest of the model another; a parameter belongs
  to one unit, so all its names must lie in one.

DDP and DeepSpeed ZeRO 1-3 keep one parameter on every rank: any sharing trains as it does in
one process (dp2, ZeRO-2 and ZeRO-3 at dp2 checked at parity by hand).
"""

from partrain.errors import ConfigError

TIE = frozenset({"tok_embeddings.weight", "output.weight"})

# The dimension partrain.parallel.tensor splits a planned module's weight on, by style; the other
# styles keep the module's Parameters.
SPLIT_DIM = {"colwise": 0, "vocab_head": 0, "vocab_embedding": 0, "rowwise": 1}

ADVICE = ("give each module its own parameter, name a tied input embedding and head "
          "tok_embeddings and output (pp keeps that tie, and tp when its plan splits both over "
          "the vocabulary), or train on a layout that keeps one copy: dp, or ZeRO with "
          "parallel.zero_backend=deepspeed")


def check_shared_parameters(model, cfg, what: str) -> None:
    """Refuse (one ConfigError: the names, the layout keys, what to do) a parameter of `model`
    that the layout of `cfg` would split into copies; `what` names the model."""
    p = cfg.parallel
    names = _names(model)
    shared = [n for n in names.values() if len(n) > 1]
    broken = []
    if p.pp > 1:
        broken.append((f"parallel.pp={p.pp}", "would train a copy of it on each pipeline stage "
                       "that holds it, and the copies drift apart",
                       _pp_apart(model, p, names, what)))
    if p.tp > 1:
        broken.append((f"parallel.tp={p.tp}", "would shard it into separate copies (one "
                       "parameter stays one under tp only as the weight of modules its plan "
                       "splits alike, or of modules it does not split)",
                       _tp_apart(model, shared, what)))
    if p.zero_backend == "fsdp":
        broken.append(("parallel.zero_backend=fsdp", "would fail as it builds (it shards each "
                       "block as a unit of its own, and a parameter can be in one unit only)",
                       _fsdp_apart(model, shared)))
    clauses = [f"{key} {why}: {_shown(groups)}" for key, why, groups in broken if groups]
    if clauses:
        raise ConfigError(f"{what}: a parameter your model shares between modules (one "
                          f"Parameter under several names) would not stay one: "
                          f"{'; '.join(clauses)}; {ADVICE}")


def _names(model) -> dict[int, list[str]]:
    """Every parameter's names in the full model, by the parameter's id."""
    out: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(param), []).append(name)
    return out


def _shown(groups: list[list[str]], most: int = 4) -> str:
    shown = ", ".join(" = ".join(names) for names in groups[:most])
    return shown + (f" and {len(groups) - most} more" if len(groups) > most else "")


def _pp_apart(model, p, names: dict[int, list[str]], what: str) -> list[list[str]]:
    """The parameters the chunks of two pp ranks hold (chunk s is rank s % pp's, as
    partrain.parallel.pipeline builds them), but the tie it keeps. Nothing when the stage sizes
    are not valid: check_pipeline refuses them next."""
    stages = p.pp * p.pp_virtual_stages
    blocks = len(model.layers)
    counts = list(p.pp_layers) if p.pp_layers is not None else [blocks // stages] * stages
    if not all(isinstance(n, int) for n in counts) or len(counts) != stages \
            or sum(counts) != blocks or min(counts) < 1:
        return []
    ranks: dict[int, set[int]] = {}
    start = 0
    for stage, count in enumerate(counts):
        ids = range(start, start + count)
        start += count
        try:
            chunk = model.pipeline_chunk(ids, first=stage == 0, last=stage == stages - 1)
            params = list(chunk.parameters())
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's split: its error
            raise ConfigError(f"{what}: pipeline_chunk({list(ids)}, first={stage == 0}, "
                              f"last={stage == stages - 1}) failed: "
                              f"{type(e).__name__}: {e}") from None
        for param in params:
            ranks.setdefault(id(param), set()).add(stage % p.pp)
    return [n for key, n in names.items() if len(ranks.get(key, ())) > 1 and set(n) != TIE]


def _tp_apart(model, shared: list[list[str]], what: str) -> list[list[str]]:
    """The shared parameters the plan would shard into separate copies."""
    try:
        plan = dict(model.tensor_parallel_plan())
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's plan: its error
        raise ConfigError(f"{what}: tensor_parallel_plan() failed: "
                          f"{type(e).__name__}: {e}") from None

    def split(name: str):
        """None: tp keeps this name's Parameter; else how it is split (a weight, by its
        dimension) or the name itself (any other Parameter of a split module: its own copy)."""
        owner, _, leaf = name.rpartition(".")
        if plan.get(owner) not in SPLIT_DIM:
            return None
        return ("weight", SPLIT_DIM[plan[owner]]) if leaf == "weight" else name

    return [n for n in shared if len({split(name) for name in n}) > 1]


def _fsdp_apart(model, shared: list[list[str]]) -> list[list[str]]:
    """The shared parameters whose names lie in two FSDP units: the blocks (`layers`, as
    partrain.models.family.blocks finds them) and the rest."""
    from torch import nn

    layers = getattr(model, "layers", None)
    keys = layers.keys() if isinstance(layers, nn.ModuleDict) \
        else range(len(layers)) if isinstance(layers, nn.ModuleList) else ()
    prefixes = [f"layers.{key}." for key in keys]

    def unit(name: str) -> str:
        return next((prefix for prefix in prefixes if name.startswith(prefix)), "")

    return [n for n in shared if len({unit(name) for name in n}) > 1]

"""The forward's contract (docs/models.md, "Your own model"), for a user's model: partrain calls
`forward(tokens)`, the token ids (batch, seq) its one positional argument and nothing else, and
reads logits (batch, seq, model.vocab_size) from it.

Checked twice. Before anything starts, on the model built on the meta device
(partrain.models.family.check_user_model): the signature, always (call_problem), and the output
where the meta device can run the forward (forward_problems). A forward it cannot run (a value
read out with .item(), an op without a meta kernel) is checked at its first step instead, on
every rank, by the loss (partrain.train.step.loss_function): the same words, raised as
ForwardContract, which the launcher says as the error and exits 2 on
(partrain.launch.local.STOPPED). Building the model for real before the start to run it would
put the whole model in the launcher's memory, and such a forward often cannot run on the CPU
either (CUDA-only kernels); torchtitan and Hugging Face's Trainer learn the output at the first
step too.
"""


class ForwardContract(Exception):
    """A forward that broke the contract at the first step on a rank (its output, where the meta
    device could not run it before the start): the launcher says the message and exits 2
    (partrain.launch.local.STOPPED)."""


def forward_problems(model, model_cfg) -> list[str]:
    """The contract read on the meta model, before the start. A forward that needs a mask too,
    or takes the tokens by keyword only, failed inside every rank with a TypeError, a
    transformers model (its output an object) with an AttributeError; logits of another size
    trained on without a word. A forward the meta device cannot run is no verdict here."""
    import torch

    called = call_problem(model)
    if called:
        return [called]
    seq = max(1, min(8, int(model_cfg.get("max_seq_len") or 8)))
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, seq, dtype=torch.long, device="meta"))
    except (Exception, SystemExit):  # noqa: BLE001 - not a verdict: the first step checks it
        return []
    wrong = output_problem(out, [1, seq], model_cfg.vocab_size)
    return [wrong] if wrong else []


def call_problem(model) -> str | None:
    """Why forward(tokens) cannot bind to the model's forward, in words: the token ids are its
    one positional argument, and nothing else is passed (a keyword-only `input_ids` took no
    positional argument; an `attention_mask` without a default was missing)."""
    import inspect

    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: no signature to read
        return None
    # A forward pre-hook may supply what the call lacks (with_kwargs=True): the ranks judge.
    if getattr(model, "_forward_pre_hooks", None):
        return None
    try:
        signature.bind(object())
    except TypeError as e:
        shown = signature.replace(parameters=[p.replace(annotation=p.empty)
                                              for p in signature.parameters.values()],
                                  return_annotation=signature.empty)
        return (f"its forward{shown} cannot be called as forward(tokens) ({e}): partrain passes "
                "the token ids (batch, seq) as its one positional argument and nothing else; "
                "take them positionally and give every other argument a default")
    return None


def output_problem(out, tokens_shape, vocab_size: int | None) -> str | None:
    """What is wrong with a forward's output for tokens of `tokens_shape`, against the contract
    (logits, batch x seq x `vocab_size`; None: the width is checked elsewhere, the loss's under
    tp), in the words said before the start (the meta model) and at the first step alike."""
    import torch

    if not isinstance(out, torch.Tensor):
        hint = (" (a transformers model: return its output's .logits)" if hasattr(out, "logits")
                else " (return the logits alone)" if isinstance(out, (tuple, list, dict)) else "")
        return (f"its forward(tokens) returns {type(out).__name__}, not the logits tensor "
                f"(batch, seq, vocabulary){hint}")
    tokens_shape = list(tokens_shape)
    if (out.dim() != len(tokens_shape) + 1 or list(out.shape[:-1]) != tokens_shape
            or (vocab_size is not None and out.shape[-1] != vocab_size)):
        width = f"model.vocab_size={vocab_size}" if vocab_size is not None else "vocabulary"
        return (f"its forward(tokens) returns logits of shape {list(out.shape)} for tokens of "
                f"{tokens_shape}; partrain needs (batch, seq, {width})")
    return None

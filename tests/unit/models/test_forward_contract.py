"""A user's forward against the contract partrain calls it by (docs/models.md): forward(tokens),
the token ids its one positional argument, logits (batch, seq, model.vocab_size) out. The user
models are written as files, each a module of its own, into the test's tmp dir."""

import uuid
from types import SimpleNamespace

import pytest
import torch

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)

    def forward{signature}:
        {body}


def build(model_cfg):
    return Net(model_cfg.vocab_size)
'''


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    """Write a model whose forward is `signature` (without self) running `body` into the tmp dir,
    importable from there; its model.target."""
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.syspath_prepend(str(models))

    def write(signature: str, body: str) -> str:
        name = f"net_{uuid.uuid4().hex[:12]}"  # each its own module: none cached from another
        (models / f"{name}.py").write_text(NET.format(signature=signature, body=body))
        return f"model.target={name}:build"

    return write


@pytest.mark.parametrize("signature, body, fragment", [
    # The reviewer's Net2: it passed the check, then every rank failed with "TypeError:
    # Net2.forward() takes 1 positional argument but 2 were given", exit 1, its run dir written.
    ("(self, *, input_ids)", "return self.head(self.embed(input_ids))",
     "its forward(*, input_ids) cannot be called as forward(tokens) (too many positional "
     "arguments)"),
    # A mask by keyword only, without a default: missing at every rank's first call.
    ("(self, tokens, *, attention_mask)", "return self.head(self.embed(tokens))",
     "its forward(tokens, *, attention_mask) cannot be called as forward(tokens) (missing a "
     "required argument: 'attention_mask')"),
], ids=["keyword-only-tokens", "keyword-only-mask"])
def test_a_forward_that_cannot_take_the_tokens_positionally_is_refused_before_the_start(
        run_main, user_model, tmp_path, signature, body, fragment):
    run_dir = tmp_path / "run"
    res = run_main("launch", user_model(signature, body), "launcher.device=cpu",
                   "--run-dir", str(run_dir))
    said = " ".join(res.stderr.split())
    assert res.code == 2, said[-3000:]
    assert fragment in said, said
    assert ("partrain passes the token ids (batch, seq) as its one positional argument and "
            "nothing else; take them positionally and give every other argument a default") \
        in said, said
    assert "Traceback" not in said
    assert not run_dir.exists()


@pytest.mark.parametrize("signature, body", [
    # a transformers model's keywords, all with defaults: the tokens come as input_ids
    ("(self, input_ids=None, attention_mask=None)", "return self.head(self.embed(input_ids))"),
    ("(self, tokens, *, attention_mask=None)", "return self.head(self.embed(tokens))"),
    ("(self, *args, **kwargs)", "return self.head(self.embed(args[0]))"),
], ids=["transformers-keywords", "optional-keyword-mask", "varargs"])
def test_a_forward_callable_as_forward_tokens_passes(run_main, user_model, signature, body):
    res = run_main("launch", "--dry-run", user_model(signature, body), "launcher.device=cpu")
    assert res.code == 0, res.stderr
    assert "nothing started" in res.stdout, res.stdout


def _wider(logits: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([logits, torch.zeros(*logits.shape[:-1], extra)], dim=-1)


@pytest.mark.parametrize("tp, made, fragment", [
    # A forward the meta device cannot run (it reads a value out with .item()) passes the check
    # before the start; its tuple failed inside every rank as "AttributeError: 'tuple' object
    # has no attribute 'flatten'", exit 1.
    (1, lambda logits: (logits, 0.5), "its forward(tokens) returns tuple, not the logits tensor "
                                      "(batch, seq, vocabulary) (return the logits alone)"),
    (2, lambda logits: (logits[..., :128], 0.5), "its forward(tokens) returns tuple"),
    # 300 classes for a vocabulary of 256 trained on without a word.
    (1, lambda logits: _wider(logits, 44), "its forward(tokens) returns logits of shape "
                                           "[2, 8, 300] for tokens of [2, 8]; partrain needs "
                                           "(batch, seq, model.vocab_size=256)"),
], ids=["tuple", "tuple-under-tp", "wrong-width"])
def test_an_output_that_breaks_the_contract_stops_the_ranks_with_its_message_and_exit_2(
        tp, made, fragment):
    """The loss checks the output first (train/step.py): what the meta model's check says before
    the start, raised as an error the launcher says as its message, exit 2."""
    from partrain.launch.local import stopped
    from partrain.train.step import loss_function

    # A stand-in for a tp=2 mesh (two ranks do not fit one process): the output is checked
    # before the group is used.
    dims = SimpleNamespace(tp_enabled=tp > 1, tp=tp)
    mesh = {"tp": SimpleNamespace(get_group=lambda: None)}
    loss = loss_function(dims, mesh, vocab_size=256, what="model.target=net:build")
    with pytest.raises(Exception) as raised:
        loss(made(torch.zeros(2, 8, 256)), torch.zeros(2, 8, dtype=torch.long))
    # A rank's error file holds "Type: message" (torch's @record); the launcher reads that.
    recorded = f"{type(raised.value).__name__}: {raised.value}"
    said, code = stopped(recorded) or (recorded, 1)
    assert code == 2 and said.startswith("model.target=net:build: " + fragment), recorded

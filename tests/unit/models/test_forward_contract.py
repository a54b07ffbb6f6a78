"""A user's forward against the contract partrain calls it by (docs/models.md): forward(tokens),
the token ids its one positional argument, logits (batch, seq, model.vocab_size) out. The user
models are written as files, each a module of its own, into the test's tmp dir."""

import uuid

import pytest

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

"""The built-in language model (``gpt``) on the ``text`` format with PyTorch, in one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hvdtrain.driver import make_dataset, train
from hvdtrain.torch.lm import GPT, Block, Embeddings, Head
from tests.conftest import quiet_config, read_jsonl
from tests.text_data import LM_CONFIGS, assert_learned_context, docs_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return docs_corpus(tmp_path_factory.mktemp("text") / "docs")


def test_gpt_trains_on_the_docs_and_perplexity_falls(corpus, tmp_path):
    cfg = quiet_config(LM_CONFIGS["torch"], tmp_path, f"data.options.root={corpus}",
                       "data.batch_size=32", "train.max_steps=200")
    result = train(cfg)
    final = result.summary["final"]
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    first = records[0]
    assert first["step"] == 10 and first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert_learned_context(corpus, first, final)
    assert final["eval_perplexity"] == pytest.approx(math.exp(final["eval_loss"]))
    assert final["eval_token_accuracy"] > 0.2  # always a space would score about 0.15
    assert sum("eval_perplexity" in r for r in records) >= 2  # after epoch 1 (< 200 steps), the last


def test_the_layers_are_the_model(corpus):
    spec = make_dataset(quiet_config(LM_CONFIGS["torch"], corpus,
                                     f"data.options.root={corpus}")).spec()
    adapter = GPT(layers=3, d_model=32, heads=2)
    factories = adapter.layers(spec)
    assert [type(make()) for make in factories] == [Embeddings, Block, Block, Block, Head]
    torch.manual_seed(0)
    model = adapter.build(spec)
    torch.manual_seed(0)
    pieces = [make() for make in factories]  # built one by one, as a pipeline stage would
    assert isinstance(model, nn.Sequential)
    for a, b in zip(model.parameters(), nn.Sequential(*pieces).parameters(), strict=True):
        assert torch.equal(a, b)
    tokens = torch.randint(0, 256, (3, 64))
    hidden = pieces[0](tokens)
    assert hidden.shape == (3, 64, 32)
    for piece in pieces[1:-1]:
        hidden = piece(hidden)
    logits = pieces[-1](hidden)
    assert logits.shape == (3, 64, 256) and torch.equal(logits, model(tokens))
    loss, metrics = adapter.loss_and_metrics(model, tokens, tokens)
    expected = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens.reshape(-1)) * 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    right = logits.argmax(-1).eq(tokens).float().mean(dim=1).sum()
    assert metrics["token_accuracy"].item() == pytest.approx(right.item())
    empty = adapter.output_loss(logits[:0], tokens[:0])
    assert empty[0].item() == 0.0 and empty[1]["token_accuracy"].item() == 0.0


def test_causal_a_token_never_sees_the_tokens_after_it(corpus):
    spec = make_dataset(quiet_config(LM_CONFIGS["torch"], corpus,
                                     f"data.options.root={corpus}")).spec()
    model = GPT(layers=2, d_model=32, heads=4).build(spec)
    tokens = torch.randint(0, 256, (2, 64))
    changed = tokens.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :40], b[:, :40], rtol=0, atol=1e-6)
    assert (a[:, 40:] - b[:, 40:]).abs().amax(dim=-1).min() > 1e-4  # every later position moved

"""The built-in language model (``gpt``) on the ``text`` format with TensorFlow, in one process,
and the same logits as the PyTorch model given the same weights."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.driver import train
from hvdtrain.tensorflow.lm import GPT, Block, Embeddings, Head
from tests.conftest import quiet_config, read_jsonl
from tests.text_data import LM_CONFIGS, assert_learned_context, docs_corpus

SPEC = DatasetSpec(inputs=ArraySpec((16,), "int64"), targets=ArraySpec((16,), "int64"),
                   num_classes=50)


def test_gpt_trains_on_the_docs_and_perplexity_falls(tmp_path):
    corpus = docs_corpus(tmp_path / "docs")
    cfg = quiet_config(LM_CONFIGS["tensorflow"], tmp_path, f"data.options.root={corpus}",
                       "data.batch_size=32", "train.max_steps=200")
    result = train(cfg)
    final = result.summary["final"]
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["step"] == 10 and first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert_learned_context(corpus, first, final)
    assert final["eval_perplexity"] == pytest.approx(math.exp(final["eval_loss"]))
    assert final["eval_token_accuracy"] > 0.2  # always a space would score about 0.15


def test_the_layers_are_the_model():
    adapter = GPT(layers=2, d_model=32, heads=4)
    pieces = [make() for make in adapter.layers(SPEC)]
    assert [type(p) for p in pieces] == [Embeddings, Block, Block, Head]
    model = adapter.build(SPEC)
    assert isinstance(model, keras.Sequential) and len(model.trainable_variables) == 29
    tokens = np.random.default_rng(0).integers(0, 50, (3, 16))
    logits = model(tokens)
    assert tuple(logits.shape) == (3, 16, 50)
    loss, metrics = adapter.loss_and_metrics(model, tokens, tokens, training=False)
    expected = keras.losses.sparse_categorical_crossentropy(tokens, logits, from_logits=True)
    assert float(loss) == pytest.approx(float(np.mean(expected)) * 3, rel=1e-5)
    right = np.mean(np.argmax(logits.numpy(), axis=-1) == tokens, axis=1).sum()
    assert float(metrics["token_accuracy"]) == pytest.approx(right)
    empty_loss, empty = adapter.output_loss(logits[:0], tokens[:0])
    assert float(empty_loss) == 0.0 and float(empty["token_accuracy"]) == 0.0


def test_the_same_weights_give_the_torch_models_logits():
    """Each Keras sub-layer carries the name of the torch attribute it mirrors: copying the torch
    model's weights in (a ``Linear`` weight transposed into a ``Dense`` kernel) gives its logits."""
    import torch

    from hvdtrain.torch.lm import GPT as TorchGPT

    options = {"layers": 2, "d_model": 32, "heads": 4}
    torch_model, keras_model = TorchGPT(**options).build(SPEC), GPT(**options).build(SPEC)
    for torch_layer, keras_layer in zip(torch_model, keras_model.layers, strict=True):
        for name, module in torch_layer.named_children():
            if isinstance(module, torch.nn.Dropout):
                continue
            weights = [p.detach().numpy() for p in module.parameters()]
            if isinstance(module, torch.nn.Linear):
                weights[0] = weights[0].T
            getattr(keras_layer, name).set_weights(weights)
    tokens = np.random.default_rng(1).integers(0, 50, (4, 16))
    expected = torch_model(torch.from_numpy(tokens)).detach().numpy()
    np.testing.assert_allclose(keras_model(tokens, training=False).numpy(), expected,
                               rtol=0, atol=1e-6)

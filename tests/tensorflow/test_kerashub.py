"""kerashub_causal_lm in one process: models from a config take the corpus's vocabulary, score
with the built-in gpt's loss, and refuse what they cannot do in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError

pytest.importorskip("keras_hub")
from hvdtrain.tensorflow.kerashub import KerasHubCausalLM

SPEC = DatasetSpec(inputs=ArraySpec((16,), "int64"), targets=ArraySpec((16,), "int64"),
                   num_classes=50)


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_a_model_from_a_config_scores_token_windows(architecture):
    """Logits over the corpus's 50 tokens; a random model's loss is near ln 50."""
    adapter = KerasHubCausalLM(architecture=architecture, config={"num_layers": 1})
    model = adapter.build(SPEC)
    x = np.random.default_rng(0).integers(0, 50, (4, 16)).astype(np.int64)
    assert tuple(model(x).shape) == (4, 16, 50)
    loss_sum, metrics = adapter.loss_and_metrics(model, x, x, training=False)
    assert abs(float(loss_sum) / 4 - math.log(50)) < 0.5
    assert 0.0 <= float(metrics["token_accuracy"]) <= 4.0


def test_refusals_are_one_line():
    with pytest.raises(HvdtrainError, match="vocabulary of 40 tokens is smaller than the data"):
        KerasHubCausalLM(vocab_size=40).build(SPEC)
    with pytest.raises(HvdtrainError, match="8 positions, fewer than the data's seq_len=16"):
        KerasHubCausalLM(config={"max_sequence_length": 8}).build(SPEC)
    with pytest.raises(HvdtrainError, match=r"gpt2: unknown num_layerz \(known: vocabulary_size, "):
        KerasHubCausalLM(config={"num_layerz": 1}).build(SPEC)
    with pytest.raises(HvdtrainError, match="pipeline stages are not supported"):
        KerasHubCausalLM().layers(SPEC)

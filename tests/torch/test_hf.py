"""hf_causal_lm in process: the three architectures built from a config (tiny), and the data
and models it refuses with one line."""

from __future__ import annotations

import pytest
import torch

from hvdtrain.data.contracts import ArraySpec, DatasetSpec
from hvdtrain.errors import HvdtrainError

pytest.importorskip("transformers")
from hvdtrain.torch.hf import HfCausalLM

WINDOW = ArraySpec((16,), "int64")
TEXT = DatasetSpec(inputs=WINDOW, targets=WINDOW, num_classes=256)


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "qwen2"])
def test_each_architecture_builds_from_a_config_and_scores_a_batch(architecture):
    adapter = HfCausalLM(architecture=architecture, config={"hidden_size": 32} if
                         architecture != "gpt2" else {"n_embd": 32})
    torch.manual_seed(0)
    model = adapter.build(TEXT)
    assert model.config.vocab_size == 256 and model.config.model_type == architecture
    x = torch.randint(0, 256, (3, 16))
    loss, metrics = adapter.loss_and_metrics(model, x, x)
    # A sum over 3 sequences of each one's mean token cross-entropy: near 3 ln 256 untrained.
    assert 3 * 4.0 < float(loss.detach()) < 3 * 7.0 and set(metrics) == {"token_accuracy"}


def test_data_and_model_that_do_not_fit_are_refused():
    with pytest.raises(HvdtrainError, match="vocabulary of 100 tokens is smaller than the data's "
                                            "256"):
        HfCausalLM(vocab_size=100).build(TEXT)
    with pytest.raises(HvdtrainError, match="8 positions, fewer than the data's seq_len=16"):
        HfCausalLM(config={"n_positions": 8}).build(TEXT)
    images = DatasetSpec(inputs=ArraySpec((4, 4), "float32"), targets=ArraySpec((), "int64"),
                         num_classes=10)
    with pytest.raises(HvdtrainError, match="needs token windows"):
        HfCausalLM().build(images)
    with pytest.raises(HvdtrainError, match="pipeline stages are not supported"):
        HfCausalLM().layers(TEXT)


def test_gradient_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for checkpointing in (False, True):
        adapter = HfCausalLM(gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        model = adapter.build(TEXT).train()
        assert model.is_activation_checkpointing == checkpointing
        loss, _ = adapter.loss_and_metrics(model, x, x)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-6)

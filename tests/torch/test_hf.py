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
    with pytest.raises(HvdtrainError, match=r"pipeline stages need the head untied from the "
                                            r"token embedding .*untie_embeddings=true"):
        HfCausalLM().layers(TEXT)


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "qwen2"])
def test_the_layers_chained_give_the_models_logits_and_gradients(architecture):
    """Pipeline stages' layer list: the embedding, each block (its causal mask and positions
    made inside), the final norm with the head; chained, the whole model's logits, and the
    gradients reach the model's own parameters."""
    adapter = HfCausalLM(architecture=architecture, untie_embeddings=True)
    torch.manual_seed(0)
    model = adapter.build(TEXT)
    torch.manual_seed(0)
    layers = adapter.layers(TEXT)
    assert [layer.name for layer in layers] == ["embedding", "block.0", "block.1", "head"]
    chained = torch.nn.Sequential(*(make() for make in layers))
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    x = torch.randint(0, 256, (3, 16))
    whole = model(input_ids=x).logits
    torch.testing.assert_close(chained(x), whole, rtol=0, atol=1e-6)
    for p, q in zip(chained.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # the same values, from one seed
    adapter.output_loss(chained(x), x)[0].backward()
    assert all(p.grad is not None for p in chained.parameters())


def test_a_tied_weight_is_in_no_unit_and_a_base_model_never_one():
    """Stage 3's cut of a tied GPT-2: the token embedding (the head's weight) is in no unit;
    the transformers base model (whose output a backward hook cannot see) is cut into its
    blocks even where it fits one unit."""
    from hvdtrain.torch.units import find_units

    for untie in (False, True):
        model = HfCausalLM(untie_embeddings=untie).build(TEXT)
        names = {id(m): n for n, m in model.named_modules()}
        units = [names[id(u)] for u in find_units(model, 64 << 20)]
        head = [] if not untie else ["lm_head"]
        assert units == ["transformer.wte", "transformer.wpe", "transformer.h.0",
                         "transformer.h.1", "transformer.ln_f", *head][int(not untie):], units


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


def test_token_hits_count_argmax_and_the_loss_is_the_built_in_gpts():
    """token_accuracy without argmax: the same count wherever the top logit is unique (planted
    hits and random logits), none for constant logits; the loss is the built-in gpt's."""
    from hvdtrain.torch.hf import token_hits
    from hvdtrain.torch.lm import GPT

    torch.manual_seed(0)
    logits = torch.randn(4, 16, 256)
    y = torch.randint(0, 256, (4, 16))
    y[:, :6] = logits[:, :6].argmax(-1)
    assert int(token_hits(logits, y)) == int(logits.argmax(-1).eq(y).sum()) >= 24
    assert int(token_hits(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long))) == 0
    got, want = HfCausalLM().output_loss(logits, y), GPT().output_loss(logits, y)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1]["token_accuracy"], want[1]["token_accuracy"], rtol=0, atol=0)

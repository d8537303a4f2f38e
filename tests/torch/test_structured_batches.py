"""Batches of any structure with PyTorch: a language model's ``(tokens, next_tokens)`` pairs from a
user's map-style ``torch.utils.data.Dataset`` train under ``data.name=torch_dataset`` (through
worker processes too, and with an empty micro-batch), and so do inputs without any targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data import tree
from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.torch.data import TorchDatasetSource
from tests.conftest import CONFIG, quiet_config

VOCAB, T = 16, 8


def sequences(count: int, seed: int) -> np.ndarray:
    """``count`` sequences of ``T + 1`` tokens, each the last one's ``(3 t + 1) mod VOCAB``: a
    rule an embedding and a linear layer learn."""
    tokens = np.empty((count, T + 1), np.int64)
    tokens[:, 0] = np.random.default_rng(seed).integers(0, VOCAB, count)
    for t in range(T):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % VOCAB
    return tokens


class NextTokens(torch.utils.data.Dataset):
    """What every language-model dataset yields: ``(tokens, next_tokens)``, int64 ``[T]`` each."""

    def __init__(self, count: int, seed: int) -> None:
        self.tokens = torch.from_numpy(sequences(count, seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class MaskedTokens(NextTokens):
    """Inputs alone, no targets: a dict of the sequence and a mask of the positions to predict."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(T + 1, dtype=torch.bool)
        mask[0] = False  # the first token has nothing before it
        return {"tokens": self.tokens[index], "mask": mask}


class TokenModel(ModelAdapter):
    """An embedding and a linear layer; the loss is the per-token cross entropy summed."""

    def build(self, spec):
        assert spec.num_classes is None and spec.targets.shape == (T,)
        return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))

    def loss_and_metrics(self, model, x, y, training=True):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (len(x), T)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
        correct = logits.detach().argmax(-1).eq(y).sum() / T  # a sample's share of right tokens
        return loss, {"token_accuracy": correct}


class SelfSupervised(TokenModel):
    """The loss from the inputs alone: each masked position predicted from the token before it."""

    def build(self, spec):
        assert spec.targets is None and spec.inputs["mask"].dtype == "bool"
        return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))

    def loss_and_metrics(self, model, x, y, training=True):
        assert y is None and set(x) == {"tokens", "mask"}
        logits = model(x["tokens"][:, :-1])
        target, mask = x["tokens"][:, 1:], x["mask"][:, 1:]
        losses = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        return (losses * mask).sum(), {"token_accuracy": logits.detach().argmax(-1).eq(target).sum() / T}


def run(tmp_path, dataset, model, *overrides):
    here = "tests.torch.test_structured_batches"
    return train(quiet_config(
        CONFIG, tmp_path, "data.name=torch_dataset", f"model.name={here}:{model}", "model.options={}",
        f"data.options={{train: {here}:{dataset}, test: {here}:{dataset}, "
        "train_options: {count: 20, seed: 0}, test_options: {count: 16, seed: 1}}",
        # 20 samples, 8 a micro-batch, 2 a step: each epoch's second step is 4 samples and an
        # empty micro-batch.
        "data.batch_size=8", "train.backward_passes_per_step=2", "train.epochs=15",
        "optim.name=adam", "optim.lr=0.05", "optim.warmup_steps=0", "optim.schedule=constant",
        *overrides))


def test_token_pairs_train_under_torch_dataset_in_process_and_in_workers(tmp_path):
    inline = run(tmp_path / "inline", "NextTokens", "TokenModel", "data.workers=0")
    final = inline.summary["final"]
    assert inline.summary["steps"] == 30 and inline.summary["samples"] == 300
    assert final["eval_loss"] < 0.2 * T * math.log(VOCAB)  # from a uniform guess's 22.2
    assert final["eval_token_accuracy"] > 0.9
    workers = run(tmp_path / "workers", "NextTokens", "TokenModel", "data.workers=2")
    for key, value in inline.engine.parameters().items():
        assert np.array_equal(workers.engine.parameters()[key], value), key


def test_inputs_without_targets_train(tmp_path):
    result = run(tmp_path, "MaskedTokens", "SelfSupervised", "data.workers=1")
    assert result.summary["steps"] == 30
    assert result.summary["final"]["eval_loss"] < 0.2 * T * math.log(VOCAB)
    assert result.summary["final"]["eval_token_accuracy"] > 0.9


def test_a_torch_dataset_of_any_structure_gives_empty_batches_of_its_structure():
    source = TorchDatasetSource(MaskedTokens(4, 0), "train dataset masked")
    empty = source.load(np.zeros(0, np.int64))
    assert tree.describe((empty.x, empty.y)) == "({'mask': bool[0, 9], 'tokens': int64[0, 9]}, None)"
    pairs = TorchDatasetSource(NextTokens(4, 0), "train dataset pairs")
    assert tree.describe(pairs.load(np.array([3, 0])).x) == "int64[2, 8]"
    assert tree.describe(pairs.load(np.zeros(0, np.int64)).y) == "int64[0, 8]"
    assert not pairs.classify and pairs.spec(None).num_classes is None


class Ragged(NextTokens):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :index + 2], self.tokens[index, 1:]


def test_items_that_cannot_make_one_batch_are_named():
    source = TorchDatasetSource(Ragged(4, 0), "train dataset ragged")
    with pytest.raises(HvdtrainError, match=r"train dataset ragged\[1...\] inputs: samples of "
                       r"different shapes \[\(3,\), \(4,\)\]"):
        source.load(np.array([1, 2]))


def test_a_built_in_classifier_on_token_data_says_what_it_needs(tmp_path):
    with pytest.raises(HvdtrainError, match=r"model mlp is a classifier: it needs one float input array "
                       r"and num_classes; the dataset gives inputs int64\[8\] and no num_classes"):
        run(tmp_path, "NextTokens", "TokenModel", "model.name=mlp")

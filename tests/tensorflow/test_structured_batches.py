"""Batches of any structure with TensorFlow: a user's dataset of in-memory token arrays, dict
inputs with a mask and next-token targets, trains (on the training thread and through ``tf.data``
workers alike, with an empty micro-batch); inputs without targets train too; the step's input
signature comes from the dataset's spec, and a batch that does not fit the spec is named."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import ArraySpec, BuiltDataset, DatasetSpec, Draw, Source, Split
from hvdtrain.driver import train
from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.data import batch_signature
from hvdtrain.tensorflow.engine import TensorFlowEngine  # noqa: F401  (TensorFlow sets its variables on import)
from tests.conftest import TF_CONFIG, quiet_config

VOCAB, T = 16, 8
HERE = "tests.tensorflow.test_structured_batches"


def sequences(count: int, seed: int) -> np.ndarray:
    """``count`` sequences of ``T + 1`` tokens, each the last one's ``(3 t + 1) mod VOCAB``."""
    tokens = np.empty((count, T + 1), np.int64)
    tokens[:, 0] = np.random.default_rng(seed).integers(0, VOCAB, count)
    for t in range(T):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % VOCAB
    return tokens


class OnDisk(Source):
    """An in-memory split posing as one on disk, so that batches go through ``tf.data``."""

    def __init__(self, split: Split) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def load(self, indices: np.ndarray, draw: Draw | None = None):
        return self.split.load(indices, draw)


def token_split(count: int, seed: int, targets: bool, dtype: str = "int64") -> Split:
    tokens = sequences(count, seed)
    mask = np.ones((count, T), bool)
    mask[:, -1] = False  # the last position is padding: its loss must not count
    x = {"tokens": tokens[:, :-1].astype(dtype), "mask": mask}
    return Split(x, tokens[:, 1:] if targets else None)


class Tokens(BuiltDataset):
    """``({"tokens", "mask"}, next_tokens)`` in memory, or the inputs alone (``targets: false``)."""

    def __init__(self, targets: bool = True, on_disk: bool = False, dtype: str = "int64") -> None:
        train_split, test_split = (token_split(n, seed, targets, dtype) for n, seed in ((20, 0), (16, 1)))
        self._spec = DatasetSpec.of(train_split)
        if dtype != "int64":  # a spec that the batches do not keep
            self._spec = DatasetSpec(inputs={**self._spec.inputs, "tokens": ArraySpec((T,), "int64")},
                                     targets=self._spec.targets)
        self._train = OnDisk(train_split) if on_disk else train_split
        self._test = OnDisk(test_split) if on_disk else test_split


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((None,), dtype="int64"), keras.layers.Embedding(VOCAB, 32),
                             keras.layers.Dense(VOCAB)])


def _masked_sums(logits: tf.Tensor, target: tf.Tensor, mask: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The loss summed over the mask, and each sample's share of right tokens there, summed."""
    positions = int(mask.shape[1]) - 1  # a sample's last position is masked out
    mask = tf.cast(mask, tf.float32)
    losses = keras.losses.sparse_categorical_crossentropy(target, logits, from_logits=True)
    right = tf.cast(tf.equal(tf.argmax(logits, -1), target), tf.float32) * mask
    return tf.reduce_sum(losses * mask), tf.reduce_sum(right) / positions


class TokenModel(ModelAdapter):
    """An embedding and a dense layer; per-token cross entropy over the mask, summed."""

    def build(self, spec):
        assert spec.num_classes is None and spec.inputs["mask"].dtype == "bool"
        return _model()

    def loss_and_metrics(self, model, x, y, training=True):
        assert set(x) == {"tokens", "mask"} and y.dtype == tf.int64 and x["mask"].dtype == tf.bool
        loss, right = _masked_sums(model(x["tokens"], training=training), y, x["mask"])
        return loss, {"token_accuracy": right}


class SelfSupervised(TokenModel):
    """No targets: each position predicts the token after it within the inputs."""

    def build(self, spec):
        assert spec.targets is None
        return _model()

    def loss_and_metrics(self, model, x, y, training=True):
        assert y is None
        logits = model(x["tokens"][:, :-1], training=training)
        loss, right = _masked_sums(logits, x["tokens"][:, 1:], x["mask"][:, 1:])
        return loss, {"token_accuracy": right}


def run(tmp_path, model, *overrides):
    return train(quiet_config(
        TF_CONFIG, tmp_path, f"data.name={HERE}:Tokens", f"model.name={HERE}:{model}",
        "model.options={}",
        # 20 samples, 8 a micro-batch, 2 a step: each epoch's second step is 4 samples and an
        # empty micro-batch.
        "data.batch_size=8", "train.backward_passes_per_step=2", "train.epochs=15",
        "optim.name=adam", "optim.lr=0.05", "optim.warmup_steps=0", "optim.schedule=constant",
        *overrides))


def test_the_signature_comes_from_the_spec():
    spec = DatasetSpec(inputs=(ArraySpec((T,), "int64"), {"m": ArraySpec((None, 2), "bool")}), targets=None)
    inputs, targets = batch_signature(spec)
    assert inputs == (tf.TensorSpec([None, T], tf.int64), {"m": tf.TensorSpec([None, None, 2], tf.bool)})
    assert isinstance(targets, tf.NoneTensorSpec)
    assert batch_signature(DatasetSpec(input_shape=(3,), num_classes=2)) == (
        tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int64))


def test_dict_inputs_with_a_mask_train_in_memory_and_through_tf_data(tmp_path):
    inline = run(tmp_path / "inline", "TokenModel", "data.workers=0")
    final = inline.summary["final"]
    assert inline.summary["steps"] == 30 and inline.summary["samples"] == 300
    assert final["eval_loss"] < 0.2 * (T - 1) * math.log(VOCAB)  # from a uniform guess's 19.4
    assert final["eval_token_accuracy"] > 0.9
    workers = run(tmp_path / "workers", "TokenModel", "data.workers=2", "data.options={on_disk: true}")
    for key, value in inline.engine.parameters().items():
        assert np.array_equal(workers.engine.parameters()[key], value), key


def test_inputs_without_targets_train(tmp_path):
    result = run(tmp_path, "SelfSupervised", "data.workers=2",
                 "data.options={targets: false, on_disk: true}")
    assert result.summary["steps"] == 30
    assert result.summary["final"]["eval_loss"] < 0.2 * (T - 1) * math.log(VOCAB)
    assert result.summary["final"]["eval_token_accuracy"] > 0.9


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_that_does_not_fit_the_spec_stops_the_run_naming_the_array(tmp_path, workers):
    with pytest.raises(HvdtrainError, match=r"^a batch of the train split: inputs\['tokens'\] has "
                       r"int32\[8\] a sample, the dataset's spec says int64\[8\]$"):
        run(tmp_path, "TokenModel", f"data.workers={workers}",
            "data.options={dtype: int32, on_disk: true}")

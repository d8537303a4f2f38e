"""Activation checkpointing in TensorFlow (``model.activation_checkpointing=true``), in one process:
recomputed units train to the parameters of a run that keeps its activations, on the ring and at
``shard.stage=2``, with Dropout and BatchNormalization inside the units (their seeds and statistics
are set back before the recompute); the gradients of one batch are those of the plain model."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.driver import train
from hvdtrain.tensorflow import ClassifierAdapter
from hvdtrain.tensorflow.recompute import recompute_units
from tests.conftest import TF_CONFIG, quiet_config

ADAM = ["optim.name=adam", "optim.lr=0.002", "optim.weight_decay=0.01", "train.epochs=1",
        "train.backward_passes_per_step=2", "data.batch_size=16"]
DROPNET = "model.name=tests.tensorflow.test_shard_recompute:DropNet"
TOLERANCE = 1e-5
"""The recompute runs the same kernels on the same inputs (equal to the bit where measured)."""


def drop_net(spec: Any) -> keras.Model:
    """Dense, BatchNormalization and Dropout units: what a recompute must not draw or count
    twice."""
    shape = spec.input_shape
    return keras.Sequential([keras.Input(shape=shape), keras.layers.Flatten(),
                             keras.layers.Dense(64, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
                             keras.layers.Dense(spec.num_classes)])


class DropNet(ClassifierAdapter):
    """:func:`drop_net` as a model a config names by import path."""

    def build(self, spec: Any) -> keras.Model:
        return drop_net(spec)


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert len(got) == len(want) > 0, what
    for (gk, g), (wk, w) in zip(sorted(got.items()), sorted(want.items()), strict=True):
        assert gk.split(".")[0] == wk.split(".")[0], what
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE, err_msg=f"{what}: {gk}")


@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.long), ["shard.stage=2"],
                                   [DROPNET]], ids=["ring", "stage2", "dropout-batchnorm"])
def test_recomputed_units_train_as_kept_activations(tmp_path, extra):
    kept = train(quiet_config(TF_CONFIG, tmp_path / "kept", *ADAM, *extra))
    again = train(quiet_config(TF_CONFIG, tmp_path / "again", *ADAM, *extra,
                               "model.activation_checkpointing=true"))
    assert_close(again.engine.parameters(), kept.engine.parameters(), "recomputed units")
    if extra == [DROPNET]:  # the statistics moved once a step, as without the recompute
        stats = [v.numpy() for v in again.engine.model.non_trainable_variables]
        want = [v.numpy() for v in kept.engine.model.non_trainable_variables]
        for got, expected in zip(stats, want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)


def test_the_recompute_gives_the_plain_gradients_with_dropout_and_batchnorm():
    class Spec:
        input_shape, num_classes = (8,), 3

    keras.utils.set_random_seed(1)
    plain = drop_net(Spec())
    keras.utils.set_random_seed(1)
    wrapped = drop_net(Spec())
    wrapped.set_weights(plain.get_weights())
    assert recompute_units(wrapped) == 5  # every layer but the input
    x = tf.random.stateless_normal([16, 8], seed=[3, 4])

    @tf.function
    def grads(model: keras.Model) -> list[tf.Tensor]:
        variables = [v.value for v in model.trainable_variables]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, variables)

    for model in (plain, wrapped):  # the same seed state: the same dropout masks
        for sub in model.layers:
            for sg in getattr(sub, "_seed_generators", []):
                sg.state.assign(tf.zeros_like(sg.state))
    want, got = grads(plain), grads(wrapped)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=1e-5)

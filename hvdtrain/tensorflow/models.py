"""Keras 3 model adapters: a classification base class and the built-in ``mlp``.

The ``mlp`` has the PyTorch ``mlp``'s architecture and initial weight distributions (PyTorch's
``nn.Linear`` default: weights and biases uniform in +-1/sqrt(fan_in)), so the two frameworks train
the same model.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from hvdtrain.adapters import ModelAdapter, mlp_hidden
from hvdtrain.data import DatasetSpec


class ClassifierAdapter(ModelAdapter):
    """Cross-entropy loss and accuracy for a Keras model that maps inputs to class logits.

    Subclass it and implement :meth:`build` to plug in your own ``keras.Model``::

        class MyNet(ClassifierAdapter):
            def build(self, spec):
                return keras.Sequential([keras.Input(spec.input_shape),
                                         keras.layers.Dense(spec.num_classes)])

    and name it in the config: ``model.name: mypackage.models:MyNet``.
    """

    def loss_and_metrics(self, model: keras.Model, x: tf.Tensor, y: tf.Tensor,
                         training: bool = True) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        logits = model(x, training=training)
        losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float32)
        return tf.reduce_sum(losses), {"correct": tf.reduce_sum(correct)}


def _torch_like_dense(fan_in: int, units: int, activation: str | None) -> keras.layers.Dense:
    bound = 1.0 / math.sqrt(fan_in)
    return keras.layers.Dense(
        units, activation=activation,
        # kaiming_uniform(a=sqrt(5)) in torch is uniform in +-sqrt(1/fan_in): variance scaling 1/3.
        kernel_initializer=keras.initializers.VarianceScaling(1.0 / 3.0, "fan_in", "uniform"),
        bias_initializer=keras.initializers.RandomUniform(-bound, bound))


class MLP(ClassifierAdapter):
    """A multi-layer perceptron: ``hidden`` sizes with ReLU between them (options: ``hidden``)."""

    def __init__(self, hidden: list[int] | tuple[int, ...] = (128,), **options: Any) -> None:
        self.hidden = mlp_hidden(hidden, options)
        super().__init__(hidden=self.hidden)

    def build(self, spec: DatasetSpec) -> keras.Model:
        width = math.prod(spec.input_shape)
        layers: list[Any] = [keras.Input(shape=spec.input_shape), keras.layers.Flatten()]
        for size in self.hidden:
            layers.append(_torch_like_dense(width, size, "relu"))
            width = size
        layers.append(_torch_like_dense(width, spec.num_classes, None))
        return keras.Sequential(layers)

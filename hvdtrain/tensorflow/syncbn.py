"""Synchronized batch normalization for Keras 3 on Horovod: a batch-norm layer that normalizes with
the mean and variance of the global batch (all ranks' samples).

Horovod's ``SyncBatchNormalization`` is written for Keras 2 (it passes ``fused=False``, which Keras
3 rejects). Keras 3's ``BatchNormalization`` computes a batch's statistics in one method,
``_moments``; :class:`SyncBatchNormalization` overrides just that with two Horovod allreduces (sums
and counts, then squared deviations), which carry gradients, so the backward pass is synchronized
too. Moving averages, the normalization and the variables are Keras's own.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose batch statistics cover every rank's samples.

    ``sync_name`` names its collectives: Horovod pairs tensors across ranks by name, so it must be
    the same on every rank (:func:`convert` numbers the layers in model order).
    """

    sync_name = "hvdtrain.syncbn"

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None or hvd.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        shape = tf.shape(inputs)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), inputs.dtype)
        local = tf.concat([tf.reduce_sum(inputs, axes), tf.reshape(count, [1])], 0)
        total = hvd.allreduce(local, op=hvd.Sum, name=f"{self.sync_name}.sum")
        n = tf.maximum(total[-1], 1.0)
        mean = total[:-1] / n
        centred = inputs - tf.reshape(mean, self._broadcast_shape(inputs))
        squares = tf.reduce_sum(tf.square(centred), axes)
        variance = hvd.allreduce(squares, op=hvd.Sum, name=f"{self.sync_name}.var") / n
        return mean, variance

    def _broadcast_shape(self, inputs: Any) -> list[int]:
        """The statistics' shape for broadcasting against ``inputs``: 1 on every reduced axis."""
        rank = len(inputs.shape)
        reduced = {a % rank for a in self._reduction_axes}
        return [1 if a in reduced else -1 for a in range(rank)]


def convert(model: keras.Model) -> int:
    """Makes every ``BatchNormalization`` layer of ``model`` synchronized; returns how many.

    A built Keras model's layers cannot be replaced without rebuilding its graph, so each layer's
    class becomes :class:`SyncBatchNormalization`: same variables and configuration, only its batch
    statistics change.
    """
    layers = [layer for layer in model._flatten_layers(include_self=False)
              if type(layer) is keras.layers.BatchNormalization]
    for index, layer in enumerate(layers):
        layer.__class__ = SyncBatchNormalization
        layer.sync_name = f"hvdtrain.syncbn.{index}"
    return len(layers)

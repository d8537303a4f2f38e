"""The ``ps`` gradient exchange for TensorFlow (:mod:`hvdtrain.ps.exchange`): tensors to one flat
NumPy vector and back, run eagerly between the step's traced gradient and update functions."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from hvdtrain.ps.exchange import PSExchange
from hvdtrain.tensorflow.collectives import any_rank


class TensorFlowPSExchange(PSExchange):
    """:class:`hvdtrain.ps.exchange.PSExchange` over TensorFlow gradients."""

    def flatten(self, grads: Sequence[tf.Tensor]) -> np.ndarray:
        flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in grads], axis=0)
        return np.ascontiguousarray(flat.numpy())

    def unflatten(self, flat: np.ndarray) -> list[tf.Tensor]:
        return [tf.constant(part) for part in self.split(flat)]

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

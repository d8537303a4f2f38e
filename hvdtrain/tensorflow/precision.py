"""Mixed precision for the TensorFlow engine: the Keras ``mixed_bfloat16`` or ``mixed_float16``
policy while the model is built, and for fp16 a ``LossScaleOptimizer`` (policy in
:mod:`hvdtrain.precision`).

Variables stay float32, so gradients and the exchange are float32. Under fp16 the loss is scaled
before the gradients are taken; the exchange averages the scaled gradients, so an overflow on any
rank reaches every rank, and the ``LossScaleOptimizer`` then unscales, or skips the step and
lowers the scale, the same way on all of them. Its scale is one of the optimizer's variables, so
checkpoints and broadcasts carry it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import hvdtrain.tensorflow  # noqa: F401  (quiets TensorFlow before it loads)
import keras
import tensorflow as tf

from hvdtrain.precision import scales_loss

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class Precision:
    """One rank's precision: the build-time policy, the loss scale, and whether a step was skipped."""

    def __init__(self, precision: str) -> None:
        self.policy_name = POLICIES[precision]
        self.scaling = scales_loss(precision)
        # Written inside the traced update: whether its gradients overflowed (the step was skipped).
        self.overflow = tf.Variable(0.0, trainable=False) if self.scaling else None

    @contextlib.contextmanager
    def policy(self) -> Iterator[None]:
        """Builds layers under the precision's dtype policy; the global policy is restored after,
        so that nothing else in the process changes."""
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.policy_name)
        try:
            yield
        finally:
            keras.config.set_dtype_policy(previous)

    def wrap(self, optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
        """The optimizer, inside a ``LossScaleOptimizer`` under fp16."""
        return keras.optimizers.LossScaleOptimizer(optimizer) if self.scaling else optimizer

    @staticmethod
    def scale(optimizer: keras.optimizers.Optimizer, value: tf.Tensor) -> tf.Tensor:
        """``value`` times the current loss scale (unchanged without loss scaling)."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return optimizer.scale_loss(value)
        return value

    def note(self, grads: Sequence[tf.Tensor]) -> None:
        """Records whether these (exchanged) gradients overflowed; call inside the update."""
        if self.overflow is not None:
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            self.overflow.assign(tf.where(finite, 0.0, 1.0))

    @property
    def skipped(self) -> float:
        """1.0 when the last step was skipped by the loss scaler, else 0.0."""
        return float(self.overflow.numpy()) if self.overflow is not None else 0.0

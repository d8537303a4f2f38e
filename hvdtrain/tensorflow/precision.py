"""Mixed precision for the TensorFlow engine: the Keras ``mixed_bfloat16`` or ``mixed_float16``
policy while the model is built, and for fp16 a ``LossScaleOptimizer``, as the precision kernels of
:mod:`hvdtrain.step` (policy in :mod:`hvdtrain.precision`).

Variables stay float32, so gradients and the exchange are float32. Under fp16 the loss is scaled
before the gradients are taken. The dense exchange averages the scaled gradients, so an overflow
on any rank reaches every rank, and the ``LossScaleOptimizer`` then unscales, or skips the step
and lowers the scale, the same way on all of them. Exchanges that keep state in the gradients'
units get them unscaled (:meth:`Precision.unscale`, after the ranks agreed on overflows), and the
averages are scaled back before the ``LossScaleOptimizer`` sees them: the scale is a power of two,
so both are exact. Its scale is one of the optimizer's variables, so checkpoints and broadcasts
carry it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from hvdtrain.precision import scales_loss
from hvdtrain.step import PrecisionKernels

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class Precision(PrecisionKernels):
    """One rank's precision: the build-time policy, the loss scale, and whether a step was skipped.

    :meth:`attach` gives it the optimizer and the traced update, once those exist."""

    def __init__(self, precision: str, loss_scale: float = 0.0) -> None:
        self.policy_name = POLICIES[precision]
        self.scaling = scales_loss(precision)
        self.initial_scale = loss_scale  # train.loss_scale: the first scale (0: Keras's)
        # Written inside the traced update: whether its gradients overflowed (the step was skipped).
        self.overflow = tf.Variable(0.0, trainable=False) if self.scaling else None
        self.optimizer: Any = None
        self.apply: Callable[[list[tf.Tensor]], Any] = lambda grads: None
        self.shapes: list[tuple[int, ...]] = []

    def attach(self, optimizer: keras.optimizers.Optimizer,
               apply: Callable[[list[tf.Tensor]], Any], shapes: Sequence[tuple[int, ...]]) -> None:
        """The optimizer whose loss scale this is, the update that :meth:`update` runs, and the
        shapes of the gradients it takes."""
        self.optimizer, self.apply, self.shapes = optimizer, apply, list(shapes)

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
        if not self.scaling:
            return optimizer
        start = {"initial_scale": self.initial_scale} if self.initial_scale else {}
        return keras.optimizers.LossScaleOptimizer(optimizer, **start)

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

    def finite(self, grads: Sequence[tf.Tensor]) -> bool:
        return bool(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))

    def loss_scale(self) -> float:
        """The current loss scale (1 without loss scaling)."""
        return float(self._loss_scale()) if self.scaling else 1.0

    def _loss_scale(self) -> tf.Tensor:
        return self.scale(self.optimizer, tf.constant(1.0))

    def unscale(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        if not self.scaling:
            return list(grads)
        scale = self._loss_scale()
        return [g / scale for g in grads]

    def update(self, grads: Sequence[tf.Tensor], unscaled: bool) -> None:
        if unscaled and self.scaling:  # the LossScaleOptimizer unscales, and skips on overflow
            scale = self._loss_scale()
            grads = [g * scale for g in grads]
        self.apply(list(grads))

    def skip(self) -> None:
        # The LossScaleOptimizer sees an overflow on this rank too, and skips with the others.
        self.apply([tf.fill(shape, float("inf")) for shape in self.shapes])

    @property
    def skipped(self) -> bool:
        return bool(self.overflow.numpy()) if self.overflow is not None else False

"""The TensorFlow kernels of the train step (:mod:`hvdtrain.step` runs the sequence).

Each kernel is one traced ``tf.function`` with one concrete trace: a micro-batch before the last
only accumulates its local gradients; the last one yields the step's gradients for the exchange;
the update applies the exchanged ones. For an exchange that can be traced
(:class:`hvdtrain.tensorflow.exchange.DenseAllreduce`) the last micro-batch, the allreduce and the
update are one function instead (:meth:`TensorFlowKernels.fused_last`): no host round trip between
them, as a hand-written ``DistributedGradientTape`` loop runs it; two timestamps inside it give the
time waited for the allreduce.

Keras 3 notes: a Keras variable is not a ``tf.Variable``, so gradients are taken of ``v.value``;
Horovod's XLA ops are not built, so no ``jit_compile``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from hvdtrain.adapters import ModelAdapter
from hvdtrain.data.contracts import DatasetSpec
from hvdtrain.data.sampler import StepIndices
from hvdtrain.exchange import GradientExchange
from hvdtrain.step import StepKernels
from hvdtrain.tensorflow.data import TensorFlowLoader, batch_signature
from hvdtrain.tensorflow.precision import Precision


def _concrete(function: Any) -> Callable[..., Any]:
    """Calls ``function``'s one concrete function (``function`` has an input signature), traced on
    the first call. Called directly, it skips what a ``tf.function`` call does every time to match
    its arguments to a trace, which costs as much as running a small model's step."""
    concrete = None

    def call(*args: Any) -> Any:
        nonlocal concrete
        if concrete is None:
            concrete = function.get_concrete_function()
        return concrete(*args)
    return call


def _traced(fn: Callable[..., Any], signature: Any) -> Callable[..., Any]:
    return _concrete(tf.function(fn, input_signature=signature, jit_compile=False))


def clip(grads: list[tf.Tensor], norm: tf.Tensor, max_norm: float) -> list[tf.Tensor]:
    """``grads``, whose global L2 norm is ``norm``, scaled to at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does (``optim.clip_norm``)."""
    factor = tf.minimum(max_norm / (norm + 1e-6), 1.0)
    return [g * factor for g in grads]


class TensorFlowKernels(StepKernels):
    """Forward, backward and update of one ``keras.Model`` with its optimizer and loader.

    ``l2`` is the weight decay applied as L2 on the gradient, as torch's SGD and Adam do (Keras
    would decay the weights directly)."""

    precision: Precision  # the skeleton's PrecisionKernels, and what TensorFlow's step adds
    clip_norm = 0.0
    """``optim.clip_norm`` (0: off), set by the engine before the kernels are traced."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 adapter: ModelAdapter, data: TensorFlowLoader, precision: Precision,
                 spec: DatasetSpec, l2: float) -> None:
        self.model, self.optimizer, self.adapter = model, optimizer, adapter
        self.data, self.precision = data, precision
        self.spec, self.l2 = spec, l2
        self.accumulators: list[tf.Variable] = []
        self.lr = float("nan")  # the loop sets the real one before the first step
        self._scale_cache: tuple[float, tf.Tensor | None] = (math.nan, None)
        self._grads: list[tf.Tensor] = []
        self._metric_keys: list[str] = []
        self.traced_for: tuple[int, int, int] | None = None

    # tracing -------------------------------------------------------------------------------------

    def follow(self, exchange: GradientExchange, accumulation: int) -> None:
        """Traces the kernels for this exchange's world and ``accumulation`` where they were traced
        for another: the fused step decides when traced whether there is anyone to send to, and
        the others whether to accumulate at all."""
        key = (exchange.rank, exchange.size, accumulation)
        if self.traced_for == key:
            return
        # Gradient buffers only where there is something to accumulate: they cost a model's memory.
        if accumulation > 1 and not self.accumulators:
            self.accumulators = [tf.Variable(tf.zeros_like(v.value), trainable=False)
                                 for v in self.model.trainable_variables]
        self.exchange: Any = exchange  # a fusable one's traced_mean goes into the fused step
        self._compile()
        self.traced_for = key

    def _compile(self) -> None:
        # One trace per function: a None batch dimension covers short and empty micro-batches.
        batch = (*batch_signature(self.spec), tf.TensorSpec([], tf.float32))
        grads = [tf.TensorSpec(v.shape, tf.float32) for v in self.model.trainable_variables]
        self._accumulate_fn = _traced(self._accumulate, batch)
        self._gradients_fn = _traced(self._gradients, batch)
        self._fused_fn = _traced(self._fused_step, batch)
        self.apply = _traced(self._apply, [grads])
        self.precision.attach(self.optimizer, self.apply, [tuple(g.shape) for g in grads])

    # the traced functions ------------------------------------------------------------------------

    def _local_gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                         ) -> tuple[tf.Tensor, dict, list[tf.Tensor]]:
        variables = [v.value for v in self.model.trainable_variables]
        with tf.GradientTape() as tape:
            loss_sum, metrics = self.adapter.loss_and_metrics(self.model, x, y, training=True)
            target = self.precision.scale(self.optimizer, loss_sum * scale)
        # Zeros, not None, for a variable the loss does not reach: every rank sends every tensor.
        grads = tape.gradient(target, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # An embedding's gradient comes as IndexedSlices (the LM's): every exchange and the
        # accumulators take dense tensors of the variable's shape.
        return loss_sum, metrics, [tf.convert_to_tensor(g) for g in grads]

    def _accumulate(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, dict]:
        """A micro-batch before the last of a step: local gradients only, no communication."""
        loss_sum, metrics, grads = self._local_gradients(x, y, scale)
        for acc, grad in zip(self.accumulators, grads, strict=True):
            acc.assign_add(grad)
        return loss_sum, metrics

    def _gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                   ) -> tuple[tf.Tensor, dict, list[tf.Tensor]]:
        """The step's last micro-batch: its gradients plus those accumulated, ready to exchange."""
        loss_sum, metrics, grads = self._local_gradients(x, y, scale)
        if self.accumulators:
            grads = [g + acc for g, acc in zip(grads, self.accumulators, strict=True)]
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))
        return loss_sum, metrics, grads

    def _fused_step(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        """The step's last micro-batch, the dense allreduce and the update in one function.
        Returns its loss sum, its metrics (in ``_metric_keys`` order) and the seconds from the
        gradients being ready to their average, as one float64 vector: one copy to the host a step.
        """
        loss_sum, metrics, grads = self._gradients(x, y, scale)
        self._metric_keys = sorted(metrics)  # set while tracing, before the first result is read
        with tf.control_dependencies(grads):
            ready = tf.timestamp()
        with tf.control_dependencies([ready]):  # the allreduce starts after the clock reads
            grads = [tf.identity(g) for g in grads]
        averaged = self.exchange.traced_mean(grads)
        with tf.control_dependencies(averaged):
            comm_s = tf.timestamp() - ready
        self._apply(averaged)
        values = [loss_sum, *(metrics[k] for k in self._metric_keys), comm_s]
        return tf.stack([tf.cast(v, tf.float64) for v in values])

    def _apply(self, grads: list[tf.Tensor]) -> None:
        """The update with the exchanged (averaged) gradients."""
        self.precision.note(grads)
        if self.clip_norm:  # before the L2 term, as torch clips before its optimizer decays
            grads = clip(grads, tf.linalg.global_norm(grads), self.clip_norm)
        if self.l2:  # scaled as the gradients are: the loss-scale optimizer unscales both
            grads = [g + self.precision.scale(self.optimizer, self.l2 * v.value)
                     for g, v in zip(grads, self.model.trainable_variables, strict=True)]
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))

    # the kernels of hvdtrain.step ----------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        if lr != self.lr:
            self.optimizer.learning_rate.assign(lr)
            self.lr = lr

    def batches(self, step: StepIndices) -> Iterator[Any]:
        return self.data.batches(step)

    def begin(self) -> None:
        self._grads = []  # the accumulators were zeroed when the last step's gradients were read

    def backward(self, batch: Any, weight: float, last: bool) -> tuple[Any, dict[str, Any]]:
        x, y = batch
        if not last:
            return self._accumulate_fn(x, y, self._scale(weight))
        loss_sum, metrics, self._grads = self._gradients_fn(x, y, self._scale(weight))
        return loss_sum, metrics

    def gradients(self) -> list[tf.Tensor]:
        return list(self._grads)

    def fused_last(self, batch: Any, weight: float, exchange: GradientExchange
                   ) -> tuple[Any, dict[str, Any], float] | None:
        if not exchange.fusable:
            return None
        x, y = batch
        loss_sum, *values, comm = self._fused_fn(x, y, self._scale(weight)).numpy().tolist()
        return loss_sum, dict(zip(self._metric_keys, values, strict=True)), comm

    def _scale(self, value: float) -> tf.Tensor:
        """``value`` as a tensor, made again only when it changes (the last step of an epoch)."""
        if self._scale_cache[0] != value:
            self._scale_cache = (value, tf.constant(value, tf.float32))
        return self._scale_cache[1]

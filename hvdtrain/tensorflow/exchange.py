"""The gradient exchanges of :mod:`hvdtrain.exchange` for TensorFlow: one factory per kind (the
strategies' registry names which a run gets), :func:`make_exchange` the look-up.

``dense`` is :class:`DenseAllreduce`: Horovod's grouped allreduce of every gradient, which the step
traces into one function with the gradients and the update (:meth:`DenseAllreduce.traced_mean`),
as a hand-written ``DistributedGradientTape`` loop does; run eagerly, it is the dense plan's
exchange. ``compressing`` is :class:`hvdtrain.tensorflow.compression.CompressingExchange`, run
once per step after the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvdtrain.compression import make_plan
from hvdtrain.exchange import Exchanged, ExchangeRequest, GradientExchange, build_exchange
from hvdtrain.ps.exchange import make_client
from hvdtrain.tensorflow.compression import DTYPES, CompressingExchange, make_compressing
from hvdtrain.tensorflow.ps import TensorFlowPSExchange


class DenseAllreduce(CompressingExchange):
    """A dense plan (``none``, ``fp16``): every gradient sent as the plan's dtype; traceable.

    Its state is the step count alone, which checkpoints carry as for every method."""

    fusable = True

    def traced_mean(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The average, for use inside a traced step: ``grads`` sent as the plan's dtype in one
        grouped Horovod allreduce and back as float32. The same numbers as :meth:`run` (nothing
        is sent at size 1, as there)."""
        if self.size == 1:
            return list(grads)
        dtype = self.plan.dense_dtype
        sent = [tf.cast(g, DTYPES[dtype]) for g in grads]
        averaged = hvd.grouped_allreduce(sent, op=hvd.Average, name=f"hvdtrain.fused.mean.{dtype}")
        return [tf.cast(g, tf.float32) for g in averaged]


def make_exchange(cfg: Any, request: ExchangeRequest) -> Exchanged:
    """The run's exchange and the optimizer the step drives with it, built by the factory the
    strategies' registry names for ``cfg`` (:func:`hvdtrain.exchange.build_exchange`): one of
    the factories below, each for one kind."""
    return build_exchange(cfg, request)


def _weights(params: Sequence[Any]) -> Callable[[], Sequence[tf.Tensor]]:
    """The parameters' current values, for an update rule that reads the weights."""
    return lambda: [v.value for v in params]


def dense_exchange(r: ExchangeRequest) -> Exchanged:
    """``dense``: every gradient sent as the plan's dtype, traceable into the step."""
    shapes = [v.shape for v in r.params]
    return DenseAllreduce(make_plan(r.comm, r.seed, shapes), r.rank, r.size), r.optimizer


def compressing_exchange(r: ExchangeRequest) -> Exchanged:
    """``compressing``: the method's plan, with ``r.settings``' update rule where one applies
    (then the step's optimizer is plain SGD, :func:`stepping_optimizer`)."""
    exchange = make_compressing(r.comm, r.seed, r.rank, r.size, [v.shape for v in r.params],
                                r.settings, _weights(r.params))
    return exchange, stepping_optimizer(exchange, r.optimizer)


def ps_exchange(r: ExchangeRequest) -> Exchanged:
    """``ps`` (``bsp``): push and pull through the servers; the run's optimizer steps."""
    assert r.ps is not None, "a parameter server exchange needs the ps section"
    shapes = [v.shape for v in r.params]
    client = make_client(r.ps, r.comm, shapes, r.seed)
    return TensorFlowPSExchange(client, r.rank, r.size, shapes), r.optimizer


def stepping_optimizer(exchange: GradientExchange, optimizer: Any) -> Any:
    """The optimizer the step drives with ``exchange``: ``optimizer``, or plain SGD at its
    learning rate where the exchange applies the optimizer's rule (:func:`applies_update`)."""
    if optimizer is None or not applies_update(exchange):
        return optimizer
    rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    return keras.optimizers.SGD(learning_rate=rate)


def applies_update(exchange: GradientExchange) -> bool:
    """Whether ``exchange`` returns update directions (DGC, compressed Adam), which the step's
    optimizer must apply as plain SGD: ``w -= lr d``, no momentum, no decay."""
    return isinstance(exchange, CompressingExchange) and exchange.rule.updates

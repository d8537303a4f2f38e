"""The gradient exchanges of :mod:`hvdtrain.exchange` for TensorFlow, built by
:func:`make_exchange`.

``dense`` is :class:`DenseAllreduce`: Horovod's grouped allreduce of every gradient, which the step
traces into one function with the gradients and the update (:meth:`DenseAllreduce.traced_mean`),
as a hand-written ``DistributedGradientTape`` loop does; run eagerly, it is the dense plan's
exchange. ``compressing`` is :class:`hvdtrain.tensorflow.compression.CompressingExchange`, run
once per step after the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain.compression import make_plan
from hvdtrain.compression.plans import CommSettings
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.config import PSConfig
from hvdtrain.exchange import GradientExchange, exchange_kind
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


def make_exchange(comm: CommSettings, seed: int, rank: int, size: int,
                  shapes: Sequence[Sequence[int]], ps: PSConfig | None = None,
                  opt: OptimizerSettings | None = None,
                  weights: Callable[[], Sequence[tf.Tensor]] | None = None) -> GradientExchange:
    """The run's exchange over gradients of these shapes (the model's order), of the kind
    :func:`hvdtrain.exchange.exchange_kind` picks; ``ps``: the parameter servers' settings
    where ``comm.topology=ps``; ``opt`` and ``weights`` (the parameters in the same order): the
    run's optimizer, whose update rule the compressing exchange may apply (then
    :func:`applies_update`)."""
    if ps is not None:
        client = make_client(ps, comm, shapes, seed)
        return TensorFlowPSExchange(client, rank, size, shapes)
    if exchange_kind(comm.compression) == "dense":
        return DenseAllreduce(make_plan(comm, seed, shapes), rank, size)
    return make_compressing(comm, seed, rank, size, shapes, opt, weights)


def applies_update(exchange: GradientExchange) -> bool:
    """Whether ``exchange`` returns update directions (DGC, compressed Adam), which the step's
    optimizer must apply as plain SGD: ``w -= lr d``, no momentum, no decay."""
    return isinstance(exchange, CompressingExchange) and exchange.rule.updates

"""Sharded data parallel at stage 2 for TensorFlow (``shard.stage=2``): gradients sharded too.

Stage 1 (:mod:`hvdtrain.tensorflow.shard`) reduce-scatters one flat gradient after the backward
pass and keeps every micro-batch's whole gradient in accumulators. Here the gradient is cut by
unit, a unit being the trainable variables of one of the model's layers (``model.layers``; a
variable no layer holds is a unit of its own). Every variable, flattened, is split over the ranks
as Horovod's ``reducescatter`` splits it (:func:`hvdtrain.shard.shard_bounds`), so that no copy
of a unit is made to cut it, and a rank owns its slice of every variable (:class:`UnitShard`).
Consecutive units go to one ``hvd.grouped_reducescatter`` until the group holds
``shard.unit_kib`` KiB (a larger unit is a group alone). The groups
are traced into the step's function, so each starts as soon as the backward pass has produced its
units' gradients, and the whole gradients die with their group. A micro-batch before the last
reduce-scatters too and adds into an accumulator of the rank's shard only: no rank keeps a whole
gradient across micro-batches. The run's Keras optimizer steps one variable holding the rank's
slices (its slots cover 1/N of the model), and ``hvd.grouped_allgather`` brings the updated
slices back into every rank's model variables, in the same groups.

The arithmetic is the ring's (an average, then the same element-wise update); with accumulation
the average of each micro-batch is summed, where the ring averages the sum (equal within float
rounding). Gathered whole (:meth:`UnitShard.allgather`), a slot is one flat vector in the
parameters' flat order, as at stage 1: the two stages and any number of ranks resume each other's
checkpoints (:class:`hvdtrain.tensorflow.shard.ShardedEngine` writes and reads them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.exchange import GradientExchange
from hvdtrain.shard import check_resize, shard_bounds
from hvdtrain.tensorflow.collectives import any_rank, grouped_reducescatter
from hvdtrain.tensorflow.data import batch_signature
from hvdtrain.tensorflow.step import TensorFlowKernels, _traced, clip

WIRE = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def clip_shards(grads: list[tf.Tensor], max_norm: float) -> list[tf.Tensor]:
    """This rank's shard of the averaged gradient clipped by the global norm of every rank's
    shard: the sum of squares allreduced over the ranks (a collective, one scalar)."""
    squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
    norm = tf.sqrt(hvd.allreduce(squares, op=hvd.Sum, name="hvdtrain.shard.clip"))
    return clip(grads, norm, max_norm)


def agree_overflow(grads: list[tf.Tensor]) -> list[tf.Tensor]:
    """fp16: this rank's shard of the averaged scaled gradient, made infinite where any rank's
    shard overflowed (one allreduce of a flag over every rank). The ring's LossScaleOptimizer
    sees the whole average; here each sees a shard, and so every rank skips the step and lowers
    the scale together, or none does."""
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
    flag = hvd.allreduce(tf.where(finite, 0.0, 1.0), op=hvd.Sum, name="hvdtrain.shard.overflow")
    bump = tf.where(flag > 0, math.inf, 0.0)  # inf where any overflowed, else nothing changes
    return [g + bump for g in grads]


def layer_units(layers: Sequence[Any], variables: Sequence[Any]) -> list[list[int]]:
    """``variables`` (the trainable ones, in model order) cut into units: runs of consecutive
    variables that belong to one of ``layers`` (a variable no layer holds is a unit alone)."""
    owner: dict[int, int] = {}
    for k, layer in enumerate(layers):
        for v in layer.trainable_variables:
            owner.setdefault(id(v), k)
    units: list[list[int]] = []
    previous: int | None = None
    for i, v in enumerate(variables):
        mine = owner.get(id(v))
        if units and mine is not None and mine == previous:
            units[-1].append(i)
        else:
            units.append([i])
        previous = mine
    return units


def unit_groups(unit_sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive units in groups of at most ``limit`` elements (a larger unit is a group of
    its own): one grouped collective each."""
    groups: list[list[int]] = []
    held = 0
    for u, n in enumerate(unit_sizes):
        if groups and held + n <= limit:
            groups[-1].append(u)
            held += n
        else:
            groups.append([u])
            held = n
    return groups


class UnitShard:
    """This rank's slice of every trainable variable, and the collectives that move the slices,
    grouped by units (``limit``: elements of a group, over all ranks). ``process_set``: Horovod's
    set of the ranks that share the slices (a pipeline stage's copies; ``rank`` and ``size`` are
    the place and number in it), every rank's by default."""

    def __init__(self, variables: Sequence[Any], units: Sequence[Sequence[int]], rank: int,
                 size: int, limit: int, process_set: Any = None) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.variables = list(variables)
        for v in self.variables:
            if v.dtype != "float32":
                raise HvdtrainError("shard.stage=2: every trainable variable must be float32")
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.units = [list(u) for u in units]
        self.rank, self.size, self.total = rank, size, sum(self.sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        # Each variable split as Horovod splits it: no copy of a unit is made to cut it.
        self.bounds = [shard_bounds(n, size, rank) for n in self.sizes]
        self.owns = [hi - lo for lo, hi in self.bounds]
        self.starts = [sum(self.owns[:i]) for i in range(len(self.owns))]
        self.own = sum(self.owns)
        self.groups = unit_groups([sum(self.sizes[i] for i in u) for u in self.units], limit)
        self._group_vars = [[i for u in g for i in self.units[u]] for g in self.groups]
        # The variable the optimizer steps: this rank's slices of the variables, in order.
        self.var = keras.Variable(np.zeros(self.own, np.float32), name="shard")

    def take(self, whole: Any) -> Any:
        """This rank's slices of a flat vector of every parameter (a slot as checkpoints hold
        it), in the order of :attr:`var`."""
        parts = [whole[o + lo:o + hi] for o, (lo, hi) in zip(self.offsets, self.bounds,
                                                                strict=True)]
        return np.concatenate(parts) if isinstance(whole, np.ndarray) else tf.concat(parts, 0)

    def load(self) -> None:
        """The shard variable from the model's current parameters (after a broadcast or a
        restore; the step keeps the two equal)."""
        self.var.assign(tf.concat([tf.reshape(v.value, [-1])[lo:hi]
                                   for v, (lo, hi) in zip(self.variables, self.bounds,
                                                          strict=True)], 0))

    def reducescatter(self, grads: Sequence[tf.Tensor], wire: Any) -> tf.Tensor:
        """The average over the ranks of this rank's slices of ``grads`` (one per variable), by
        groups of units (a collective)."""
        got = []
        for group in self._group_vars:
            flats = [tf.reshape(grads[i], [-1]) for i in group]
            got += grouped_reducescatter(flats, op=hvd.Average, compression=wire,
                                         process_set=self.process_set)
        return tf.concat(got, 0)

    def _gathered(self, mine: tf.Tensor, tag: str) -> list[tf.Tensor]:
        """Every rank's slices of each variable (``mine``: this rank's, in :attr:`var`'s order),
        as one whole flat tensor per variable, by groups (a collective)."""
        whole: list[tf.Tensor] = []
        for g, group in enumerate(self._group_vars):
            pieces = [mine[self.starts[i]:self.starts[i] + self.owns[i]] for i in group]
            # A variable's slices, concatenated in rank order, are that variable whole.
            whole += hvd.grouped_allgather(pieces, name=f"hvdtrain.shard2.{tag}.{g}",
                                           process_set=self.process_set)
        return whole

    def allgather(self, mine: tf.Tensor, tag: str) -> tf.Tensor:
        """Every rank's ``mine`` (a per-element tensor of its slices) as the whole flat vector in
        the parameters' order (a collective)."""
        return tf.concat(self._gathered(mine, tag), 0)

    def store(self) -> None:
        """Every rank's updated slices written back into the model's variables (a
        collective)."""
        for v, flat in zip(self.variables, self._gathered(self.var.value, "params"), strict=True):
            v.assign(tf.reshape(flat, v.shape))


class UnitExchange(GradientExchange):
    """The grouped reduce-scatter of :class:`UnitShard`, traced into the step
    (:class:`UnitKernels`); :meth:`run` is the same collective run eagerly. ``wire_bytes``
    counts what a rank hands Horovod a step: the whole gradient once per micro-batch (float16
    under ``fp16``) and its float32 slices once; ``dense_bytes`` the same in float32."""

    fusable = True

    def __init__(self, shard: UnitShard, compression: str, accumulation: int) -> None:
        self.shard, self.rank, self.size = shard, shard.rank, shard.size
        self.wire = WIRE[compression]
        item = 2 if compression == "fp16" else 4
        self._bytes = (float(item * shard.total * accumulation + 4 * shard.own),
                       float(4 * shard.total * accumulation + 4 * shard.own))
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}

    def run(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        began = time.perf_counter()
        mine = self.shard.reducescatter(grads, self.wire)
        self.note_fused(time.perf_counter() - began)
        return [mine]

    def note_fused(self, comm_s: float) -> None:
        wire, dense = self._bytes
        self.stats = {"wire_bytes": wire, "dense_bytes": dense, "comm_s": comm_s,
                      "compress_s": 0.0}

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

    def resize(self, rank: int, size: int, accumulation: int) -> None:
        check_resize(self.rank, self.size, rank, size)


class UnitKernels(TensorFlowKernels):
    """The TensorFlow kernels of stage 2: every micro-batch's gradients reduce-scattered by
    groups of units inside its traced function, an accumulator of the rank's shard only, the
    optimizer stepping the shard and the slices all-gathered back, all in the last micro-batch's
    function (:meth:`_fused_step`)."""

    def __init__(self, *args: Any, shard: UnitShard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard = shard

    def follow(self, exchange: GradientExchange, accumulation: int) -> None:
        key = (exchange.rank, exchange.size, accumulation)
        if self.traced_for == key:
            return
        if accumulation > 1 and not self.accumulators:  # the shard's gradient only
            self.accumulators = [tf.Variable(tf.zeros([self.shard.own]), trainable=False)]
        self.exchange = exchange
        self._compile()
        self.traced_for = key

    def _compile(self) -> None:
        batch = (*batch_signature(self.spec), tf.TensorSpec([], tf.float32))
        self._accumulate_fn = _traced(self._accumulate, batch)
        self._gradients_fn = _traced(self._gradients, batch)
        self._fused_fn = _traced(self._fused_step, batch)
        self.apply = _traced(self._apply, [[tf.TensorSpec([self.shard.own], tf.float32)]])
        self.precision.attach(self.optimizer, self.apply, [(self.shard.own,)])

    def _shard_gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                         ) -> tuple[tf.Tensor, dict, tf.Tensor]:
        """A micro-batch's loss, metrics and the average of this rank's slices of its gradient,
        plus what earlier micro-batches accumulated (then zeroed)."""
        loss_sum, metrics, grads = self._local_gradients(x, y, scale)
        mine = self.shard.reducescatter(grads, self.exchange.wire)
        return loss_sum, metrics, mine

    def _accumulate(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, dict]:
        loss_sum, metrics, mine = self._shard_gradients(x, y, scale)
        self.accumulators[0].assign_add(mine)
        return loss_sum, metrics

    def _gradients(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor
                   ) -> tuple[tf.Tensor, dict, list[tf.Tensor]]:
        loss_sum, metrics, mine = self._shard_gradients(x, y, scale)
        if self.accumulators:
            mine = mine + self.accumulators[0]
            self.accumulators[0].assign(tf.zeros_like(mine))
        return loss_sum, metrics, [mine]

    def _fused_step(self, x: tf.Tensor, y: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        """The last micro-batch with its reduce-scatters, the shard's update and the
        all-gather: its loss sum, metrics and the seconds of the all-gather, as one float64
        vector (the reduce-scatters run inside the backward pass and are not told apart)."""
        loss_sum, metrics, grads = self._gradients(x, y, scale)
        self._metric_keys = sorted(metrics)
        updated = self._step(grads)
        with tf.control_dependencies([updated]):
            gathered = tf.timestamp()
        with tf.control_dependencies([gathered]):
            self.shard.store()
        with tf.control_dependencies([v.value for v in self.shard.variables]):
            comm_s = tf.timestamp() - gathered
        values = [loss_sum, *(metrics[k] for k in self._metric_keys), comm_s]
        return tf.stack([tf.cast(v, tf.float64) for v in values])

    def _step(self, grads: list[tf.Tensor]) -> tf.Tensor:
        """Steps the shard with its averaged gradient."""
        if self.precision.scaling:  # fp16: skipped on every rank, or on none
            grads = agree_overflow(grads)
        self.precision.note(grads)
        var = self.shard.var
        if self.clip_norm:  # the norm of the whole gradient, summed over the shards
            grads = clip_shards(grads, self.clip_norm)
        if self.l2:  # as the ring's: L2 on the gradient, element by element
            grads = [g + self.precision.scale(self.optimizer, self.l2 * var.value) for g in grads]
        self.optimizer.apply_gradients(zip(grads, [var], strict=True))
        return tf.identity(var.value)

    def _apply(self, grads: list[tf.Tensor]) -> None:
        """The update outside the fused step (the loss scaler's path): step, then all-gather."""
        self._step(grads)
        self.shard.store()

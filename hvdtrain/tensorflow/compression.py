"""Gradient compression for TensorFlow: the kernels of :mod:`hvdtrain.compression.reference` in
TensorFlow and Horovod's TensorFlow collectives, which run the shared plans
(:mod:`hvdtrain.compression.exchange`).

A training step runs as: local gradients (a ``tf.function`` of :mod:`hvdtrain.tensorflow.step`),
then :meth:`CompressingExchange.run`, then the update. The exchange runs each plan stage in a
``tf.function`` (compute) and each round's Horovod collectives in a ``tf.function`` of their own,
whose calls it times: an eager call returns only when the collectives inside have finished, so that
time is the time this rank waited for the exchange. The dense methods (``none``, ``fp16``) are
:class:`hvdtrain.tensorflow.exchange.DenseAllreduce`, which the step can also trace whole.

With an update rule (:mod:`hvdtrain.compression.rules`: DGC, compressed Adam) the stages also
read and write the rule's state variables and the model's weights; they are traced once per
:class:`~hvdtrain.compression.rules.Phase` (the density warm-up's few ratios, Adam's warm-up and
after), and the step's numbers (Adam's bias corrections) come in as tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.compression import make_plan
from hvdtrain.compression import reference as ref
from hvdtrain.compression.exchange import Exchange
from hvdtrain.compression.plans import CommSettings
from hvdtrain.compression.rules import OptimizerSettings
from hvdtrain.compression.state import Slot
from hvdtrain.tensorflow.collectives import any_rank

Tensors = list[tf.Tensor]
DTYPES = {"float32": tf.float32, "float16": tf.float16}


# kernels: each mirrors the reference function of the same name ----------------------------------

def topk_compress(x: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor]:
    """The ``k`` largest-magnitude entries of flat ``x``: values and int32 indices, ascending."""
    # top_k with sorted=True puts the lower index first among equal magnitudes, as the reference.
    _, idx = tf.math.top_k(tf.abs(x), k, sorted=True)
    idx = tf.sort(idx)
    return tf.gather(x, idx), idx


def scatter(values: tf.Tensor, indices: tf.Tensor, n: int) -> tf.Tensor:
    """A dense float32 vector of ``n`` with ``values`` added at ``indices`` (repeats add up)."""
    return tf.math.unsorted_segment_sum(values, indices, n)


def randomk_compress(x: tf.Tensor, indices: tf.Tensor, scale: float) -> tf.Tensor:
    """The entries of flat ``x`` at ``indices`` times ``scale``."""
    return tf.gather(x, indices) * scale


def uniform(seed: tf.Tensor, n: int) -> tf.Tensor:
    """``n`` draws from U[0, 1), a function of the int64 scalar ``seed`` alone (stateless)."""
    seed = tf.cast(seed, tf.int64)
    return tf.random.stateless_uniform([n], seed=tf.stack([seed, tf.zeros_like(seed)]))


def _bucketed(flat: tf.Tensor, bucket: int) -> tf.Tensor:
    """``flat`` padded with zeros to whole buckets, one bucket per row (the reference's layout)."""
    n = int(flat.shape[-1])
    width = n if bucket <= 0 else bucket
    rows = ref.qsgd_buckets(n, bucket)
    padding = [[0, 0]] * (flat.shape.rank - 1) + [[0, rows * width - n]]
    return tf.reshape(tf.pad(flat, padding), [*flat.shape[:-1], rows, width])


def qsgd_compress(x: tf.Tensor, bucket: int, noise: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """int8 codes and float32 per-bucket scales of flat ``x``; ``noise``: U[0, 1), ``x``'s shape."""
    rows = _bucketed(x, bucket)
    scales = tf.reduce_max(tf.abs(rows), axis=1)
    safe = tf.where(scales > 0, scales, tf.ones_like(scales))[:, None]
    level = tf.floor(tf.abs(rows) / safe * float(ref.QSGD_LEVELS) + _bucketed(noise, bucket))
    level = tf.minimum(level, float(ref.QSGD_LEVELS))  # 127 + u may round to 128: see the reference
    codes = tf.reshape(tf.sign(rows) * level, [-1])[:int(x.shape[0])]
    return tf.cast(codes, tf.int8), scales


def qsgd_decompress(codes: tf.Tensor, scales: tf.Tensor, bucket: int) -> tf.Tensor:
    """The float32 vectors that ``codes`` and ``scales`` stand for; leading dimensions (ranks) pass
    through: codes ``(..., n)`` with scales ``(..., buckets)``."""
    n = int(codes.shape[-1])
    rows = _bucketed(tf.cast(codes, tf.float32), bucket)
    decoded = rows * (scales / float(ref.QSGD_LEVELS))[..., None]
    return tf.reshape(decoded, [*codes.shape[:-1], -1])[..., :n]


def qsgd_mean(codes: tf.Tensor, scales: tf.Tensor, bucket: int, size: int) -> tf.Tensor:
    """The mean of ``size`` ranks' decoded vectors (codes and scales one rank after another)."""
    return rank_mean(qsgd_decompress(tf.reshape(codes, [size, -1]), tf.reshape(scales, [size, -1]),
                                     bucket))


def rank_mean(stacked: tf.Tensor) -> tf.Tensor:
    """The mean over the first (rank) axis, summed in rank order like the reference's."""
    total = stacked[0]
    for r in range(1, int(stacked.shape[0])):
        total = total + stacked[r]
    return total / float(stacked.shape[0])


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """Modified Gram-Schmidt on the columns of ``p``, as the reference defines it."""
    cols = tf.unstack(p, axis=1)
    for i in range(len(cols)):
        cols[i] = cols[i] / (tf.sqrt(tf.reduce_sum(cols[i] * cols[i])) + ref.GRAM_SCHMIDT_EPS)
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - cols[i] * tf.reduce_sum(cols[i] * cols[j])
    return tf.stack(cols, axis=1)


def zero_at(x: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    """Flat ``x`` with the entries at ``indices`` set to 0."""
    flat = tf.reshape(x, [-1])
    idx = tf.reshape(tf.cast(indices, tf.int64), [-1, 1])
    return tf.tensor_scatter_nd_update(flat, idx, tf.zeros(tf.shape(idx)[:1], flat.dtype))


def fill_zeros(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """``x`` with its entries that are exactly 0 taken from ``y``."""
    return tf.where(tf.not_equal(x, 0.0), x, y)


def square_sum(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The squared global L2 norm of ``tensors``."""
    total = tf.zeros((), tf.float32)
    for t in tensors:
        total = total + tf.reduce_sum(tf.square(tf.cast(t, tf.float32)))
    return total


def clip_factor(tensors: Sequence[tf.Tensor], max_norm: float) -> tf.Tensor:
    """The factor that brings the global L2 norm of ``tensors`` to at most ``max_norm``."""
    total = tf.zeros((), tf.float32)
    for t in tensors:
        total = total + tf.reduce_sum(tf.square(tf.cast(t, tf.float32)))
    return tf.minimum(max_norm / (tf.sqrt(total) + 1e-6), 1.0)


class Kernels:
    """The TensorFlow kernels as :class:`hvdtrain.compression.kernels.Kernels`."""

    out_last = True

    zero_at = staticmethod(zero_at)
    fill_zeros = staticmethod(fill_zeros)
    clip_factor = staticmethod(clip_factor)
    square_sum = staticmethod(square_sum)
    sqrt = staticmethod(tf.sqrt)

    topk_compress = staticmethod(topk_compress)
    scatter = staticmethod(scatter)
    randomk_compress = staticmethod(randomk_compress)
    uniform = staticmethod(uniform)
    qsgd_compress = staticmethod(qsgd_compress)
    qsgd_mean = staticmethod(qsgd_mean)
    orthogonalize = staticmethod(orthogonalize)

    @staticmethod
    def flat(x: tf.Tensor) -> tf.Tensor:
        return tf.reshape(x, [-1])

    @staticmethod
    def reshape(x: tf.Tensor, shape: Sequence[int]) -> tf.Tensor:
        return tf.reshape(x, list(shape))

    @staticmethod
    def cast(x: tf.Tensor, dtype: str) -> tf.Tensor:
        return tf.cast(x, DTYPES[dtype])

    @staticmethod
    def matmul(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.matmul(a, b)

    @staticmethod
    def transpose(m: tf.Tensor) -> tf.Tensor:
        return tf.transpose(m)


# state and collectives --------------------------------------------------------------------------

class VariableStore:
    """State slots as ``tf.Variable`` s (:class:`hvdtrain.compression.kernels.Store`), which traced
    stages read and assign."""

    def __init__(self, slots: list[Slot]) -> None:
        self.variables = {
            s.key: tf.Variable(s.initial, trainable=False, name=s.key.replace("/", "_"))
            for s in slots}

    def read(self, key: str) -> tf.Tensor:
        return self.variables[key].value()

    def write(self, key: str, value: tf.Tensor) -> None:
        self.variables[key].assign(value)

    def numpy(self, key: str) -> np.ndarray:
        return self.variables[key].numpy().copy()

    def assign(self, key: str, value: np.ndarray) -> None:
        self.variables[key].assign(np.asarray(value, np.float32))


def _function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.function`` without XLA (Horovod's XLA ops are not built) or AutoGraph (plain Python
    loops over lists, unrolled once at trace time)."""
    return tf.function(fn, jit_compile=False, autograph=False)


def _by_dtype(tensors: Sequence[tf.Tensor]) -> dict[tf.DType, list[int]]:
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _collective(tag: str, gather: Tensors, average: Tensors,
                process_set: Any = hvd.global_process_set) -> tuple[Tensors, Tensors]:
    """Allgathers ``gather`` and averages ``average`` over the ranks (of ``process_set``: a
    pipeline stage's copies), one grouped op per dtype.

    Traced once per ``tag`` and input structure; the ops inside run concurrently, and an eager call
    returns when all have finished.
    """
    def grouped(collective: Any, tensors: Tensors, kind: str, **kwargs: Any) -> Tensors:
        out: list[Any] = [None] * len(tensors)
        for dtype, where in _by_dtype(tensors).items():
            name = f"hvdtrain.{tag}.{kind}.{dtype.name}"
            done = collective([tensors[i] for i in where], name=name, process_set=process_set,
                              **kwargs)
            for i, t in zip(where, done, strict=True):
                out[i] = t
        return out
    return (grouped(hvd.grouped_allgather, gather, "gather"),
            grouped(hvd.grouped_allreduce, average, "mean", op=hvd.Average))


class CompressingExchange(Exchange):
    """A plan run with TensorFlow kernels, its stages traced once each, and Horovod's grouped
    TensorFlow collectives."""

    kernels = Kernels()

    def _make_store(self, slots: list[Slot]) -> VariableStore:
        return VariableStore(slots)

    def _build(self) -> None:
        self._collect_fn = _function(_collective)
        super()._build()

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return _function(fn)

    def _tensor(self, array: np.ndarray) -> tf.Tensor:
        return tf.constant(array)

    def _nbytes(self, tensors: Sequence[tf.Tensor]) -> int:
        return sum(t.shape.num_elements() * t.dtype.size for t in tensors)

    def _collect(self, tag: str, gather: Tensors, mean: Tensors) -> tuple[Tensors, Tensors]:
        return self._collect_fn(tag, gather, mean)

    def _allgather_rows(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(tf.constant(array[None]), name=name).numpy()

    def _broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return hvd.broadcast(tf.constant(array), root_rank, name=name).numpy()

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)


def make_compressing(comm: CommSettings, seed: int, rank: int, size: int,
                     shapes: Sequence[Sequence[int]], opt: OptimizerSettings | None = None,
                     weights: Callable[[], Sequence[tf.Tensor]] | None = None
                     ) -> CompressingExchange:
    """The exchange for ``comm.compression`` over gradients of these shapes (the model's order);
    ``opt``: the run's optimizer, where the exchange may apply its update rule, which reads the
    parameters (``weights``, in the same order) for weight decay."""
    return CompressingExchange(make_plan(comm, seed, shapes, out_last=Kernels.out_last), rank, size,
                              opt, weights)

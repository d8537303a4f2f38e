"""Gradient compression for TensorFlow: the kernels of :mod:`hvdtrain.compression.reference` in
TensorFlow, and the exchange that averages a step's gradients over the ranks with them.

A training step runs as: local gradients (the engine's ``tf.function``), then
:meth:`GradientExchange.run`, then the update. The exchange runs compression kernels in
``tf.function`` s (compute) and the Horovod collectives in a ``tf.function`` of their own, whose calls
it times: an eager call returns only when the collectives inside have finished, so that time is the
time this rank waited for the exchange. Every method, ``none`` included, goes this way, so ``none``
costs one collective call per step (one grouped allreduce, as ``DistributedGradientTape`` makes).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import hvdtrain.tensorflow  # noqa: F401  (quiets TensorFlow before it loads)
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.compression import reference as ref
from hvdtrain.config import CommConfig
from hvdtrain.errors import HvdtrainError

Tensors = list[tf.Tensor]


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


def _bucketed(flat: tf.Tensor, bucket: int) -> tf.Tensor:
    """``flat`` padded with zeros to whole buckets, one bucket per row (the reference's layout)."""
    n = int(flat.shape[-1])
    width = n if bucket <= 0 else bucket
    rows = ref.qsgd_buckets(n, bucket)
    padding = [[0, 0]] * (flat.shape.rank - 1) + [[0, rows * width - n]]
    return tf.reshape(tf.pad(flat, padding), [*flat.shape[:-1], rows, width])


def qsgd_compress(x: tf.Tensor, bucket: int, noise: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """int8 codes and float32 per-bucket scales of flat ``x``; ``noise`` is U[0, 1), shape of ``x``."""
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


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """Modified Gram-Schmidt on the columns of ``p``, as the reference defines it."""
    cols = tf.unstack(p, axis=1)
    for i in range(len(cols)):
        cols[i] = cols[i] / (tf.sqrt(tf.reduce_sum(cols[i] * cols[i])) + ref.GRAM_SCHMIDT_EPS)
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - cols[i] * tf.reduce_sum(cols[i] * cols[j])
    return tf.stack(cols, axis=1)


def rank_mean(stacked: tf.Tensor) -> tf.Tensor:
    """The mean over the first (rank) axis, summed in rank order like the reference's."""
    total = stacked[0]
    for r in range(1, int(stacked.shape[0])):
        total = total + stacked[r]
    return total / float(stacked.shape[0])


def _function(fn: Any) -> Any:
    """``tf.function`` without XLA (Horovod's XLA ops are not built) or AutoGraph (plain Python
    loops over lists, unrolled once at trace time)."""
    return tf.function(fn, jit_compile=False, autograph=False)


# the collectives --------------------------------------------------------------------------------

def _by_dtype(tensors: Sequence[tf.Tensor]) -> dict[tf.DType, list[int]]:
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _collective(tag: str, gather: Tensors, average: Tensors) -> tuple[Tensors, Tensors]:
    """Allgathers ``gather`` and averages ``average`` over the ranks, one grouped op per dtype.

    Traced once per ``tag`` and input structure; the ops inside run concurrently, and an eager call
    returns when all have finished.
    """
    def grouped(collective: Any, tensors: Tensors, kind: str, **kwargs: Any) -> Tensors:
        out: list[Any] = [None] * len(tensors)
        for dtype, where in _by_dtype(tensors).items():
            name = f"hvdtrain.{tag}.{kind}.{dtype.name}"
            done = collective([tensors[i] for i in where], name=name, **kwargs)
            for i, t in zip(where, done):
                out[i] = t
        return out
    return (grouped(hvd.grouped_allgather, gather, "gather"),
            grouped(hvd.grouped_allreduce, average, "mean", op=hvd.Average))


def nbytes(tensors: Sequence[tf.Tensor]) -> int:
    """Bytes of these (eager) tensors' contents."""
    return sum(t.shape.num_elements() * t.dtype.size for t in tensors)


# the exchange -----------------------------------------------------------------------------------

class GradientExchange:
    """Averages gradients over ranks with one ``comm.compression`` method; the reference gives the
    math. This base class carries everything densely (``none``, and ``fp16`` as half floats).

    ``run(grads)`` returns the (approximate) average of each gradient over the ranks. Its state
    (the step counter that seeds random draws, error-feedback residuals, PowerSGD's Q) is saved by
    :meth:`checkpoint_arrays` and restored exactly by :meth:`load_arrays`.
    """

    error_feedback = False  # whether this method keeps residuals (when comm.error_feedback is on)

    def __init__(self, comm: CommConfig, seed: int, rank: int, size: int,
                 shapes: Sequence[Sequence[int]]) -> None:
        self.comm, self.seed, self.rank, self.size = comm, seed, rank, size
        self.method = comm.compression
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.compressed = [ref.compressible(self.method, s, comm.min_size, comm.rank)
                           for s in self.shapes]
        self.chosen = [i for i, c in enumerate(self.compressed) if c]
        """Indices of the tensors this method compresses."""
        self.step = 0
        self.residuals = {i: tf.Variable(tf.zeros([n]), trainable=False, name=f"residual_{i}")
                          for i, n in enumerate(self.sizes)
                          if self.compressed[i] and self.error_feedback and comm.error_feedback}
        self.stats = {"wire_bytes": 0.0, "dense_bytes": 0.0, "comm_s": 0.0, "compress_s": 0.0}
        """The last step's bytes handed to Horovod, the fp32 bytes they stand for, the seconds
        waited for the collectives and the rest of the exchange's time (kernels, host draws)."""
        self.compress_s_total = 0.0
        self._wire, self._waited = 0, 0.0
        self._gathered: tuple[int, dict[str, np.ndarray]] | None = None
        self._saved_rows: dict[int, np.ndarray] = {}  # after a restore: residuals, a row per rank
        self._build()

    def _build(self) -> None:
        """Wraps the kernels and collectives in ``tf.function`` s, each traced once (lists of fixed
        shapes; the step is a tensor). The traces hold the world size, so a resize rebuilds them."""
        self._collect = _function(_collective)
        self._compress_fn = _function(self._compress)
        self._decompress_fn = _function(self._decompress)
        self._cast = _function(lambda ts, dtype: [tf.cast(t, dtype) for t in ts])

    def resize(self, rank: int, size: int) -> None:
        """Continues at another world size (elastic mode): this rank keeps its residuals."""
        self.rank, self.size = rank, size
        self._build()

    def run(self, grads: Tensors) -> Tensors:
        """The average over ranks of each gradient (one per shape, in order)."""
        self.step += 1
        self._wire, self._waited = 0, 0.0
        start = time.perf_counter()
        out = self._exchange(grads)
        compress_s = time.perf_counter() - start - self._waited
        dense = nbytes(grads) if self._wire else 0  # bytes replaced only where bytes were sent
        self.stats = {"wire_bytes": float(self._wire), "dense_bytes": float(dense),
                      "comm_s": self._waited, "compress_s": compress_s}
        self.compress_s_total += compress_s
        return out

    def _send(self, tag: str, gather: Tensors, average: Tensors) -> tuple[Tensors, Tensors]:
        """Hands these tensors to Horovod, counting their bytes and the time waited for them."""
        self._wire += nbytes(gather) + nbytes(average)
        start = time.perf_counter()
        try:
            return self._collect(tag, gather, average)
        finally:
            self._waited += time.perf_counter() - start

    def _exchange(self, grads: Tensors) -> Tensors:
        if self.size == 1:
            # Nothing to average, and nothing sent: Horovod's own optimizers skip it too.
            return grads
        if self.method == "fp16":
            _, mean = self._send("fp16", [], self._cast(grads, tf.float16))
            return self._cast(mean, tf.float32)
        return self._send("dense", [], grads)[1]

    def _compress(self, *args: Any) -> Any:
        """A method's compression kernels (a ``tf.function``); the dense exchange has none."""
        raise NotImplementedError

    def _decompress(self, *args: Any) -> Any:
        """A method's decompression kernels (a ``tf.function``); the dense exchange has none."""
        raise NotImplementedError

    def _dense(self, grads: Tensors) -> Tensors:
        """The tensors this method does not compress, flat, in order."""
        return [tf.reshape(g, [-1]) for g, c in zip(grads, self.compressed) if not c]

    def _merge(self, compressed: Sequence[tf.Tensor], dense: Sequence[tf.Tensor]) -> Tensors:
        """Both kinds back in parameter order and shape."""
        parts, dense_iter = iter(compressed), iter(dense)
        return [tf.reshape(next(parts) if c else next(dense_iter), s)
                for c, s in zip(self.compressed, self.shapes)]

    def _acc(self, i: int, grad: tf.Tensor) -> tf.Tensor:
        """Error feedback: the flat gradient plus what this rank left unsent before."""
        flat = tf.reshape(grad, [-1])
        return flat + self.residuals[i] if i in self.residuals else flat

    def _keep(self, i: int, acc: tf.Tensor, sent: tf.Tensor) -> None:
        if i in self.residuals:
            self.residuals[i].assign(ref.new_residual(acc, sent))

    # state ------------------------------------------------------------------------------------

    def q_variables(self) -> dict[int, tf.Variable]:
        """PowerSGD's Q per tensor index (none for other methods)."""
        return {}

    def gather_residuals(self) -> None:
        """Collects every rank's residuals on all ranks (a collective; no-op without residuals)."""
        arrays = {f"residual/{i}": hvd.allgather(var.value()[None], name=f"hvdtrain.ckpt.res.{i}")
                  for i, var in self.residuals.items()}
        self._gathered = (self.step, {k: v.numpy() for k, v in arrays.items()})

    def checkpoint_arrays(self) -> dict[str, np.ndarray]:
        """The state to checkpoint: method, step, Q and the residuals of all ranks (rows by rank).

        Residuals come from the last :meth:`gather_residuals` if it ran at this step; otherwise
        (an elastic commit at the start, before any was gathered) only a single rank's own are
        known, and they are left out rather than handed to every rank on restore.
        """
        arrays = {"method": np.array(self.method), "step": np.array(self.step, np.int64)}
        arrays |= {f"q/{i}": q.numpy() for i, q in self.q_variables().items()}
        if self._gathered is not None and self._gathered[0] == self.step:
            arrays |= self._gathered[1]
        elif self.size == 1:
            arrays |= {f"residual/{i}": v.numpy()[None] for i, v in self.residuals.items()}
        return arrays

    def load_arrays(self, arrays: dict[str, np.ndarray], where: str) -> None:
        """Restores :meth:`checkpoint_arrays`' output; :meth:`broadcast` then hands each rank its
        residuals (only rank 0 reads a checkpoint)."""
        saved = str(arrays.get("method", self.method))
        if saved != self.method and len(arrays) > 2:
            raise HvdtrainError(f"{where}: its compression state is for {saved!r}, this run uses "
                                f"comm.compression={self.method!r}")
        self.step = int(arrays.get("step", self.step))
        for i, q in self.q_variables().items():
            if f"q/{i}" in arrays:
                q.assign(arrays[f"q/{i}"])
        self._saved_rows = {i: arrays[f"residual/{i}"] for i in self.residuals
                            if f"residual/{i}" in arrays}
        for i, rows in self._saved_rows.items():
            self.residuals[i].assign(self._rows_for_world(rows)[self.rank])

    def _rows_for_world(self, rows: np.ndarray) -> np.ndarray:
        """Saved residuals (one row per rank then) as one row per rank now: the same rows at the
        same world size; otherwise every rank gets their mean, so that the update the ranks still
        owe, the mean of their residuals, is unchanged."""
        if rows.shape[0] == self.size:
            return rows
        return np.repeat(rows.mean(axis=0, keepdims=True), self.size, axis=0)

    def broadcast(self, root_rank: int = 0) -> None:
        """Gives every rank the root's step, Q and, after a restore, its own row of residuals."""
        restored = int(bool(self._saved_rows))
        head = hvd.broadcast(tf.constant([self.step, restored], tf.int64), root_rank,
                             name="hvdtrain.exchange.head").numpy()
        self.step = int(head[0])
        if self.q_variables():
            hvd.broadcast_variables(list(self.q_variables().values()), root_rank=root_rank)
        if head[1]:
            for i, var in self.residuals.items():
                table = (self._rows_for_world(self._saved_rows[i]) if i in self._saved_rows
                         else np.zeros((self.size, self.sizes[i]), np.float32))
                rows = hvd.broadcast(tf.constant(table), root_rank, name=f"hvdtrain.exchange.res.{i}")
                var.assign(rows[self.rank])
        self._saved_rows = {}


class TopK(GradientExchange):
    """Top-k sparsification: values and indices allgathered, scatter-added, averaged."""

    error_feedback = True

    def _exchange(self, grads: Tensors) -> Tensors:
        values, indices, dense = self._compress_fn(grads)
        gathered, mean = self._send("topk", [*values, *indices], dense)
        return self._decompress_fn(gathered, mean)

    def _compress(self, grads: Tensors) -> tuple[Tensors, Tensors, Tensors]:
        dense = self._dense(grads)
        values, indices = [], []
        for i in self.chosen:
            acc = self._acc(i, grads[i])
            v, idx = topk_compress(acc, ref.num_selected(self.sizes[i], self.comm.ratio))
            self._keep(i, acc, scatter(v, idx, self.sizes[i]))
            values.append(v)
            indices.append(idx)
        return values, indices, dense

    def _decompress(self, gathered: Tensors, mean: Tensors) -> Tensors:
        values, indices = gathered[:len(self.chosen)], gathered[len(self.chosen):]
        sums = [scatter(v, idx, self.sizes[i]) / float(self.size)
                for i, v, idx in zip(self.chosen, values, indices)]
        return self._merge(sums, mean)


class RandomK(GradientExchange):
    """Random-k sparsification: indices shared by all ranks for the step, values allreduced."""

    error_feedback = True

    def indices(self) -> Tensors:
        """This step's indices per compressed tensor, drawn on the host by the reference."""
        return [tf.constant(ref.randomk_indices(self.sizes[i], ref.num_selected(self.sizes[i],
                                                                                 self.comm.ratio),
                                                self.seed, self.step, i))
                for i, c in enumerate(self.compressed) if c]

    def _exchange(self, grads: Tensors) -> Tensors:
        indices = self.indices()
        values, dense = self._compress_fn(grads, indices)
        _, mean = self._send("randomk", [], [*values, *dense])
        return self._decompress_fn(mean, indices)

    def _compress(self, grads: Tensors, indices: Tensors) -> tuple[Tensors, Tensors]:
        dense = self._dense(grads)
        values = []
        for i, idx in zip(self.chosen, indices):
            n = self.sizes[i]
            acc = self._acc(i, grads[i])
            scale = ref.randomk_scale(n, ref.num_selected(n, self.comm.ratio),
                                      self.comm.error_feedback)
            v = randomk_compress(acc, idx, scale)
            self._keep(i, acc, scatter(v, idx, n))
            values.append(v)
        return values, dense

    def _decompress(self, mean: Tensors, indices: Tensors) -> Tensors:
        dense = [scatter(v, idx, self.sizes[i]) for i, v, idx in zip(self.chosen, mean, indices)]
        return self._merge(dense, mean[len(self.chosen):])


class QSGD(GradientExchange):
    """8-bit stochastic quantization: codes and scales allgathered, each rank decodes all."""

    def _exchange(self, grads: Tensors) -> Tensors:
        codes, scales, dense = self._compress_fn(grads, tf.constant(self.step, tf.int64))
        gathered, mean = self._send("qsgd", [*codes, *scales], dense)
        return self._decompress_fn(gathered, mean)

    def noise(self, step: tf.Tensor, index: int, n: int) -> tf.Tensor:
        """U[0, 1) for tensor ``index`` at ``step``: stateless, from (seed, rank, step, index), so a
        resumed run draws what the uninterrupted one would have, and ranks draw independently."""
        key = tf.constant([self.seed, self.rank], tf.int64)
        for data in (step, tf.constant(index, tf.int64)):
            key = tf.random.experimental.stateless_fold_in(key, data)
        return tf.random.stateless_uniform([n], seed=key)

    def _compress(self, grads: Tensors, step: tf.Tensor) -> tuple[Tensors, Tensors, Tensors]:
        dense = self._dense(grads)
        pairs = [qsgd_compress(tf.reshape(grads[i], [-1]), self.comm.bucket,
                               self.noise(step, i, self.sizes[i])) for i in self.chosen]
        return [c for c, _ in pairs], [s for _, s in pairs], dense

    def _decompress(self, gathered: Tensors, mean: Tensors) -> Tensors:
        codes, scales = gathered[:len(self.chosen)], gathered[len(self.chosen):]
        decoded = []
        for i, c, s in zip(self.chosen, codes, scales):
            n, buckets = self.sizes[i], ref.qsgd_buckets(self.sizes[i], self.comm.bucket)
            decoded.append(rank_mean(qsgd_decompress(tf.reshape(c, [self.size, n]),
                                                     tf.reshape(s, [self.size, buckets]),
                                                     self.comm.bucket)))
        return self._merge(decoded, mean)


class PowerSGD(GradientExchange):
    """Rank-r PowerSGD: P averaged, orthogonalised, Q averaged; Q warm-starts the next step."""

    error_feedback = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.q = {i: tf.Variable(ref.powersgd_initial_q(s, self.comm.rank, self.seed, i),
                                 trainable=False, name=f"powersgd_q_{i}")
                  for i, s in enumerate(self.shapes) if self.compressed[i]}

    def _build(self) -> None:
        super()._build()
        self._project_fn = _function(self._project)
        self._factor_fn = _function(self._factor)
        self._expand_fn = _function(self._expand)

    def q_variables(self) -> dict[int, tf.Variable]:
        return self.q

    def _exchange(self, grads: Tensors) -> Tensors:
        matrices, p, dense = self._project_fn(grads)
        _, mean = self._send("powersgd.p", [], [*p, *dense])
        ps, local_q = self._factor_fn(matrices, mean[:len(p)])
        _, q = self._send("powersgd.q", [], local_q)
        return self._expand_fn(ps, q, mean[len(p):])

    def _project(self, grads: Tensors) -> tuple[Tensors, Tensors, Tensors]:
        """Each compressed M (gradient + residual, as a matrix) and this rank's ``M Q``."""
        dense = self._dense(grads)
        matrices = [tf.reshape(self._acc(i, grads[i]), ref.matrix_shape(self.shapes[i]))
                    for i in self.chosen]
        return matrices, [m @ self.q[i] for i, m in zip(self.chosen, matrices)], dense

    def _factor(self, matrices: Tensors, p_mean: Tensors) -> tuple[Tensors, Tensors]:
        """Orthogonal P per matrix, then this rank's ``M^T P``; keeps the residual ``M - P (M^T P)^T``."""
        ps = [orthogonalize(p) for p in p_mean]
        local_q = [tf.transpose(m) @ p for m, p in zip(matrices, ps)]
        for i, m, p, lq in zip(self.chosen, matrices, ps, local_q):
            self._keep(i, tf.reshape(m, [-1]), tf.reshape(p @ tf.transpose(lq), [-1]))
        return ps, local_q

    def _expand(self, ps: Tensors, q_mean: Tensors, dense: Tensors) -> Tensors:
        for i, q in zip(self.chosen, q_mean):
            self.q[i].assign(q)
        return self._merge([p @ tf.transpose(q) for p, q in zip(ps, q_mean)], dense)


_METHODS: dict[str, type[GradientExchange]] = {
    "none": GradientExchange, "fp16": GradientExchange, "topk": TopK, "randomk": RandomK,
    "qsgd": QSGD, "powersgd": PowerSGD}


def make_exchange(comm: CommConfig, seed: int, rank: int, size: int,
                  shapes: Sequence[Sequence[int]]) -> GradientExchange:
    """The exchange for ``comm.compression`` over tensors of these shapes (the model's order)."""
    if comm.compression not in _METHODS:
        raise HvdtrainError(f"comm.compression={comm.compression!r}: one of {', '.join(_METHODS)} "
                            "for tensorflow")
    return _METHODS[comm.compression](comm, seed, rank, size, shapes)

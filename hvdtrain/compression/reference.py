"""The NumPy reference of every gradient compressor: the spec that the torch and TensorFlow kernels
are tested against. Training never runs through this module, except for the host-side draws below
(random-k indices and PowerSGD's first Q), which the kernels take from here so that both frameworks
select exactly the same entries.

Conventions, shared by both frameworks:

- A gradient is a float32 tensor of ``n`` elements, taken flat (row-major) except by PowerSGD, which
  takes it as the matrix ``(shape[0], n // shape[0])``. Tensors are numbered ``index = 0, 1, ...``
  in the model's parameter order; the exchange of step ``step`` (1 for the first optimizer step)
  uses ``seed`` = the config's ``seed``, never ``seed + rank``, so all ranks agree.
- :func:`philox` is the one random stream both frameworks reproduce:
  ``numpy.random.Generator(numpy.random.Philox(key=[seed, (step << 32) | index]))``.
- ``k = max(1, floor(ratio * n))`` entries are kept by top-k and random-k (:func:`num_selected`).
- **Error feedback** (top-k, random-k, PowerSGD): ``acc = grad + residual`` is compressed; this
  rank's own contribution ``sent`` (its compressed ``acc``, decompressed locally) leaves
  ``residual' = acc - sent``, so ``sent + residual' == residual + grad`` (nothing is lost, only
  late).
- Aggregation is the mean over ranks of the ranks' decompressed contributions.

Methods:

- **topk**: the ``k`` entries of largest ``|acc|`` (ties: lower index first), as float32 values and
  int32 indices in ascending index order. Ranks pick different indices, so the values cannot be
  allreduced: every rank allgathers all ``(values, indices)`` pairs and scatter-adds them.
  Wire: ``8k`` bytes per rank.
- **randomk**: ``k`` distinct indices ``sorted(philox(seed, step, index).choice(n, k,
  replace=False))``, the same on every rank, so the selected values are allreduced densely. Without
  error feedback the values are scaled by ``n / k``, which makes the estimate unbiased; with it they
  are not (the residual carries the rest). Wire: ``4k`` bytes per rank.
- **qsgd**: 8-bit stochastic quantization with ``s = 127`` levels. Per bucket of ``bucket``
  consecutive elements (the last may be shorter; 0 = the whole tensor), ``scale = max|x|`` (float32)
  and ``code = sign(x) * floor(|x| / scale * 127 + u)`` as int8, ``u ~ U[0, 1)`` float32, one draw
  per element (0 codes where ``scale == 0``). Decoding is ``code * (scale / 127)``. ``E[floor(y +
  u)] = y``, so the decoded tensor is unbiased. The noise ``u`` is an argument: tests pass the same
  array to the reference and the kernel. In training it is stateless: each framework draws it from
  its own generator seeded with :func:`noise_seed` of ``(seed, rank, step, index)``, so a resumed
  run draws what an uninterrupted one would, and ranks draw independently (less variance in the
  mean). Codes with different scales are not summable (and int8 sums overflow), so ranks allgather
  codes and scales and each decodes and averages them all. Wire: ``n + 4 * ceil(n / bucket)`` bytes
  per rank.
- **powersgd** (Vogels et al., 2019): for the matrix ``M`` (rows x cols, :func:`matrix_shape`) and rank
  ``r = min(rank, rows, cols)``, with ``Q`` (cols x r) kept across steps (warm start; initially
  ``philox(seed, 0, index).standard_normal((cols, r), float32)``): ``P = mean_ranks(M Q)``;
  ``P = orthogonalize(P)`` (modified Gram-Schmidt, :func:`orthogonalize`); ``Q = mean_ranks(M^T
  P)``; the result is ``P Q^T``. A rank's own contribution is ``P (M^T P)^T``, which feeds error
  feedback. At full rank ``P P^T`` projects onto the column space of ``M``, so the result is the
  exact mean. Wire: ``4 r (rows + cols)`` bytes per rank.
- Tensors that a method does not compress (:func:`large_enough`, and for PowerSGD also
  :func:`low_rank_pays`) are averaged densely as float32.

Update rules (:mod:`hvdtrain.compression.rules`): where the exchange applies the optimizer's
momentum itself, it returns an update *direction* ``d`` that plain SGD applies (``w -= lr d``):

- **DGC** (Lin et al., 2018; ``topk`` and ``randomk`` with SGD momentum ``m``): the local gradient
  gets the L2 weight decay (``g + wd w``), then local clipping (:func:`clip_factor`: the rank's
  global norm at most ``clip_norm / sqrt(N)``); momentum correction accumulates the velocity
  ``u = m u + g`` into the residual ``v = v + u``; ``v`` is compressed (``sent``), ``v -= sent``,
  and momentum factor masking clears ``u`` where entries were sent (:func:`zero_at`). The
  direction is the mean of the ranks' ``sent``. Tensors sent dense keep ordinary momentum on the
  average: ``u = m u + mean(g)``, ``d = u``. A density warm-up (:func:`warmup_ratio`) sends 25%,
  6.25%, 1.56%, ... of the entries in equal stages over the first ``warmup_steps`` steps.
- **Compressed Adam** (1-bit Adam / 0/1 Adam's design; ``topk``, ``randomk``, ``qsgd`` with Adam
  or AdamW): for the first ``dense_steps`` every tensor is averaged dense and the direction
  is Adam's (:func:`adam_direction`, bias-corrected, ``g + wd w`` for Adam's L2). Then each
  compressed tensor's variance ``v`` is frozen; each rank compresses its local momentum
  ``b1 m + (1 - b1) g`` plus its residual (error feedback), the mean of what the ranks sent is the
  new shared ``m``, and the direction uses the frozen ``v``. An entry of ``v`` that is exactly 0
  (its gradient was 0 through the warm-up) freezes at the first step whose exchanged gradient
  ``g = (m - b1 m_old) / (1 - b1)`` is nonzero, as ``v = (1 - b2) g^2`` (Adam's first update; a
  first direction of at most Kingma and Ba's bound ``(1 - b1) / sqrt(1 - b2)``), not at ``v = 0``,
  whose direction would be ``m / eps`` (:func:`fill_zeros`). AdamW's decoupled decay is added to
  the direction, ``d + wd w`` (plain SGD's ``w -= lr (d + wd w)`` is AdamW's update exactly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

QSGD_LEVELS = 127
"""Quantization levels of qsgd on each side of zero: codes lie in [-127, 127] (int8)."""

GRAM_SCHMIDT_EPS = 1e-8
"""Added to a column's norm before dividing, so that an all-zero column stays zero."""


def philox(seed: int, step: int, index: int) -> np.random.Generator:
    """The shared random stream of ``(seed, step, tensor index)`` that both frameworks use."""
    if not (0 <= step < 2**32 and 0 <= index < 2**32):
        raise ValueError(f"step={step} and index={index} must lie in [0, 2**32)")
    return np.random.Generator(np.random.Philox(key=[seed, (step << 32) | index]))


def noise_seed(seed: int, rank: int, step: int, index: int) -> int:
    """The seed in ``[0, 2**63)`` of qsgd's noise for tensor ``index`` on ``rank`` at ``step``."""
    words = np.random.SeedSequence([seed, rank, step, index]).generate_state(1, np.uint64)
    return int(words[0] >> np.uint64(1))


def qsgd_noise(seed: int, n: int) -> np.ndarray:
    """qsgd's U[0, 1) float32 noise for ``n`` elements drawn in NumPy from :func:`noise_seed`'s
    ``seed`` (the parameter servers' draw; the framework kernels draw from their own generators)."""
    return np.random.Generator(np.random.Philox(seed)).random(n, dtype=np.float32)


def num_selected(n: int, ratio: float) -> int:
    """How many entries top-k and random-k keep from ``n``."""
    return max(1, min(n, math.floor(ratio * n)))


def matrix_shape(shape: Sequence[int], out_last: bool = False) -> tuple[int, int]:
    """The matrix PowerSGD sees: a layer's outputs by the product of the other dimensions.

    PyTorch keeps the outputs in a weight's first dimension (a convolution's ``(out, in, kh,
    kw)``: ``out`` rows); Keras keeps them in its last (``(kh, kw, in, out)``: ``out`` columns),
    which ``out_last`` says, so that both frameworks factor the same matrix (transposed) rather
    than Keras's kernel height by the rest."""
    if out_last:
        cols = int(shape[-1])
        return int(np.prod(shape)) // max(cols, 1), cols
    rows = int(shape[0])
    return rows, int(np.prod(shape)) // max(rows, 1)


def large_enough(shape: Sequence[int], min_size: int) -> bool:
    """Whether a tensor of ``shape`` is worth compressing: tensors under ``min_size`` elements (and
    empty ones) travel dense, float32."""
    n = int(np.prod(shape)) if len(shape) else 1
    return n >= max(min_size, 1)


def low_rank_pays(shape: Sequence[int], rank: int, out_last: bool = False) -> bool:
    """Whether PowerSGD's factors of ``shape`` (:func:`matrix_shape`) are smaller than the
    tensor: never for a vector."""
    if len(shape) < 2:
        return False
    rows, cols = matrix_shape(shape, out_last)
    r = min(rank, rows, cols)
    return r * (rows + cols) < rows * cols


def error_feedback(grad: np.ndarray, residual: np.ndarray | None) -> np.ndarray:
    """The tensor to compress: the gradient plus what earlier steps left unsent."""
    return grad if residual is None else grad + residual


def new_residual(acc: np.ndarray, sent: np.ndarray) -> np.ndarray:
    """What this rank did not send this step: ``acc - sent``."""
    return acc - sent


def scatter(values: np.ndarray, indices: np.ndarray, n: int) -> np.ndarray:
    """A dense float32 vector of ``n`` with ``values`` added at ``indices``."""
    out = np.zeros(n, dtype=np.float32)
    np.add.at(out, indices, values)
    return out


def dense_mean(tensors: Sequence[np.ndarray]) -> np.ndarray:
    """The mean over ranks, summed in rank order (as Horovod's ring does, up to rounding)."""
    total = np.zeros_like(tensors[0], dtype=np.float32)
    for t in tensors:
        total = total + t
    return total / np.float32(len(tensors))


def warmup_ratio(ratio: float, step: int, warmup_steps: int) -> float:
    """DGC's density warm-up: the fraction sent at ``step`` (from 1). The first ``warmup_steps``
    steps are split into ``ceil(log4(1 / ratio))`` equal stages sending 25%, 6.25%, ... (never
    below ``ratio``); afterwards ``ratio``."""
    if warmup_steps <= 0 or step > warmup_steps or ratio >= 0.25:
        return ratio
    stages = math.ceil(math.log(1.0 / ratio, 4))
    stage = min(stages - 1, (step - 1) * stages // warmup_steps)
    return max(ratio, 0.25 ** (stage + 1))


def square_sum(tensors: Sequence[np.ndarray]) -> np.float32:
    """The squared global L2 norm of ``tensors`` (what the adaptive rule reads of an average)."""
    return np.float32(sum(np.sum(t.astype(np.float32) ** 2) for t in tensors))


def clip_factor(tensors: Sequence[np.ndarray], max_norm: float) -> np.float32:
    """The factor that brings the global L2 norm of ``tensors`` to at most ``max_norm``."""
    total = np.float32(sum(np.sum(t.astype(np.float32) ** 2) for t in tensors))
    return np.float32(min(1.0, max_norm / (np.sqrt(total) + 1e-6)))


def zero_at(x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Flat ``x`` with the entries at ``indices`` set to 0 (momentum factor masking)."""
    out = x.reshape(-1).copy()
    out[indices] = 0
    return out


def fill_zeros(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x`` with its entries that are exactly 0 taken from ``y`` (compressed Adam's variance of
    entries that had none to freeze)."""
    return np.where(x != 0, x, y).astype(np.float32)


def adam_direction(m: np.ndarray, v: np.ndarray, t_m: int, t_v: int, beta1: float,
                   beta2: float, eps: float) -> np.ndarray:
    """Adam's bias-corrected step direction from ``m`` (after ``t_m`` updates) and ``v`` (after
    ``t_v``): ``(m / (1 - b1^t_m)) / (sqrt(v / (1 - b2^t_v)) + eps)``, as torch's Adam."""
    m_hat = m / np.float32(1 - beta1 ** t_m)
    return (m_hat / (np.sqrt(v / np.float32(1 - beta2 ** t_v)) + np.float32(eps))).astype(np.float32)


# top-k ------------------------------------------------------------------------------------------

def topk_compress(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest-magnitude entries of flat ``x``: float32 values, int32 indices in order."""
    flat = x.reshape(-1)
    order = np.argsort(-np.abs(flat), kind="stable")[:k]
    idx = np.sort(order).astype(np.int32)
    return flat[idx].astype(np.float32), idx


def sparse_mean(per_rank: Sequence[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """The mean over ranks of sparse contributions ``(values, indices)``, as a dense vector."""
    return dense_mean([scatter(v, i, n) for v, i in per_rank])


# random-k ---------------------------------------------------------------------------------------

def randomk_indices(n: int, k: int, seed: int, step: int, index: int) -> np.ndarray:
    """The ``k`` distinct indices all ranks take for tensor ``index`` at ``step``: int32, sorted."""
    chosen = philox(seed, step, index).choice(n, size=k, replace=False)
    return np.sort(chosen).astype(np.int32)


def randomk_scale(n: int, k: int, error_feedback: bool) -> float:
    """The factor on the selected values: ``n / k`` (unbiased) without error feedback, else 1."""
    return 1.0 if error_feedback else n / k


def randomk_compress(x: np.ndarray, indices: np.ndarray, scale: float) -> np.ndarray:
    """The selected entries of flat ``x`` times ``scale``, float32."""
    return (x.reshape(-1)[indices] * np.float32(scale)).astype(np.float32)


def randomk_mean(per_rank_values: Sequence[np.ndarray], indices: np.ndarray, n: int) -> np.ndarray:
    """The mean over ranks of values at the shared indices, as a dense vector."""
    return scatter(dense_mean(per_rank_values), indices, n)


# qsgd -------------------------------------------------------------------------------------------

def qsgd_buckets(n: int, bucket: int) -> int:
    """How many scales a tensor of ``n`` elements has."""
    return 1 if bucket <= 0 else max(1, math.ceil(n / bucket))


def _bucketed(flat: np.ndarray, bucket: int) -> np.ndarray:
    """``flat`` padded with zeros to whole buckets, one bucket per row."""
    n = flat.size
    width = n if bucket <= 0 else bucket
    rows = qsgd_buckets(n, bucket)
    padded = np.zeros(rows * width, dtype=np.float32)
    padded[:n] = flat
    return padded.reshape(rows, width)


def qsgd_compress(x: np.ndarray, bucket: int, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (``n``) and float32 scales (one per bucket) of flat ``x``; ``noise`` is U[0,1)."""
    flat = x.reshape(-1).astype(np.float32)
    rows = _bucketed(flat, bucket)
    scales = np.abs(rows).max(axis=1)
    safe = np.where(scales > 0, scales, np.float32(1))[:, None]
    u = _bucketed(noise.reshape(-1).astype(np.float32), bucket)
    # float32 can round 127 + u up to 128 when |x| is the scale and u is within 4e-6 of 1; 128
    # does not fit int8 and would wrap to -128, so the level is capped (the bias is negligible).
    levels = np.float32(QSGD_LEVELS)
    level = np.minimum(np.floor(np.abs(rows) / safe * levels + u), levels)
    codes = (np.sign(rows) * level).reshape(-1)[:flat.size].astype(np.int8)
    return codes, scales.astype(np.float32)


def qsgd_decompress(codes: np.ndarray, scales: np.ndarray, bucket: int) -> np.ndarray:
    """The float32 vector that ``codes`` and ``scales`` stand for."""
    n = codes.size
    rows = _bucketed(codes.astype(np.float32), bucket)
    step = (scales / np.float32(QSGD_LEVELS)).astype(np.float32)[:, None]
    return (rows * step).reshape(-1)[:n]


def qsgd_mean(per_rank: Sequence[tuple[np.ndarray, np.ndarray]], bucket: int) -> np.ndarray:
    """The mean over ranks of their decoded ``(codes, scales)``."""
    return dense_mean([qsgd_decompress(c, s, bucket) for c, s in per_rank])


# PowerSGD ---------------------------------------------------------------------------------------

def powersgd_initial_q(shape: Sequence[int], rank: int, seed: int, index: int,
                       out_last: bool = False) -> np.ndarray:
    """The first ``Q`` (cols x r of :func:`matrix_shape`) of tensor ``index``, the same on every
    rank."""
    rows, cols = matrix_shape(shape, out_last)
    r = min(rank, rows, cols)
    return philox(seed, 0, index).standard_normal((cols, r), dtype=np.float32)


def orthogonalize(p: np.ndarray) -> np.ndarray:
    """Modified Gram-Schmidt on the columns of ``p``: column i is normalised (norm + eps), then
    removed from every later column."""
    p = p.astype(np.float32).copy()
    for i in range(p.shape[1]):
        col = p[:, i]
        col /= np.float32(np.sqrt(np.sum(col * col)) + GRAM_SCHMIDT_EPS)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= np.outer(col, col @ rest)
    return p


def powersgd_mean(matrices: Sequence[np.ndarray], q: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """One PowerSGD round over the ranks' matrices with the shared ``q``.

    Returns (the approximate mean ``P Q^T``, the new shared ``Q`` for the next step, each rank's own
    contribution ``P (M_r^T P)^T`` for its error feedback).
    """
    p = orthogonalize(dense_mean([m @ q for m in matrices]))
    local_q = [m.T @ p for m in matrices]
    new_q = dense_mean(local_q)
    return p @ new_q.T, new_q, [p @ lq.T for lq in local_q]

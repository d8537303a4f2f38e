"""What one chunk of the flat gradient travels as, per ``comm.compression`` method: NumPy only, so
that a server imports it (it must never import a framework).

A :class:`Codec` encodes a float32 chunk into the raw buffers that travel (MPI carries NumPy
buffers, never pickles) and decodes them back into float32. The math is
:mod:`hvdtrain.compression.reference`'s, the spec the ring's framework kernels are tested against:

- ``none`` / ``fp16``: the chunk as float32 / float16;
- ``topk``: float32 values and int32 indices of the ``k`` largest magnitudes;
- ``randomk``: float32 values at ``k`` indices drawn from ``(seed, step, chunk)``, and those
  indices (int32): the receiver needs no draw of its own. Every worker draws the same indices,
  so a server's sum is nonzero at those only, and its pull (the same draw, unscaled) is exact;
- ``qsgd``: int8 codes and float32 scales, one per ``comm.bucket`` elements, with noise seeded by
  ``(seed, rank, step, chunk)`` (stateless: a resumed run draws what an uninterrupted one would).

A chunk of fewer than ``comm.min_size`` elements travels dense, float32 (:meth:`Scheme.codec`).
:class:`Scheme` is one direction's method with the settings from ``HELLO``
(:class:`WireSettings`); docs/parameter-servers.md says which method each direction uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hvdtrain.compression import reference as ref

METHODS = ("none", "fp16", "topk", "randomk", "qsgd")
"""The ``comm.compression`` methods dedicated ``bsp`` servers take, by their index in ``HELLO``."""

SPARSE = ("topk", "randomk")


@dataclass(frozen=True)
class WireSettings:
    """The ``comm`` settings both ends of a push or pull need (they travel in ``HELLO``)."""

    method: str = "none"
    ratio: float = 0.01
    error_feedback: bool = True
    bucket: int = 512
    min_size: int = 1024
    seed: int = 0

    def to_ints(self) -> list[int]:
        """``HELLO``'s fields: the method's index, the ratio's float64 bits, and the integers."""
        bits = int(np.float64(self.ratio).view(np.int64))
        return [METHODS.index(self.method), bits, int(self.error_feedback), self.bucket,
                self.min_size, self.seed]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> WireSettings:
        """:meth:`to_ints` read back."""
        method, bits, feedback, bucket, min_size, seed = (int(v) for v in values)
        ratio = float(np.array([bits], np.int64).view(np.float64)[0])
        return cls(METHODS[method], ratio, bool(feedback), bucket, min_size, seed)

    @property
    def compressing(self) -> bool:
        """Whether the method compresses (keeps state: a step that seeds draws, residuals)."""
        return self.method not in ("none", "fp16")

    @property
    def sparse(self) -> bool:
        """Whether the method sends a fraction of the entries (and keeps residuals)."""
        return self.method in SPARSE

    @property
    def feedback(self) -> bool:
        """Whether each worker keeps what its push did not send (``comm.error_feedback`` with a
        sparse method)."""
        return self.sparse and self.error_feedback

    @property
    def server_feedback(self) -> bool:
        """Whether each server keeps what its pull did not send: ``topk``'s pull with
        ``comm.error_feedback`` (random-k's pull sends the whole sum, qsgd is unbiased)."""
        return self.method == "topk" and self.error_feedback


class Codec:
    """A chunk sent dense as ``dtype`` (``none``: float32, ``fp16``: float16)."""

    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = np.dtype(dtype)

    def shapes(self, n: int) -> list[tuple[int, str]]:
        """(elements, dtype) of each buffer a chunk of ``n`` elements travels as, in order."""
        return [(n, self.dtype.name)]

    def buffers(self, n: int) -> list[np.ndarray]:
        """Receive buffers for a chunk of ``n`` elements."""
        return [np.empty(size, dtype) for size, dtype in self.shapes(n)]

    def nbytes(self, n: int) -> int:
        """Bytes a chunk of ``n`` elements travels as."""
        return sum(size * np.dtype(dtype).itemsize for size, dtype in self.shapes(n))

    def encode(self, acc: np.ndarray, step: int, chunk: int, rank: int) -> list[np.ndarray]:
        """The buffers that stand for float32 ``acc`` (chunk ``chunk`` of ``rank`` at ``step``,
        which seed random draws)."""
        return [acc if acc.dtype == self.dtype else acc.astype(self.dtype)]

    def decode(self, buffers: Sequence[np.ndarray], n: int) -> np.ndarray:
        """The float32 chunk that :meth:`encode`'s ``buffers`` stand for."""
        return buffers[0] if buffers[0].dtype == np.float32 else buffers[0].astype(np.float32)

    def problem(self, buffers: Sequence[np.ndarray], n: int) -> str | None:
        """What in received ``buffers`` (of the sizes :meth:`shapes` gives) no encoder sends, or
        None: checked before :meth:`decode`, which would wrap a negative index."""
        return None


class TopK(Codec):
    """``topk``: the ``k = max(1, floor(ratio n))`` largest magnitudes, values and indices."""

    def __init__(self, ratio: float) -> None:
        super().__init__()
        self.ratio = ratio

    def shapes(self, n: int) -> list[tuple[int, str]]:
        k = ref.num_selected(n, self.ratio)
        return [(k, "float32"), (k, "int32")]

    def encode(self, acc: np.ndarray, step: int, chunk: int, rank: int) -> list[np.ndarray]:
        return list(ref.topk_compress(acc, ref.num_selected(acc.size, self.ratio)))

    def decode(self, buffers: Sequence[np.ndarray], n: int) -> np.ndarray:
        return ref.scatter(buffers[0], buffers[1], n)

    def problem(self, buffers: Sequence[np.ndarray], n: int) -> str | None:
        indices = buffers[1]
        if indices.size and not 0 <= int(indices.min()) <= int(indices.max()) < n:
            bad = int(indices.min()) if int(indices.min()) < 0 else int(indices.max())
            return f"index {bad} outside [0, {n})"
        return None


class RandomK(TopK):
    """``randomk``: the values at ``k`` indices every worker draws alike, scaled by ``n / k``
    without error feedback (unbiased), and the indices."""

    def __init__(self, ratio: float, seed: int, error_feedback: bool) -> None:
        super().__init__(ratio)
        self.seed, self.error_feedback = seed, error_feedback

    def encode(self, acc: np.ndarray, step: int, chunk: int, rank: int) -> list[np.ndarray]:
        n = acc.size
        k = ref.num_selected(n, self.ratio)
        indices = ref.randomk_indices(n, k, self.seed, step, chunk)
        scale = ref.randomk_scale(n, k, self.error_feedback)
        return [ref.randomk_compress(acc, indices, scale), indices]


class QSGD(Codec):
    """``qsgd``: int8 codes and a float32 scale per bucket; unbiased, so no error feedback."""

    def __init__(self, bucket: int, seed: int) -> None:
        super().__init__()
        self.bucket, self.seed = bucket, seed

    def shapes(self, n: int) -> list[tuple[int, str]]:
        return [(n, "int8"), (ref.qsgd_buckets(n, self.bucket), "float32")]

    def encode(self, acc: np.ndarray, step: int, chunk: int, rank: int) -> list[np.ndarray]:
        noise = ref.qsgd_noise(ref.noise_seed(self.seed, rank, step, chunk), acc.size)
        return list(ref.qsgd_compress(acc, self.bucket, noise))

    def decode(self, buffers: Sequence[np.ndarray], n: int) -> np.ndarray:
        return ref.qsgd_decompress(buffers[0], buffers[1], self.bucket)

    def problem(self, buffers: Sequence[np.ndarray], n: int) -> str | None:
        codes = buffers[0]
        if codes.size and int(codes.min()) < -ref.QSGD_LEVELS:  # -128: no level of the encoder
            return f"code {int(codes.min())} outside [-{ref.QSGD_LEVELS}, {ref.QSGD_LEVELS}]"
        return None


class Scheme:
    """One direction's codec per chunk size: ``method`` for chunks of at least ``min_size``
    elements, dense ``dense`` (float32 unless ``fp16``) for smaller ones."""

    def __init__(self, settings: WireSettings, method: str) -> None:
        self.settings = settings
        self.dense = Codec("float16" if method == "fp16" else "float32")
        self.method: Codec = {"topk": TopK(settings.ratio),
                              "randomk": RandomK(settings.ratio, settings.seed,
                                                 settings.error_feedback),
                              "qsgd": QSGD(settings.bucket, settings.seed)
                              }.get(method, self.dense)

    def compresses(self, n: int) -> bool:
        """Whether a chunk of ``n`` elements travels compressed."""
        return self.method is not self.dense and ref.large_enough((n,), self.settings.min_size)

    def codec(self, n: int) -> Codec:
        """What a chunk of ``n`` elements travels as."""
        return self.method if self.compresses(n) else self.dense


def push_scheme(settings: WireSettings) -> Scheme:
    """What workers push: the run's method."""
    return Scheme(settings, settings.method)


def pull_scheme(settings: WireSettings) -> Scheme:
    """What servers send back: the run's method. Under ``randomk`` every worker pushed the same
    draw of indices, so the sum is nonzero there only and its pull, at those indices unscaled,
    is exact."""
    if settings.method == "randomk":
        return Scheme(replace(settings, error_feedback=True), "randomk")
    return Scheme(settings, settings.method)


def encode(codec: Codec, values: np.ndarray, residual: np.ndarray | None, step: int, chunk: int,
           rank: int) -> list[np.ndarray]:
    """``values`` (a float32 chunk) encoded by ``codec``, with error feedback where ``residual``
    (that chunk's, updated in place) is given: what is sent is ``values + residual``, and what it
    left unsent waits in ``residual`` for the next step. The workers' pushes and the servers'
    pulls both go through here."""
    acc = ref.error_feedback(values, residual)
    sent = codec.encode(acc, step, chunk, rank)
    if residual is not None:
        residual[:] = ref.new_residual(acc, codec.decode(sent, acc.size))
    return sent

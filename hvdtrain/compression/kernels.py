"""What a framework supplies to run the shared plans: its kernels and its state storage.

:mod:`hvdtrain.torch.compression` and :mod:`hvdtrain.tensorflow.compression` each implement
:class:`Kernels` (every compressing kernel mirrors the :mod:`hvdtrain.compression.reference`
function of the same name and is tested against it) and :class:`Store`. Tensors support ``+``,
``-``, ``*`` and ``/`` with tensors and Python numbers in both frameworks, so plans use operators
for arithmetic and these methods for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

Tensor = Any
"""A framework tensor (``torch.Tensor`` or ``tf.Tensor``)."""


class Kernels(Protocol):
    """A framework's tensor operations, as the plans call them."""

    out_last: bool
    """Whether the framework keeps a layer's outputs in a weight's last dimension (Keras) rather
    than its first (PyTorch): :func:`~hvdtrain.compression.reference.matrix_shape`."""

    def flat(self, x: Tensor) -> Tensor:
        """``x`` as a vector (row-major)."""

    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """``x`` with this shape."""

    def cast(self, x: Tensor, dtype: str) -> Tensor:
        """``x`` as ``"float32"`` or ``"float16"``."""

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """The matrix product ``a b``."""

    def transpose(self, m: Tensor) -> Tensor:
        """The transposed matrix."""

    def topk_compress(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:func:`~hvdtrain.compression.reference.topk_compress`."""

    def scatter(self, values: Tensor, indices: Tensor, n: int) -> Tensor:
        """:func:`~hvdtrain.compression.reference.scatter` (repeated indices add up)."""

    def randomk_compress(self, x: Tensor, indices: Tensor, scale: float) -> Tensor:
        """:func:`~hvdtrain.compression.reference.randomk_compress`."""

    def uniform(self, seed: Tensor, n: int) -> Tensor:
        """``n`` float32 draws from U[0, 1), a function of the scalar ``seed`` alone (stateless)."""

    def qsgd_compress(self, x: Tensor, bucket: int, noise: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`~hvdtrain.compression.reference.qsgd_compress`."""

    def qsgd_mean(self, codes: Tensor, scales: Tensor, bucket: int, size: int) -> Tensor:
        """:func:`~hvdtrain.compression.reference.qsgd_mean` of allgathered codes and scales (the
        ranks' vectors one after another, as Horovod's allgather concatenates them)."""

    def orthogonalize(self, p: Tensor) -> Tensor:
        """:func:`~hvdtrain.compression.reference.orthogonalize`."""

    def zero_at(self, x: Tensor, indices: Tensor) -> Tensor:
        """:func:`~hvdtrain.compression.reference.zero_at`."""

    def fill_zeros(self, x: Tensor, y: Tensor) -> Tensor:
        """:func:`~hvdtrain.compression.reference.fill_zeros`."""

    def clip_factor(self, tensors: Sequence[Tensor], max_norm: float) -> Tensor:
        """:func:`~hvdtrain.compression.reference.clip_factor` (a scalar tensor)."""

    def sqrt(self, x: Tensor) -> Tensor:
        """The elementwise square root."""

    def square_sum(self, tensors: Sequence[Tensor]) -> Tensor:
        """:func:`~hvdtrain.compression.reference.square_sum` (a scalar tensor)."""


class Store(Protocol):
    """A method's state slots (see :mod:`hvdtrain.compression.state`) as framework tensors."""

    def read(self, key: str) -> Tensor:
        """The slot's current value (inside traced code too)."""

    def write(self, key: str, value: Tensor) -> None:
        """Replaces the slot's value (inside traced code too)."""

    def numpy(self, key: str) -> np.ndarray:
        """A copy of the slot's value, on the host."""

    def assign(self, key: str, value: np.ndarray) -> None:
        """Sets the slot from a host array."""


class Context(NamedTuple):
    """What a plan's stages work with on one rank."""

    kernels: Kernels
    store: Store
    size: int
    """The world size (the number of contributions in an allgather)."""
    feedback: bool = False
    """Whether this step keeps error feedback for the compressed tensors (a plan's ``sent``)."""
    weights: Sequence[Tensor] | None = None
    """The parameters, in the gradients' order, where an update rule adds weight decay."""
    scalars: Mapping[str, Tensor] | None = None
    """An update rule's numbers of this step (:meth:`hvdtrain.compression.rules.Rule.scalars`), as
    scalar tensors: arguments, not constants, so that a traced stage serves every step."""

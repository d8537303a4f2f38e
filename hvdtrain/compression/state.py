"""A compression method's state, framework-free: what it holds, how it is checkpointed, and how
it re-shards when the world size changes.

State lives in named slots, one array per slot, keyed ``"<kind>/<tensor index>"``:

- ``residual/<i>`` (error feedback) differs per rank. A checkpoint holds every rank's, as one row
  per rank (shape ``(size, n)``); :func:`reshard` turns those rows into rows for another world size.
- ``velocity/<i>`` (DGC's local velocity ``u``) differs per rank, as residuals do.
- ``q/<i>`` (PowerSGD's warm start), ``momentum/<i>`` and ``variance/<i>`` (the momentum of
  tensors sent dense under DGC, compressed Adam's shared ``m`` and its ``v``) are the same on every
  rank; a checkpoint holds them once.

A checkpoint's compression entry is :func:`pack`'s dict of NumPy arrays: ``method`` (a 0-d string
array), ``step`` (int64, the exchange's step counter, which seeds random-k and qsgd's noise) and one
array per slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.errors import HvdtrainError

RESIDUAL = "residual"
"""The per-rank slot kind: what error feedback left unsent."""
Q = "q"
"""The shared slot kind: PowerSGD's ``Q``."""
VELOCITY = "velocity"
"""The per-rank slot kind: DGC's local velocity."""
MOMENTUM = "momentum"
"""The shared slot kind: momentum of dense tensors under DGC; Adam's first moment."""
VARIANCE = "variance"
"""The shared slot kind: Adam's second moment (frozen after the warm-up where compressed)."""
PER_RANK = (RESIDUAL, VELOCITY)
"""The kinds every rank holds its own value of."""


@dataclass(frozen=True)
class Slot:
    """One array of a method's state."""

    kind: str
    """:data:`RESIDUAL`, :data:`VELOCITY`, :data:`Q`, :data:`MOMENTUM` or :data:`VARIANCE`."""
    index: int
    """The tensor it belongs to (the model's parameter order)."""
    initial: np.ndarray
    """Its value before the first step (float32)."""

    @property
    def key(self) -> str:
        """The slot's name in the state and in checkpoints."""
        return slot_key(self.kind, self.index)

    @property
    def per_rank(self) -> bool:
        """Whether every rank holds its own value (gathered as rows, re-sharded on resize)."""
        return self.kind in PER_RANK


def slot_key(kind: str, index: int) -> str:
    """``"<kind>/<index>"``."""
    return f"{kind}/{index}"


def reshard(rows: np.ndarray, size: int) -> np.ndarray:
    """Per-rank state saved at one world size (a row per rank) as rows for ``size`` ranks.

    At the same size every rank keeps its own row. At another, every rank gets the old rows' mean:
    the update the ranks still owe together is the mean of their residuals, and the mean of the
    new rows is that same mean, so nothing owed is lost or counted twice.
    """
    if rows.shape[0] == size:
        return rows
    return np.repeat(rows.mean(axis=0, keepdims=True, dtype=np.float64).astype(rows.dtype),
                     size, axis=0)


def pack(method: str, step: int, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint entry: method, step and the slot arrays (per-rank ones as rows by rank)."""
    return {"method": np.array(method), "step": np.array(step, np.int64),
            **{k: np.asarray(v) for k, v in arrays.items()}}


@dataclass
class Saved:
    """A checkpoint entry read back, checked against the method of this run."""

    step: int
    shared: dict[str, np.ndarray]
    """Shared slots by key."""
    rows: dict[str, np.ndarray]
    """Per-rank slots by key, a row per rank of the run that saved them."""


def unpack(entry: Mapping[str, Any], method: str, slots: list[Slot], where: str) -> Saved:
    """Reads :func:`pack`'s entry (arrays, or anything ``np.asarray`` takes, such as CPU tensors).

    A different method is refused when the entry holds state that would be misapplied; a slot the
    entry lacks keeps its current value.
    """
    if not isinstance(entry, Mapping):  # a list of per-rank dicts: PyTorch's layout before this one
        raise HvdtrainError(f"{where}: its compression state has a layout this version does not "
                            "read; resume it with the version that wrote it")
    arrays = {k: np.asarray(v) for k, v in entry.items()}
    saved = str(arrays.get("method", method))
    if saved != method and set(arrays) - {"method", "step"}:
        raise HvdtrainError(f"{where}: its compression state is for {saved!r}, this run uses "
                            f"comm.compression={method!r}")
    step = int(arrays["step"]) if "step" in arrays else 0
    shared = {s.key: arrays[s.key] for s in slots if not s.per_rank and s.key in arrays}
    rows = {s.key: arrays[s.key] for s in slots if s.per_rank and s.key in arrays}
    return Saved(step, shared, rows)

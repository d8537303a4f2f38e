"""A compression method's state, framework-free: what it holds, how it is checkpointed, and how
it re-shards when the world size changes.

State lives in named slots, one array per slot, keyed ``"<kind>/<tensor index>"``:

- ``residual/<i>`` (error feedback) differs per rank. A checkpoint holds every rank's, as one row
  per rank (shape ``(size, n)``); :func:`reshard` turns those rows into rows for another world size.
- ``velocity/<i>`` (DGC's local velocity ``u``) differs per rank, as residuals do.
- ``q/<i>`` (PowerSGD's warm start; ``qlow/<i>`` at the adaptive rule's higher rank),
  ``momentum/<i>`` and ``variance/<i>`` (the momentum of
  tensors sent dense under DGC, compressed Adam's shared ``m`` and its ``v``) are the same on every
  rank; a checkpoint holds them once.

A checkpoint's compression entry is :func:`pack`'s dict of NumPy arrays: ``method`` (a 0-d string
array), ``step`` (int64, the exchange's step counter, which seeds random-k and qsgd's noise) and one
array per slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.errors import HvdtrainError

RESIDUAL = "residual"
"""The per-rank slot kind: what error feedback left unsent."""
Q = "q"
"""The shared slot kind: PowerSGD's ``Q``."""
Q_LOW = "qlow"
"""The shared slot kind: PowerSGD's ``Q`` at the adaptive rule's higher rank (its own warm start)."""
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
    """:data:`RESIDUAL`, :data:`VELOCITY`, :data:`Q`, :data:`Q_LOW`, :data:`MOMENTUM` or
    :data:`VARIANCE`."""
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
    for s in slots:
        got = arrays[s.key].shape[s.per_rank:] if s.key in arrays else s.initial.shape
        if got != s.initial.shape:
            raise HvdtrainError(f"{where}: its compression state {s.key} has shape {got}, this "
                                f"run's is {s.initial.shape} (another model, or a version that "
                                "laid PowerSGD's matrices out otherwise)")
    shared = {s.key: arrays[s.key] for s in slots if not s.per_rank and s.key in arrays}
    rows = {s.key: arrays[s.key] for s in slots if s.per_rank and s.key in arrays}
    return Saved(step, shared, rows)


def by_name(entry: Mapping[str, Any] | None, names: Sequence[str]) -> dict[str, Any]:
    """:func:`pack`'s entry with its slots keyed ``"<kind>/<name>"`` instead of by tensor index
    (``names``: the parameters' names in the exchange's order), so that it no longer depends on
    which tensors one exchange held: a pipeline stage's part, or a whole model's entry on its way
    into the stages of some split. Empty for no entry."""
    if not entry:
        return {}
    out: dict[str, Any] = {}
    for key, value in entry.items():
        kind, sep, index = key.partition("/")
        out[f"{kind}/{names[int(index)]}" if sep else key] = value
    return out


def by_index(entry: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any] | None:
    """:func:`by_name`'s entry (or the merge of several, :func:`merge_named`) turned back into
    :func:`pack`'s layout for an exchange over ``names``: their slots by index, others' dropped.
    None for an empty entry (nothing to restore)."""
    if not entry:
        return None
    index = {name: i for i, name in enumerate(names)}
    out: dict[str, Any] = {}
    for key, value in entry.items():
        kind, sep, name = key.partition("/")
        if not sep:
            out[key] = value
        elif name in index:
            out[slot_key(kind, index[name])] = value
    return out


def merge_named(entries: Sequence[Mapping[str, Any] | None], where: str) -> dict[str, Any]:
    """:func:`by_name` entries of disjoint parameters (the parts of a pipeline's checkpoint) as
    one; the parts of one checkpoint share the method and the step."""
    merged: dict[str, Any] = {}
    for entry in entries:
        if not entry:
            continue
        for key in ("method", "step"):
            if key in merged and key in entry and str(merged[key]) != str(entry[key]):
                raise HvdtrainError(f"{where}: its parts disagree on the compression {key} "
                                    f"({merged[key]} against {entry[key]})")
        merged.update(entry)
    return merged

"""Checkpoints of TensorFlow's sharded data parallel written by every rank (``shard.stage`` 1-2,
docs/sharding.md): the tensors of :mod:`hvdtrain.shard_files`'s layout.

Every rank writes its slices of each per-element optimizer slot (momentum, Adam's moments) to its
own safetensors part: at stage 1 one tensor per slot (its shard of the flat vector of every
trainable variable, :class:`hvdtrain.tensorflow.shard.FlatShard`), at stage 2 one per variable
and slot (its slice of each variable, :class:`hvdtrain.tensorflow.shard_grads.UnitShard`). The
variables are named ``v0``, ``v1``, ... in the model's order, so stages 1 and 2 and any number of
ranks read each other's parts; rank 0's file keeps the model (whole on every rank at these
stages) and the optimizer's scalars.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from hvdtrain.checkpoint import part_file
from hvdtrain.errors import HvdtrainError
from hvdtrain.shard import segments
from hvdtrain.shard_files import (
    PARAMS,
    PartFiles,
    ShardLayout,
    check_fits,
    part_label,
    safetensors_header,
    shard_files,
    tensor_key,
)

DTYPES: dict[np.dtype[Any], str] = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                                    np.dtype(np.float64): "F64"}
NUMPY: dict[str, np.dtype[Any]] = {name: dtype for dtype, name in DTYPES.items()}


def _names(shard: Any) -> list[str]:
    return [f"v{j}" for j in range(len(shard.sizes))]


def _per_variable(shard: Any) -> bool:
    """Whether the shard is stage 2's (a slice of each variable) rather than stage 1's."""
    return hasattr(shard, "bounds")


def pieces(shard: Any) -> list[tuple[int, int, int, int]]:
    """This rank's vector as (variable, first element, end, where it starts in the vector)."""
    if _per_variable(shard):
        return [(j, lo, hi, at) for j, ((lo, hi), at) in
                enumerate(zip(shard.bounds, shard.starts, strict=True))]
    return [(s.param, s.offset, s.offset + s.length, s.flat - shard.start)
            for s in segments(shard.sizes, shard.start, shard.stop)]


def _units(shard: Any) -> list[tuple[int, int]]:
    """Where each unit's tensor lies in this rank's vector: stage 2 a unit per variable."""
    if _per_variable(shard):
        return [(at, at + own) for at, own in zip(shard.starts, shard.owns, strict=True)]
    return [(0, shard.own)]


def layout_of(shard: Any, slots: Mapping[int, Any]) -> ShardLayout:
    """The layout of the parts this run writes; ``slots``: the per-element optimizer variables
    by index (this rank's values, or the variables)."""
    named = list(zip(_names(shard), shard.sizes, strict=True))
    units = [[entry] for entry in named] if _per_variable(shard) else [named]
    return ShardLayout(units, shard.size, 2 if _per_variable(shard) else 1,
                       {name: [size] for name, size in named},
                       {f"s{i}": DTYPES[np.dtype(str(value.dtype))] for i, value in slots.items()})


WRITE_ELEMENTS = 1 << 20
"""Elements of a slot read and written at a time: a part holds no slot's copy whole."""


def shard_part(shard: Any, slots: Mapping[int, Any], rank: int, params: Any = None
               ) -> tuple[str, dict[str, Any], Callable[[IO[bytes]], object]]:
    """This rank's part: its label, its manifest fields and the writer of its slices of each
    per-element slot (``slots``, by optimizer variable index: arrays, or variables that the
    writer reads :data:`WRITE_ELEMENTS` at a time), and of the parameters where ``params``
    (stage 3's shard variable: a rank's slices of the parameters die with it in elastic mode)."""
    tensors = [(tensor_key(u, f"s{i}"), slots[i], a, b) for i in slots
               for u, (a, b) in enumerate(_units(shard))]
    if params is not None:
        tensors += [(tensor_key(u, PARAMS), params, a, b)
                    for u, (a, b) in enumerate(_units(shard))]

    def write(fileobj: IO[bytes]) -> None:
        fileobj.write(safetensors_header(
            [(key, DTYPES[np.dtype(str(value.dtype))], [b - a],
              (b - a) * np.dtype(str(value.dtype)).itemsize) for key, value, a, b in tensors],
            {"format": "np", "shard": str(shard.rank), "shards": str(shard.size)}))
        for _, value, a, b in tensors:
            for lo in range(a, b, WRITE_ELEMENTS):
                piece = np.asarray(value[lo:min(b, lo + WRITE_ELEMENTS)])
                fileobj.write(np.ascontiguousarray(piece).data)

    return part_label(rank), {"shard": shard.rank, "of": shard.size}, write


def read_slots(source: Mapping[str, Any], shard: Any, indices: Sequence[int]
               ) -> dict[int, np.ndarray]:
    """This rank's slices of each per-element slot (by optimizer variable index) read from the
    parts of a checkpoint of shards (``source``: its directory, parts, layout), written at any
    stage 1-2 and number of ranks: only the byte ranges it needs."""
    where = source["where"]
    layout, names, paths = _opened(source, shard)
    missing = [i for i in indices if f"s{i}" not in layout.slots]
    if missing or len(indices) != len(layout.slots):
        raise HvdtrainError(f"{where} does not fit the optimizer: its slots are "
                            f"{sorted(layout.slots)}, this one's {[f's{i}' for i in indices]}")
    out: dict[int, np.ndarray] = {}
    with PartFiles(paths, layout, where) as parts:
        for i in indices:
            kind = f"s{i}"
            values = np.empty(shard.own, NUMPY[layout.slots[kind]])
            for j, lo, hi, at in pieces(shard):
                parts.fill(values[at:at + hi - lo], names[j], lo, kind)
            out[i] = values
    return out


def read_params(source: Mapping[str, Any], shard: Any) -> np.ndarray:
    """This rank's slices of the parameters (stage 3's shard variable) read from parts that hold
    them (:func:`shard_part` with ``params``), written at stage 3 and any number of ranks."""
    layout, names, paths = _opened(source, shard)
    values = np.empty(shard.own, np.float32)
    with PartFiles(paths, layout, source["where"]) as parts:
        for j, lo, hi, at in pieces(shard):
            parts.fill(values[at:at + hi - lo], names[j], lo, PARAMS)
    return values


def _opened(source: Mapping[str, Any], shard: Any) -> tuple[ShardLayout, list[str],
                                                              dict[int, Path]]:
    """The layout of a checkpoint of shards (checked against ``shard``'s variables), the
    variables' names and the path of each shard's part."""
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    names = _names(shard)
    check_fits(layout, list(zip(names, shard.sizes, strict=True)), where)
    paths = {s: part_file(Path(source["directory"]), e, where)
             for s, e in shard_files(source["entries"], layout, where).items()}
    return layout, names, paths

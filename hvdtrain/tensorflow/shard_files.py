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

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from hvdtrain.tensorflow.parts import assign_one, reference

DTYPES: dict[np.dtype[Any], str] = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                                    np.dtype(np.float64): "F64"}
NUMPY: dict[str, np.dtype[Any]] = {name: dtype for dtype, name in DTYPES.items()}


def _names(count: int) -> list[str]:
    """The parts' names of the first ``count`` trainable variables, in the model's order."""
    return [f"v{j}" for j in range(count)]


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
    named = list(zip(_names(len(shard.sizes)), shard.sizes, strict=True))
    units = [[entry] for entry in named] if _per_variable(shard) else [named]
    return ShardLayout(units, shard.size, 2 if _per_variable(shard) else 1,
                       {name: [int(d) for d in v.shape]
                        for (name, _), v in zip(named, shard.variables, strict=True)},
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
    layout, names, paths = _opened(source, shard.sizes)
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
    layout, names, paths = _opened(source, shard.sizes)
    values = np.empty(shard.own, np.float32)
    with PartFiles(paths, layout, source["where"]) as parts:
        for j, lo, hi, at in pieces(shard):
            parts.fill(values[at:at + hi - lo], names[j], lo, PARAMS)
    return values


def _opened(source: Mapping[str, Any], sizes: Sequence[int]) -> tuple[ShardLayout, list[str],
                                                                       dict[int, Path]]:
    """The layout of a checkpoint of shards (checked against the trainable variables' ``sizes``),
    the variables' names and the path of each shard's part."""
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    names = _names(len(sizes))
    check_fits(layout, list(zip(names, sizes, strict=True)), where)
    paths = {s: part_file(Path(source["directory"]), e, where)
             for s, e in shard_files(source["entries"], layout, where).items()}
    return layout, names, paths


SLOT_KINDS = "slot_kinds"
"""The meta key of a checkpoint of shards that names each slot's kind (``{"s2": "momentum"}``):
what a run on the ring or an export matches its per-variable slots by."""


def slot_kinds(slots: Mapping[int, Any], shard_var: Any) -> dict[str, str]:
    """The kind of each per-element slot (``slots``: the optimizer's, by index), from its Keras
    name ``"<shard variable's path>_<kind>"``."""
    prefix = shard_var.path.replace("/", "_") + "_"
    return {f"s{i}": v.name[len(prefix):] if v.name.startswith(prefix) else v.name
            for i, v in slots.items()}


def whole_values(source: Mapping[str, Any], sizes: Sequence[int], wanted: Sequence[
        tuple[int, str]]) -> Iterator[tuple[int, str, np.ndarray]]:
    """``(j, kind, values)`` for each of ``wanted`` (variable ``j`` of the model's trainable
    ones, sized ``sizes``; ``kind``: ``params`` or a slot ``s<i>``): that variable's flat values
    whole, assembled from every part that holds some, one at a time (the reader drops each
    before the next is read)."""
    layout, names, paths = _opened(source, sizes)
    with PartFiles(paths, layout, source["where"]) as parts:
        for j, kind in wanted:
            dtype = np.float32 if kind == PARAMS else NUMPY[layout.slots[kind]]
            values = np.empty(sizes[j], dtype)
            parts.fill(values, names[j], 0, kind)
            yield j, kind, values


def sharded_source(meta: Mapping[str, Any], restore_from: Path | None, where: str
                   ) -> dict[str, Any]:
    """The parts of a checkpoint of shards (``meta``: rank 0's file's), for
    :func:`whole_values`: they lie beside ``restore_from``."""
    if restore_from is None:
        raise HvdtrainError(f"{where}: a checkpoint of shards is read from its file only")
    return {"directory": str(restore_from.parent), "where": where,
            "entries": meta.get("parts") or [], "layout": meta["shards"]}


def assign_model(variables: Sequence[Any], trainable: Sequence[Any],
                 entries: Callable[[int], np.ndarray], source: Mapping[str, Any]) -> None:
    """Assigns a whole model's ``variables`` (``trainable``: its trainable ones, in the
    layout's order) from a checkpoint of shards: ``entries(i)`` reads ``model/<i>`` of rank 0's
    file, which is empty where the parts hold a trainable variable's values (stage 3); those are
    assembled from the parts one variable at a time."""
    where = source["where"]
    index = {id(v): j for j, v in enumerate(trainable)}
    in_parts: dict[int, Any] = {}
    for i, var in enumerate(variables):
        value = entries(i)
        if value.shape == (0,) and int(np.prod(var.shape)) > 0 and id(var) in index:
            in_parts[index[id(var)]] = var
            continue
        assign_one(var, f"model/{i}", value, where)
    sizes = [int(np.prod(v.shape)) for v in trainable]
    for j, _, values in whole_values(source, sizes, [(j, PARAMS) for j in sorted(in_parts)]):
        in_parts[j].assign(values.reshape(tuple(in_parts[j].shape)))


def assign_optimizer(optimizer: Any, trainable: Sequence[Any], arrays: Mapping[str, Any],
                     source: Mapping[str, Any], kinds: Mapping[str, str] | None) -> None:
    """Assigns the ring's ``optimizer`` (a slot per trainable variable) from a checkpoint of
    shards: each slot whole from the parts, one at a time, matched by its kind (``kinds``: the
    checkpoint's :data:`SLOT_KINDS`); the scalars (step count, learning rate, loss scale) from
    rank 0's file (``arrays``: its ``optimizer/<i>`` entries) in their order."""
    where = source["where"]
    layout = ShardLayout.from_dict(source["layout"], where)
    if layout.slots and not kinds:
        raise HvdtrainError(f"{where} does not name its optimizer slots' kinds (written before "
                            "hvdtrain did): resume it sharded (shard.stage 1-3)")
    by_kind = {kind: key for key, kind in (kinds or {}).items()}
    paths = {v.path.replace("/", "_"): j for j, v in enumerate(trainable)}
    wanted: dict[tuple[int, str], Any] = {}
    scalars = []
    for var in optimizer.variables:
        ref = reference(var.name, paths)
        if ref is None:
            scalars.append(var)
            continue
        kind = var.name[len(ref) + 1:]
        if kind not in by_kind:
            raise HvdtrainError(f"{where} does not fit the optimizer: it has no slot {kind!r} "
                                f"(its slots: {sorted(by_kind)})")
        wanted[paths[ref], by_kind[kind]] = var
    theirs = {f"optimizer/{s[1:]}" for s in layout.slots}
    positions = sorted(int(k.split("/")[1]) for k in arrays
                        if k.startswith("optimizer/") and k not in theirs)
    if len(positions) != len(scalars):
        raise HvdtrainError(f"{where} does not fit the optimizer: {len(positions)} scalars, "
                            f"this one has {len(scalars)}")
    for var, i in zip(scalars, positions, strict=True):
        assign_one(var, f"optimizer/{i}", np.asarray(arrays[f"optimizer/{i}"]), where)
    sizes = [int(np.prod(v.shape)) for v in trainable]
    for j, kind, values in whole_values(source, sizes, sorted(wanted)):
        var = wanted[j, kind]
        var.assign(values.reshape(tuple(var.shape)))


def restore_whole(model: Any, optimizer: Any, arrays: Mapping[str, np.ndarray],
                  meta: Mapping[str, Any], restore_from: Path | None, where: str) -> None:
    """A run that keeps its variables whole (the ring) given a checkpoint of shards (``arrays``
    and ``meta``: rank 0's file's): each trainable variable and each slot assembled whole from
    the parts one at a time, the rest from rank 0's file."""
    source = sharded_source(meta, restore_from, where)
    count = sum(1 for name in arrays if name.startswith("model/"))
    if count != len(model.variables):
        raise HvdtrainError(f"{where} holds {count} model variables, the model has "
                            f"{len(model.variables)}")
    trainable = model.trainable_variables
    assign_model(model.variables, trainable, lambda i: np.asarray(arrays[f"model/{i}"]), source)
    assign_optimizer(optimizer, trainable, arrays, source, meta.get(SLOT_KINDS))


def model_entries(path: Path) -> dict[str, np.ndarray]:
    """The ``model/<i>`` entries of a TensorFlow checkpoint file, where stage 3 left them empty
    (its model's variables are all trainable, in the layout's order) assembled from the parts
    beside it, each in its shape: the model a checkpoint holds, for a reader without a model
    (a test, a tool)."""
    where = str(path)
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        entries = {n: npz[n] for n in npz.files if n.startswith("model/")}
    if not isinstance(meta, dict) or meta.get("shards") is None:
        return entries
    source = sharded_source(meta, path, where)
    layout = ShardLayout.from_dict(meta["shards"], where)
    empty = sorted((n for n, v in entries.items() if v.shape == (0,)),
                   key=lambda n: int(n.split("/")[1]))
    sizes = [size for unit in layout.units for _, size in unit]
    if not empty or len(empty) != len(sizes):
        return entries
    names = _names(len(sizes))
    for j, _, values in whole_values(source, sizes, [(j, PARAMS) for j in range(len(sizes))]):
        shape = layout.shapes.get(names[j], [sizes[j]])
        entries[empty[j]] = values.reshape(shape if int(np.prod(shape)) == sizes[j] else [-1])
    return entries

"""A sharded TensorFlow run (``shard.stage`` 1-3) resumed from a checkpoint that holds its
variables whole (docs/sharding.md): the ring's (a slot per trainable variable, by global name),
or one whose rank 0 file holds the model whole (stages 1-2, or stage 3 before its parameters
went to the parts). Rank 0 reads such an entry from the file when it is reached and broadcasts
it; every rank keeps its own slices of it (:func:`hand_out`): no rank holds more than one
variable whole at a time, and at stage 3 no rank ever holds the model whole.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow.parts import assign_one, layer_variables
from hvdtrain.tensorflow.shard_files import pieces, slot_kinds


def ring_names(data: bytes, where: str) -> dict[str, int] | None:
    """The position of each optimizer entry by global name (``"<layer>.<j>/<kind>"``,
    ``"opt/<name>"``) where ``data`` is a ring run's checkpoint whose optimizer has slots per
    variable (it lists ``names/optimizer``; sharded runs write no such list); None otherwise
    (the engine's loader then reads it, or says in one line why not)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if "names/optimizer" not in npz.files:
                return None
            meta = json.loads(str(npz["meta"]))
            names = [str(n) for n in npz["names/optimizer"].tolist()]
    except Exception:  # noqa: BLE001  (not a checkpoint: the engine's loader says so)
        return None
    if not isinstance(meta, dict) or meta.get("shards") is not None or meta.get("parts"):
        return None
    if all(name.startswith("opt/") for name in names):  # no slots: positions agree
        return None
    return {name: i for i, name in enumerate(names)}


def ring_slots(data: bytes, names: Mapping[str, int], model: Any, slots: Mapping[int, Any],
               shard_var: Any, where: str) -> dict[int, dict[int, str]]:
    """For each per-element slot of the sharded optimizer (``slots``, by index), the ring
    checkpoint's entry of that slot's kind for each trainable variable (by its index), each
    checked against the variable's shape (read one at a time)."""
    layer_names = {id(v): g for g, v in layer_variables(model.layers, 0).items()}
    trainable = model.trainable_variables
    globals_ = [layer_names.get(id(v)) for v in trainable]
    if None in globals_:
        raise HvdtrainError(f"{where}: a ring's checkpoint resumes sharded only where every "
                            "trainable variable belongs to one of model.layers")
    per_variable = [n for n in names if not n.startswith("opt/")]
    if len(per_variable) != len(trainable) * len(slots):
        raise HvdtrainError(f"{where} does not fit the optimizer: {len(per_variable)} slots, "
                            f"this one has {len(slots)} a variable")
    out: dict[int, dict[int, str]] = {}
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        for key, kind in slot_kinds(slots, shard_var).items():
            entries = {}
            for j, (g, var) in enumerate(zip(globals_, trainable, strict=True)):
                at = names.get(f"{g}/{kind}")
                if at is None:
                    raise HvdtrainError(f"{where} does not fit the optimizer: no slot {g}/{kind}")
                shape = npz[f"optimizer/{at}"].shape
                if shape != tuple(var.shape):
                    raise HvdtrainError(f"{where} does not fit the model: optimizer/{at} "
                                        f"({g}/{kind}) has shape {shape}, the model "
                                        f"{tuple(var.shape)}")
                entries[j] = f"optimizer/{at}"
            out[int(key[1:])] = entries
    return out


def ring_scalars(data: bytes, names: Mapping[str, int], optimizer: Any,
                 per_element: Callable[[Any], bool], where: str) -> None:
    """Assigns the optimizer's scalars (step count, learning rate, loss scale) from a ring's
    checkpoint, by global name (``opt/<name>``)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        for var in optimizer.variables:
            if per_element(var):
                continue
            at = names.get(f"opt/{var.name}")
            if at is None:
                raise HvdtrainError(f"{where} does not fit the optimizer: no entry "
                                    f"opt/{var.name}")
            assign_one(var, f"optimizer/{at}", npz[f"optimizer/{at}"], where)


def hand_out(shard: Any, entries: Mapping[int, str], file: Mapping[str, Any], tag: str
             ) -> np.ndarray:
    """This rank's slices, in the order of ``shard.var``, of a whole checkpoint's entries
    (``entries[j]``: trainable variable ``j``'s, whole, in the file ``file["path"]``): rank 0
    reads each from the file when it is reached (the ``.npz`` opened lazily) and broadcasts it,
    and every rank keeps its slices of it (a collective, a variable at a time)."""
    mine = np.zeros(shard.own, np.float32)
    by_variable: dict[int, list[tuple[int, int, int]]] = {}
    for j, lo, hi, at in pieces(shard):
        by_variable.setdefault(j, []).append((lo, hi, at))
    npz = np.load(file["path"], allow_pickle=False) if shard.rank == 0 else None
    try:
        for j, var in enumerate(shard.variables):
            shape = tuple(var.shape)
            value = (np.asarray(npz[entries[j]], np.float32) if npz is not None
                     else np.zeros(shape, np.float32))
            got = hvd.broadcast(tf.constant(value), root_rank=0,
                                name=f"hvdtrain.shard.file.{tag}.{j}")
            del value
            flat = tf.reshape(got, [-1])
            for lo, hi, at in by_variable.get(j, []):
                mine[at:at + hi - lo] = flat[lo:hi].numpy()
            del got, flat
    finally:
        if npz is not None:
            npz.close()
    return mine

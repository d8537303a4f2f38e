"""The TensorFlow half of ``hvdtrain export`` (:mod:`hvdtrain.export`): the run's Keras model
built as training built it, given a checkpoint's weights one variable at a time as they are
read from the file, saved whole (``keras``: ``model.keras``) or as weights only (``weights.h5``:
``model.weights.h5``).

A checkpoint written whole holds the model's variables by position (``model/<i>``); one written
in parts by pipeline stages lists its parts, which hold them by global name (``model/<layer>.<j>``,
:mod:`hvdtrain.tensorflow.parts`): they are read as a run resumed without stages reads them
(each part checked against its sha256), one variable at a time. One written by sharded data
parallel (``shard.stage`` 1-3) holds at stage 3 its trainable variables in the ranks' parts
(rank 0's file: empty entries for them): each is assembled whole from the parts' slices, one at
a time (:func:`hvdtrain.tensorflow.shard_files.assign_model`)."""

from __future__ import annotations

import json
from collections.abc import Generator
from contextlib import closing
from pathlib import Path
from typing import Any

import keras
import numpy as np

from hvdtrain.adapters import make_adapter
from hvdtrain.config import Config
from hvdtrain.errors import HvdtrainError
from hvdtrain.pipeline.state import parts_misfit
from hvdtrain.registry import MODELS
from hvdtrain.tensorflow import parts, shard_files
from hvdtrain.tensorflow.models import ClassifierAdapter

FILES = {"keras": "model.keras", "weights.h5": "model.weights.h5"}
"""The file each TensorFlow format writes in the output directory."""


def checkpoint_arrays(path: Path) -> tuple[int, Generator[np.ndarray, None, None]]:
    """How many model variables a checkpoint of the TensorFlow engine written whole holds, and
    an iterator over them in the model's order that reads each from the file when it is reached
    (the file, an uncompressed ``.npz``, is never read whole: one variable's array is held at a
    time). A checkpoint in parts by pipeline stages is read by :func:`assign_parts`."""
    npz, meta = open_checkpoint(path)
    if stage_parts(meta) is not None:
        npz.close()
        raise HvdtrainError(f"export: {path} was written in parts by pipeline stages: its "
                            "variables are in the parts (assign_parts reads them)")
    try:
        count = sum(1 for name in npz.files if name.startswith("model/"))
    except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
        npz.close()
        raise not_ours(path, exc) from None
    return count, read_arrays(npz, count, path)


def open_checkpoint(path: Path) -> tuple[Any, Any]:
    """The checkpoint file opened lazily (``np.load`` of an ``.npz``: nothing but its ``meta``
    read yet) and its ``meta``; the caller closes it."""
    npz = None
    try:
        npz = np.load(path, allow_pickle=False)
        return npz, json.loads(str(npz["meta"]))
    except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
        if npz is not None:
            npz.close()
        raise not_ours(path, exc) from None


def stage_parts(meta: Any) -> list[dict[str, Any]] | None:
    """The parts that a checkpoint's ``meta`` lists when pipeline stages wrote it, else None.
    Sharded data parallel's parts (``shards`` in the meta) are not pipeline stages'
    (:func:`trained_model` assembles them)."""
    if isinstance(meta, dict) and meta.get("parts") and "shards" not in meta:
        return list(meta["parts"])
    return None


def assign_parts(model: Any, checkpoint: Path, manifest: list[dict[str, Any]]) -> None:
    """Assigns ``model``'s variables from the parts of ``checkpoint`` (``manifest``: as its meta
    lists them) by global name, as a run resumed without stages does
    (:func:`hvdtrain.tensorflow.parts.iter_parts`, sha256 checked), one variable at a time."""
    where = f"export: {checkpoint}"
    entries = {f"model/{name}": var for name, var in
               parts.layer_variables(model.layers, 0).items()}
    if len(entries) != len(model.variables):  # the layers do not hold every variable
        raise HvdtrainError(f"{where} was written in parts by pipeline stages, and the run's "
                            "model is not its layers in order: export it from a run without "
                            "stages")
    problem = parts_misfit(manifest, len(model.layers))
    if problem:
        raise HvdtrainError(f"{where} does not fit the model: {problem}")
    parts.assign_each(entries, ((name, value) for _, name, value in parts.iter_parts(
        checkpoint.parent, manifest, entries, where)), where)


def not_ours(path: Path, exc: BaseException) -> HvdtrainError:
    """The one-line error for a file that is no TensorFlow checkpoint of hvdtrain."""
    return HvdtrainError(f"export: {path} is not a TensorFlow checkpoint of hvdtrain "
                         f"({type(exc).__name__})")


def read_arrays(npz: Any, count: int, path: Path
                ) -> Generator[np.ndarray, None, None]:
    """``model/0`` to ``model/{count - 1}`` of the open ``npz``, each read when reached; the
    file is closed at the end (or when the iterator is closed)."""
    with npz:
        for i in range(count):
            try:
                value = npz[f"model/{i}"]
            except Exception as exc:  # noqa: BLE001  (a damaged member: one line naming it)
                raise not_ours(path, exc) from None
            yield value


def trained_model(cfg: Config, checkpoint: Path) -> Any:
    """The run's model (``cfg``'s adapter on its dataset) holding the checkpoint's weights,
    assigned one variable at a time as the file (or its parts) is read."""
    from hvdtrain.driver import make_dataset

    adapter = make_adapter(MODELS["tensorflow"].get(cfg.model.name), cfg.model.options,
                           cfg.model.name, ClassifierAdapter)
    model = adapter.build(make_dataset(cfg).spec())
    npz, meta = open_checkpoint(checkpoint)
    npz.close()
    manifest = stage_parts(meta)
    if manifest is not None:
        assign_parts(model, checkpoint, manifest)
        return model
    sharded = isinstance(meta, dict) and meta.get("shards") is not None
    count, arrays = checkpoint_arrays(checkpoint)
    with closing(arrays):
        if count != len(model.variables):
            raise HvdtrainError(f"export: {checkpoint} holds {count} model variables, the "
                                f"run's model has {len(model.variables)}")
        if sharded:  # sharded data parallel's: stage 3's trainable variables from the parts
            source = shard_files.sharded_source(meta, checkpoint, f"export: {checkpoint}")
            shard_files.assign_model(model.variables, model.trainable_variables,
                                     lambda _: next(arrays), source)
            return model
        for i, (var, value) in enumerate(zip(model.variables, arrays, strict=True)):
            if tuple(var.shape) != value.shape:
                raise HvdtrainError(f"export: {checkpoint}: model/{i} has shape {value.shape}, "
                                    f"the run's model has {tuple(var.shape)}")
            var.assign(value)
    return model


def export_tensorflow(cfg: Config, checkpoint: Path, fmt: str, out: Path) -> None:
    """Writes the export of ``checkpoint`` (of a run of ``cfg``) in format ``fmt`` to ``out``."""
    model: keras.Model = trained_model(cfg, checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "keras":
        model.save(str(out / FILES[fmt]))
    else:
        model.save_weights(str(out / FILES[fmt]))

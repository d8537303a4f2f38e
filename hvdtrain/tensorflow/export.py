"""The TensorFlow half of ``hvdtrain export`` (:mod:`hvdtrain.export`): the run's Keras model
built as training built it, given a checkpoint's weights, saved whole (``keras``:
``model.keras``) or as weights only (``weights.h5``: ``model.weights.h5``)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import keras
import numpy as np

from hvdtrain.adapters import make_adapter
from hvdtrain.config import Config
from hvdtrain.errors import HvdtrainError
from hvdtrain.registry import MODELS
from hvdtrain.tensorflow.models import ClassifierAdapter

FILES = {"keras": "model.keras", "weights.h5": "model.weights.h5"}
"""The file each TensorFlow format writes in the output directory."""


def checkpoint_arrays(path: Path) -> list[np.ndarray]:
    """The model's variables in a checkpoint of the TensorFlow engine, in the model's order."""
    try:
        with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            count = sum(1 for name in npz.files if name.startswith("model/"))
            arrays = [npz[f"model/{i}"] for i in range(count)]
    except Exception as exc:  # noqa: BLE001  (whatever the file holds: one line naming it)
        raise HvdtrainError(f"export: {path} is not a TensorFlow checkpoint of hvdtrain "
                            f"({type(exc).__name__})") from None
    # Sharded data parallel's parts (``shards`` in the meta) hold optimizer slots only: at
    # TensorFlow's stages 1-2 the model is whole on every rank and in rank 0's file.
    if isinstance(meta, dict) and meta.get("parts") and "shards" not in meta:
        raise HvdtrainError(f"export: {path} was written in parts by pipeline stages; "
                            "TensorFlow exports take a checkpoint of the whole model")
    return arrays


def trained_model(cfg: Config, checkpoint: Path) -> Any:
    """The run's model (``cfg``'s adapter on its dataset) holding the checkpoint's weights."""
    from hvdtrain.driver import make_dataset

    adapter = make_adapter(MODELS["tensorflow"].get(cfg.model.name), cfg.model.options,
                           cfg.model.name, ClassifierAdapter)
    model = adapter.build(make_dataset(cfg).spec())
    arrays = checkpoint_arrays(checkpoint)
    if len(arrays) != len(model.variables):
        raise HvdtrainError(f"export: {checkpoint} holds {len(arrays)} model variables, the "
                            f"run's model has {len(model.variables)}")
    for i, (var, value) in enumerate(zip(model.variables, arrays, strict=True)):
        if tuple(var.shape) != value.shape:
            raise HvdtrainError(f"export: {checkpoint}: model/{i} has shape {value.shape}, the "
                                f"run's model has {tuple(var.shape)}")
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

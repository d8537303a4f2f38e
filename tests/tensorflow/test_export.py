"""``hvdtrain export --format keras|weights.h5`` of a built-in TensorFlow model, in one process:
both files give the logits of the model in the run's checkpoint."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import keras
import numpy as np

from hvdtrain.config import save_config
from hvdtrain.driver import train
from hvdtrain.export import export
from hvdtrain.tensorflow.export import trained_model
from tests.conftest import ROOT, quiet_config


def test_a_keras_export_has_the_checkpoints_logits(tmp_path):
    cfg = quiet_config(ROOT / "configs" / "digits_tf.yaml", tmp_path, "train.max_steps=6",
                       "checkpoint.every_steps=6")
    train(cfg)
    run = Path(cfg.log.dir)
    if not (run / "config.yaml").is_file():
        save_config(cfg, run / "config.yaml")
    [checkpoint] = sorted((run / "checkpoints").glob("step-*.ckpt"))
    keras.utils.set_random_seed(1)  # another start than the run's: the checkpoint's weights decide
    model = trained_model(cfg, checkpoint)
    with np.load(io.BytesIO(checkpoint.read_bytes()), allow_pickle=False) as npz:
        assert np.array_equal(model.variables[0].numpy(), npz["model/0"])
    x = np.random.default_rng(0).random((8, *model.input_shape[1:])).astype(np.float32)
    expected = np.asarray(model(x, training=False))
    loaded = keras.saving.load_model(export(str(run), "keras") / "model.keras")
    np.testing.assert_allclose(np.asarray(loaded(x, training=False)), expected, rtol=0, atol=1e-6)
    weights = export(str(run), "weights.h5") / "model.weights.h5"
    keras.utils.set_random_seed(2)
    other = keras.models.clone_model(loaded)
    assert np.abs(np.asarray(other(x, training=False)) - expected).max() > 1e-3
    other.load_weights(weights)
    np.testing.assert_allclose(np.asarray(other(x, training=False)), expected, rtol=0, atol=1e-6)


def test_the_checkpoint_is_read_one_variable_at_a_time(tmp_path):
    """The export reads the checkpoint's variables one after another from the file: the most
    it holds at once is about one variable (4 MiB of 8), not the file's 32 MiB."""
    import json
    import tracemalloc

    from hvdtrain.tensorflow.export import checkpoint_arrays

    arrays = {f"model/{i}": np.full((1 << 20,), i, np.float32) for i in range(8)}
    path = tmp_path / "step-00000001.ckpt"
    with path.open("wb") as fileobj:
        np.savez(fileobj, meta=np.array(json.dumps({"position": {"step": 1}})), **arrays)
    del arrays
    tracemalloc.start()
    try:
        count, values = checkpoint_arrays(path)
        sums = [float(value.sum()) for value in values]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 8 and sums == [float(i << 20) for i in range(8)]
    assert peak < 3 * (4 << 20), peak  # the file read whole would be 32 MiB


def test_stage_parts_are_read_one_variable_at_a_time_and_checked(tmp_path):
    """The parts of a checkpoint by pipeline stages are read as the export and a resume without
    stages read them (``iter_parts``): one variable after another, each part checked against its
    sha256 first, an entry two parts hold taken from the first; a part changed on disk is
    refused in one line before anything of it is read."""
    import tracemalloc

    import pytest

    from hvdtrain.checkpoint import sha256_of
    from hvdtrain.errors import HvdtrainError
    from hvdtrain.tensorflow.parts import iter_parts, read_parts

    manifest = []
    for stage, layers in enumerate(((0, 1), (2, 3))):
        arrays = {f"model/{k}.0": np.full((1 << 20,), k, np.float32) for k in layers}
        arrays["optimizer/opt/iteration"] = np.array(stage, np.int64)  # in both: the first's
        path = tmp_path / f"step-00000001.stage-{stage}.part"
        with path.open("wb") as fileobj:
            np.savez(fileobj, **arrays)
        manifest.append({"file": path.name, "layers": list(layers), "sha256": sha256_of(path)})
    del arrays
    names = [f"model/{k}.0" for k in range(4)] + ["optimizer/opt/iteration"]
    tracemalloc.start()
    try:
        sums = {name: float(value.sum())
                for _, name, value in iter_parts(tmp_path, manifest, names, "the checkpoint")}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sums == {**{f"model/{k}.0": float(k << 20) for k in range(4)},
                    "optimizer/opt/iteration": 0.0}
    assert peak < 3 * (4 << 20), peak  # the parts read whole would be 16 MiB
    values, _ = read_parts(tmp_path, manifest, names, "the checkpoint")  # the resume's reader
    assert {name: float(value.sum()) for name, value in values.items()} == sums

    path = tmp_path / manifest[1]["file"]
    data = bytearray(path.read_bytes())
    data[-30] ^= 1
    path.write_bytes(bytes(data))
    read = iter_parts(tmp_path, manifest, names, "the checkpoint")
    assert [name for _, name, _ in itertools.islice(read, 3)] == [
        "model/0.0", "model/1.0", "optimizer/opt/iteration"]
    with pytest.raises(HvdtrainError, match=r"stage-1\.part differs from the manifest"):
        next(read)

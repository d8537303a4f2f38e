"""``hvdtrain export --format keras|weights.h5`` of a built-in TensorFlow model, in one process:
both files give the logits of the model in the run's checkpoint."""

from __future__ import annotations

import io
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

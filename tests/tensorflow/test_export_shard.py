"""``hvdtrain export`` of a TensorFlow run of sharded data parallel (``shard.stage=1``, one
process): its parts hold optimizer slots only and rank 0's file the whole model, so the
``keras`` export gives the checkpoint's logits."""

from __future__ import annotations

import io
import json
from pathlib import Path

import keras
import numpy as np

from hvdtrain.driver import train
from hvdtrain.export import export
from hvdtrain.tensorflow.export import trained_model
from tests.conftest import ROOT, quiet_config


def test_a_sharded_runs_checkpoint_exports_to_keras_with_its_logits(tmp_path):
    cfg = quiet_config(ROOT / "configs" / "digits_tf.yaml", tmp_path, "train.max_steps=4",
                       "checkpoint.every_steps=4", "shard.stage=1", "optim.name=adam")
    train(cfg)
    run = Path(cfg.log.dir)
    [checkpoint] = sorted((run / "checkpoints").glob("step-*.ckpt"))
    with np.load(io.BytesIO(checkpoint.read_bytes()), allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
    assert meta["parts"] and "shards" in meta  # written by every rank of the shard stages
    keras.utils.set_random_seed(1)
    model = trained_model(cfg, checkpoint)
    x = np.random.default_rng(0).random((8, *model.input_shape[1:])).astype(np.float32)
    expected = np.asarray(model(x, training=False))
    loaded = keras.saving.load_model(export(str(run), "keras") / "model.keras")
    np.testing.assert_allclose(np.asarray(loaded(x, training=False)), expected, rtol=0, atol=1e-6)
    keras.utils.set_random_seed(2)
    fresh = keras.models.clone_model(loaded)
    assert np.abs(np.asarray(fresh(x, training=False)) - expected).max() > 1e-3

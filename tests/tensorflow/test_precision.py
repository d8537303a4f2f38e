"""TensorFlow device, precision and synchronized batch norm in one process (Horovod size 1)."""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.driver import make_dataset, train
from hvdtrain.step import exchange_and_update
from hvdtrain.tensorflow.engine import TensorFlowEngine
from hvdtrain.tensorflow.syncbn import SyncBatchNormalization, convert
from tests.conftest import TF_CONFIG, hvdtrain_cli, quiet_config


def test_bf16_policy_trains_digits_to_the_bar(tmp_path):
    result = train(quiet_config(TF_CONFIG, tmp_path, "train.precision=bf16"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final"]["eval_accuracy"] >= 0.95
    assert (summary["precision"], summary["device"], summary["skipped_steps"]) == ("bf16", "cpu", 0)
    layer = result.engine.model.layers[-1]
    assert (layer.compute_dtype, layer.variable_dtype) == ("bfloat16", "float32")
    assert keras.config.dtype_policy().name == "float32"  # the process's policy is left alone


def test_fp16_starts_from_the_configured_loss_scale():
    from hvdtrain.tensorflow.precision import Precision
    for given, first in ((0.0, 2.0 ** 15), (1024.0, 1024.0)):  # 0: Keras's own
        precision = Precision("fp16", given)
        precision.optimizer = precision.wrap(keras.optimizers.SGD())
        assert precision.loss_scale() == first
    assert Precision("bf16").loss_scale() == 1.0


def test_fp16_loss_scaling_skips_an_overflow(tmp_path):
    cfg = quiet_config(TF_CONFIG, tmp_path, "train.precision=fp16", "train.max_steps=5")
    result = train(cfg)
    engine = result.engine
    assert isinstance(engine.optimizer, keras.optimizers.LossScaleOptimizer)
    before = [v.numpy().copy() for v in engine.model.trainable_variables]
    scale = float(engine.optimizer.dynamic_scale)
    engine.precision.skip()  # what every rank does when any rank's gradients overflowed
    assert engine.precision.skipped
    assert float(engine.optimizer.dynamic_scale) == scale / 2
    for old, v in zip(before, engine.model.trainable_variables, strict=True):
        assert np.array_equal(old, v.numpy())
    fresh = TensorFlowEngine(cfg, make_dataset(cfg))  # the scale travels with the optimizer state
    fresh.load_state(engine.state_bytes({"step": 5}), "test")
    assert float(fresh.optimizer.dynamic_scale) == scale / 2


def test_cuda_without_a_gpu_is_one_line_before_anything_starts(tmp_path):
    proc = hvdtrain_cli("train", str(TF_CONFIG), f"log.dir={tmp_path / 'run'}", "train.device=cuda",
                        "log.wandb=disabled")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if "hvdtrain" in line]
    assert len(lines) == 1 and "train.device='cuda': no GPU is visible" in lines[0]
    assert not (tmp_path / "run").exists()


def test_sync_batchnorm_conversion_keeps_the_layers():
    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization()(inputs)
    model = keras.Model(inputs, keras.layers.BatchNormalization()(keras.layers.Dense(3)(x)))
    assert convert(model) == 2
    layers = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert all(type(layer) is SyncBatchNormalization for layer in layers)
    assert [layer.sync_name for layer in layers] == ["hvdtrain.syncbn.0", "hvdtrain.syncbn.1"]
    out = model(np.ones((2, 4), np.float32), training=True)  # one rank: Keras's own statistics
    assert out.shape == (2, 3)


def test_fp16_with_error_feedback_keeps_residuals_in_gradient_units(tmp_path):
    """The step unscales before an exchange that keeps state (hvdtrain.step), so top-k's residuals
    hold gradients, not gradients times 2**15; an overflow skips the step and leaves them alone."""
    cfg = quiet_config(TF_CONFIG, tmp_path, "train.precision=fp16", "comm.compression=topk",
                       "comm.min_size=0", "comm.ratio=0.1", "train.max_steps=40")
    engine = train(cfg).engine
    exchange = engine.exchange

    def residuals() -> list[np.ndarray]:
        return [exchange.store.numpy(s.key) for s in exchange.slots if s.per_rank]

    kept = residuals()
    assert kept and all(np.isfinite(r).all() for r in kept)
    assert 0 < max(float(np.abs(r).max()) for r in kept) < 10.0  # a scaled one would be ~1e4
    engine.kernels._grads = [tf.fill(v.shape, np.inf) for v in engine.model.trainable_variables]
    before = [v.numpy().copy() for v in engine.model.trainable_variables]
    assert exchange_and_update(engine.kernels, exchange)["wire_bytes"] == 0.0  # nothing was sent
    assert engine.precision.skipped
    for old, new in zip(kept, residuals(), strict=True):
        np.testing.assert_array_equal(old, new)
    for old, v in zip(before, engine.model.trainable_variables, strict=True):
        np.testing.assert_array_equal(old, v.numpy())

"""The TensorFlow trainer in one process (Horovod size 1, no launcher)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.driver import make_dataset, train
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import make_sampler
from hvdtrain.tensorflow.engine import TensorFlowEngine
from tests.conftest import TF_CONFIG, quiet_config


def config(tmp_path, *overrides):
    return quiet_config(TF_CONFIG, tmp_path, *overrides)


def test_trains_digits_to_the_bar_and_checkpoints_load(tmp_path):
    cfg = config(tmp_path)
    result = train(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["framework"] == "tensorflow" and summary["world_size"] == 1
    assert summary["steps"] == 45 * 15 and summary["final"]["eval_accuracy"] >= 0.95
    assert set(summary["versions"]) == {"tensorflow", "keras", "horovod"}
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in ckpts] == ["step-00000500.ckpt", "step-00000600.ckpt", "step-00000675.ckpt"]
    fresh = TensorFlowEngine(cfg, make_dataset(cfg))
    meta = fresh.load_state(ckpts[-1].read_bytes(), "test")
    assert meta["step"] == 675 and meta["config"] == cfg.to_dict()
    for key, value in result.engine.parameters().items():
        assert np.array_equal(fresh.parameters()[key], value)
    assert int(fresh.optimizer.iterations.numpy()) == 675  # optimizer state came back too


def test_checkpoint_of_another_model_is_refused(tmp_path):
    cfg = config(tmp_path, "train.epochs=1")
    train(cfg)
    other = config(tmp_path / "b", "model.options={hidden: [64]}")
    engine = TensorFlowEngine(other, make_dataset(other))
    with pytest.raises(HvdtrainError, match=r"model/0 has shape \(64, 128\), the model has \(64, 64\)"):
        engine.load_state(next((tmp_path / "run" / "checkpoints").glob("*.ckpt")).read_bytes(), "test")


def test_accumulation_equals_the_larger_batch(tmp_path):
    big = train(config(tmp_path / "a", "data.batch_size=64", "train.epochs=2"))
    acc = train(config(tmp_path / "b", "data.batch_size=32", "train.backward_passes_per_step=2",
                       "train.epochs=2"))
    assert big.summary["steps"] == acc.summary["steps"] == 46
    for key, value in big.engine.parameters().items():
        np.testing.assert_allclose(acc.engine.parameters()[key], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, width", [("tests.tensorflow.user_models:tiny_net", 48),
                                         ("tests.tensorflow.user_models:WideNet", 96)])
def test_user_keras_model_by_import_path(tmp_path, name, width):
    result = train(config(tmp_path, f"model.name={name}", f"model.options={{width: {width}}}",
                          "train.epochs=10"))
    assert result.summary["final"]["eval_accuracy"] >= 0.9
    assert result.engine.model.layers[-2].units == width


def test_bad_model_name_lists_the_tensorflow_models(tmp_path):
    with pytest.raises(HvdtrainError, match="unknown tensorflow model 'resnet'; "
                                            "known: gpt, kerashub_causal_lm, mlp"):
        train(config(tmp_path, "model.name=resnet"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", [
    ("comm.compression=none",),
    ("comm.compression=fp16", "train.backward_passes_per_step=2"),
    ("comm.compression=none", "train.precision=fp16", "optim.name=adamw", "optim.weight_decay=0.01"),
    ("comm.compression=none", "optim.weight_decay=0.001"),
])
def test_the_fused_step_trains_as_the_split_one(tmp_path, overrides):
    """A dense method's one traced step (gradients, allreduce, update) and the split step
    (gradients, the exchange, update) give the same weights, step counts and measurements."""
    cfg = config(tmp_path, *overrides)
    fused, split = (TensorFlowEngine(cfg, make_dataset(cfg)) for _ in range(2))
    split.exchange.fusable = False  # the step then runs the exchange eagerly, one call after another
    assert fused.exchange.fusable and fused.parameters().keys() == split.parameters().keys()
    sampler = make_sampler(cfg, len(make_dataset(cfg).train()), cfg.train.backward_passes_per_step)
    plan = sampler.steps(0, 0, 1)
    for number, indices in enumerate(list(plan)[:6]):
        lr = 0.05 * (number + 1)
        assert fused.train_step(indices, lr) == split.train_step(indices, lr)
        assert set(fused.step_stats()) == set(split.step_stats())
    for key, value in split.parameters().items():
        np.testing.assert_array_equal(fused.parameters()[key], value, err_msg=key)
    assert fused.exchange.step == split.exchange.step == 6

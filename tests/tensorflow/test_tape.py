""":class:`hvdtrain.tensorflow.tape.TapeTrainer` in one process: a resume from a mid-epoch
checkpoint ends bit-identical to the uninterrupted loop; bad use is one line."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.data.digits import DigitsDataset
from hvdtrain.errors import HvdtrainError
from hvdtrain.tensorflow import MLP
from hvdtrain.tensorflow.tape import TapeTrainer
from tests.conftest import CONFIG, TF_CONFIG

QUIET = ["log.console=false", "log.wandb=disabled"]


def loop(trainer: TapeTrainer, resume_from: Path | None = None) -> dict[str, np.ndarray]:
    dataset = DigitsDataset()
    model, _ = trainer.setup(MLP(hidden=[128]).build(dataset.spec()))
    if resume_from is not None:
        assert trainer.load(resume_from)
    split = dataset.train()
    batches = trainer.dataset(split.x, split.y)
    for epoch in trainer.epochs():
        batches.set_epoch(epoch)
        for x, y in batches:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True))
            trainer.apply_gradients(tape, loss)
    trainer.close()
    return trainer.parameters()


def test_a_resume_mid_epoch_is_bit_identical(tmp_path):
    # 1,437 samples in batches of 32: 45 steps an epoch; the checkpoint at step 30 is mid-epoch.
    run = ["train.epochs=2", "checkpoint.every_steps=30", *QUIET]
    whole = loop(TapeTrainer(TF_CONFIG, [*run, f"log.dir={tmp_path / 'whole'}"]))
    saved = sorted(p.name for p in (tmp_path / "whole" / "checkpoints").glob("*.ckpt"))
    assert saved == ["step-00000030.ckpt", "step-00000060.ckpt", "step-00000090.ckpt"]
    again = TapeTrainer(TF_CONFIG, [*run, f"log.dir={tmp_path / 'again'}"])
    resumed = loop(again, tmp_path / "whole" / "checkpoints" / "step-00000030.ckpt")
    assert again.position.step == 90
    assert sorted(whole) == sorted(resumed) and len(whole) == 4
    for name, value in whole.items():
        assert np.array_equal(resumed[name], value), name


def test_apply_gradients_before_setup_and_a_torch_config_are_one_line(tmp_path):
    with pytest.raises(HvdtrainError, match=r"^framework='torch': TapeTrainer trains Keras"):
        TapeTrainer(CONFIG)
    trainer = TapeTrainer(TF_CONFIG, [f"log.dir={tmp_path}", *QUIET])
    try:
        with pytest.raises(HvdtrainError, match=r"apply_gradients\(\) before trainer.setup"):
            trainer.apply_gradients(tf.GradientTape(), tf.constant(0.0))
    finally:
        trainer.close()

